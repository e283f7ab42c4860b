"""deploy/haproxy/front.py renders deploy/haproxy/haproxy.cfg for local replicas, plaintext or TLS both ways;
HAProxy itself (`haproxy -c`) checks each rendering, with real certificate files made at test time."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from deploy.haproxy.front import CONFIG, render_config

from tests.support.certificates import TestCertificateAuthority

PORTS = [50061, 50062, 50063]


def _check(config: str, directory: Path) -> None:
    if shutil.which("haproxy") is None:
        return  # the rendered text is still checked by the caller; .ci/run installs haproxy
    path = directory / "haproxy.cfg"
    path.write_text(config)
    result = subprocess.run(["haproxy", "-c", "-f", str(path)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def _lines(config: str, keyword: str) -> list[str]:
    return [line.strip() for line in config.splitlines() if line.strip().startswith(keyword)]


def test_plaintext_rendering_keeps_h2c_and_checks_in_plaintext(tmp_path) -> None:
    config = render_config(PORTS, "127.0.0.1:50050", tmp_path / "haproxy.sock")
    assert _lines(config, "bind ") == ["bind 127.0.0.1:50050 proto h2"]
    assert _lines(config, "server ") == [f"server replica{i} 127.0.0.1:{port}" for i, port in enumerate(PORTS, 1)]
    assert _lines(config, "tcp-check connect") == ["tcp-check connect default"]
    _check(config, tmp_path)


def test_tls_rendering_terminates_at_the_front_and_re_encrypts_with_checks_over_tls(tmp_path) -> None:
    authority = TestCertificateAuthority()
    ca = tmp_path / "ca.pem"
    ca.write_bytes(authority.certificate_pem)
    issued = authority.issue_server()
    front_pem = tmp_path / "front.pem"
    front_pem.write_bytes(issued.certificate_pem + issued.key_pem)
    config = render_config(PORTS, "127.0.0.1:50050", tmp_path / "haproxy.sock", front_pem=front_pem, replica_ca=ca)
    assert _lines(config, "bind ") == [f"bind 127.0.0.1:50050 ssl crt {front_pem} alpn h2"]
    tls = f"ssl verify required ca-file {ca} verifyhost localhost alpn h2 check-ssl check-alpn h2"
    assert _lines(config, "server ") == [f"server replica{i} 127.0.0.1:{port} {tls}" for i, port in enumerate(PORTS, 1)]
    _check(config, tmp_path)


@pytest.mark.skipif(shutil.which("haproxy") is None, reason="haproxy is not installed here (.ci/run installs it)")
def test_haproxy_refuses_a_front_certificate_without_its_key(tmp_path) -> None:
    """The check above can fail: a front PEM holding only the certificate is refused."""
    issued = TestCertificateAuthority().issue_server()
    front_pem = tmp_path / "front.pem"
    front_pem.write_bytes(issued.certificate_pem)
    config = render_config(PORTS, "127.0.0.1:50050", tmp_path / "haproxy.sock", front_pem=front_pem)
    with pytest.raises(AssertionError):
        _check(config, tmp_path)


@pytest.mark.parametrize("replicas", [2, 3, 5])
def test_hot_adapter_rules_are_written_for_every_replica_and_their_count(tmp_path, replicas) -> None:
    """The least-busy rules name every replica once (and no other), the hot share's 5N follows the replica count,
    and the file as shipped is exactly the 3-replica rendering of those lines."""
    ports = list(range(50061, 50061 + replicas))
    config = render_config(ports, "127.0.0.1:50050", tmp_path / "haproxy.sock")
    names = [f"replica{i}" for i in range(1, replicas + 1)]
    chosen = _lines(config, "http-request set-var(txn.least_busy) str(")
    assert [line.split("str(")[1].split(")")[0] for line in chosen] == names
    for name in names:
        assert sum(f"srv_conn({name})" in line for line in _lines(config, "http-request set-var(txn.score)")) == 1
    assert _lines(config, "acl adapter_over_two_fifths_of_a_replica") == [
        f"acl adapter_over_two_fifths_of_a_replica sc_http_req_rate(0),mul({5 * replicas}),sub(txn.all_calls_x2) gt 0"
    ]
    assert _lines(config, "use-server ") == ["use-server %[var(txn.least_busy)] if { var(txn.least_busy) -m found }"]
    _check(config, tmp_path)
    if replicas == 3:
        shipped = [line.strip() for line in CONFIG.read_text().splitlines() if "least_busy" in line or "mul(" in line]
        assert shipped == [line.strip() for line in config.splitlines() if "least_busy" in line or "mul(" in line]


def test_without_hot_adapters_only_the_ring_and_its_bound_place_calls(tmp_path) -> None:
    config = render_config(PORTS, "127.0.0.1:50050", tmp_path / "haproxy.sock", hot_adapters=False)
    assert _lines(config, "use-server ") == []
    assert _lines(config, "balance ") == ["balance hdr(lora)"]
    _check(config, tmp_path)
