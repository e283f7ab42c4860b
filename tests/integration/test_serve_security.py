"""`loraswap serve` with TLS and a token file, as operators run it: incomplete or unusable settings refused at
start-up in one line, and SIGHUP rotating the certificate and the tokens without a restart or a dropped call."""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from loraswap.client import GeneratedImage, LoraswapClient, LoraswapError, Progress, TlsConfig, Unauthenticated
from tests.integration.test_serve_command import start_serve
from tests.support.certificates import TestCertificateAuthority, serial_number_of
from tests.support.servers import TEST_TORCH_THREADS

OLD_TOKEN = "old-generate-token-0123"
NEW_TOKEN = "new-generate-token-0123"
NEWER_TOKEN = "newer-generate-token-01"
ADMIN_TOKEN = "admin-token-0123456789ab"
CHANGE_WAIT_S = 30


def _replace(path: Path, content: bytes | str) -> None:
    """Write `content` to `path` the way rotation tools do: a new file renamed over the old one."""
    staged = path.with_name(path.name + ".new")
    staged.write_bytes(content.encode() if isinstance(content, str) else content)
    os.replace(staged, path)


def _served_serial(port: int, ca: TestCertificateAuthority) -> int:
    """The serial number of the certificate a new TLS connection to the server is shown."""
    context = ssl.create_default_context(cadata=ca.certificate_pem.decode())
    context.set_alpn_protocols(["h2"])
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname="localhost") as connection,
    ):
        return serial_number_of(connection.getpeercert(binary_form=True))


def _wait_until(condition, what: str) -> float:
    """Poll `condition` until it holds; return when it first did."""
    ends_at = time.monotonic() + CHANGE_WAIT_S
    while time.monotonic() < ends_at:
        if condition():
            return time.monotonic()
        time.sleep(0.1)
    raise AssertionError(f"{what} did not happen within {CHANGE_WAIT_S} s")


def _accepts(port: int, tls: TlsConfig, token: str) -> bool:
    with LoraswapClient(f"127.0.0.1:{port}", tls=tls, token=token, default_timeout=30) as client:
        try:
            client.server_info()
        except Unauthenticated:
            return False
    return True


def _stream_in_background(port: int, tls: TlsConfig, token: str):
    """A long generation on its own connection; returns (thread, [(time, event)], error holder, first-step event)."""
    events: list[tuple[float, object]] = []
    errors: list[LoraswapError] = []
    first_step = threading.Event()

    def run() -> None:
        try:
            with LoraswapClient(f"127.0.0.1:{port}", tls=tls, token=token, default_timeout=300) as client:
                for event in client.generate("in flight", seed=1, num_inference_steps=200, width=128, height=128):
                    events.append((time.monotonic(), event))
                    first_step.set()
        except LoraswapError as error:  # reported by the test's assertions
            errors.append(error)
        finally:
            first_step.set()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, events, errors, first_step


def test_sighup_rotates_certificate_and_tokens_without_dropping_calls(tmp_path: Path) -> None:
    ca = TestCertificateAuthority()
    first, second, third = ca.issue_server(), ca.issue_server(), ca.issue_server()
    certificate, key = first.write(tmp_path, "server")
    tokens = tmp_path / "tokens"
    tokens.write_text(f"generate {OLD_TOKEN}\nadmin {ADMIN_TOKEN}\n")
    tls = TlsConfig(ca_bundle=ca.certificate_pem)
    process, port = start_serve(
        "--model", "tiny-flux", "--no-compile", "--tls-cert", str(certificate), "--tls-key", str(key),
        "--auth-token-file", str(tokens),
    )  # fmt: skip
    try:
        assert _served_serial(port, ca) == first.serial_number
        thread, events, errors, first_step = _stream_in_background(port, tls, OLD_TOKEN)
        assert first_step.wait(120) and not errors, errors

        # Rotate both, as an operator would, then signal.
        _replace(certificate, second.certificate_pem)
        _replace(key, second.key_pem)
        _replace(tokens, f"generate {NEW_TOKEN}\nadmin {ADMIN_TOKEN}\n")
        process.send_signal(signal.SIGHUP)
        rotated_at = _wait_until(lambda: _served_serial(port, ca) == second.serial_number, "certificate rotation")
        assert _accepts(port, tls, NEW_TOKEN) and not _accepts(port, tls, OLD_TOKEN)

        # The call made before the rotation, on a connection with the old certificate and the old token, goes on.
        thread.join(300)
        assert not errors, errors
        assert isinstance(events[-1][1], GeneratedImage)
        assert any(at > rotated_at and isinstance(event, Progress) for at, event in events), "finished too early"

        # An unusable certificate changes nothing, while the token file read with it does change.
        certificate.write_text("not a certificate")
        _replace(tokens, f"generate {NEWER_TOKEN}\n")
        process.send_signal(signal.SIGHUP)
        _wait_until(lambda: _accepts(port, tls, NEWER_TOKEN), "token file reload")
        assert _served_serial(port, ca) == second.serial_number

        # And the other way round: an unusable token file keeps the tokens, a good certificate is taken.
        third.write(tmp_path, "server")
        tokens.write_text("admin\n")
        process.send_signal(signal.SIGHUP)
        _wait_until(lambda: _served_serial(port, ca) == third.serial_number, "certificate rotation")
        assert _accepts(port, tls, NEWER_TOKEN)

        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()


@pytest.fixture(scope="module")
def refusal_files(tmp_path_factory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("refusals")
    ca = TestCertificateAuthority()
    certificate, key = ca.issue_server().write(directory, "server")
    _, other_key = ca.issue_server().write(directory, "other")
    (directory / "ca.pem").write_bytes(ca.certificate_pem)
    (directory / "bad-tokens").write_text(f"generate {OLD_TOKEN}\nroot {ADMIN_TOKEN}\n")
    return {
        "cert": certificate, "key": key, "other_key": other_key, "ca": directory / "ca.pem",
        "bad_tokens": directory / "bad-tokens", "missing": directory / "missing.pem",
    }  # fmt: skip


@pytest.mark.parametrize(
    ("flags", "hint"),
    [
        (["--tls-cert", "{cert}"], "--tls-cert and --tls-key go together"),
        (["--tls-client-ca", "{ca}"], "--tls-client-ca needs --tls-cert and --tls-key"),
        (["--tls-cert", "{cert}", "--tls-key", "{other_key}"], "not a PEM certificate chain and its unencrypted"),
        (["--tls-cert", "{missing}", "--tls-key", "{key}"], "cannot read --tls-cert"),
        (["--auth-token-file", "{bad_tokens}"], "line 2: the role must be generate or admin"),
    ],
    ids=["cert-without-key", "client-ca-without-tls", "mismatched-key", "missing-cert", "bad-token-file"],
)
def test_unusable_security_settings_are_refused_at_start_up_in_one_line(refusal_files, flags, hint) -> None:
    argv = [flag.format(**refusal_files) for flag in flags]
    finished = subprocess.run(
        [sys.executable, "-m", "loraswap.client.command", "serve", "--host", "127.0.0.1", "--port", "0",
         "--model", "tiny-flux", "--no-compile", *argv],
        capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "LORASWAP_TORCH_THREADS": str(TEST_TORCH_THREADS)},
    )  # fmt: skip
    assert finished.returncode == 2, finished.stderr
    (line,) = [line for line in finished.stderr.splitlines() if line.startswith("loraswap serve:")]
    assert hint in line, line
    assert ADMIN_TOKEN not in finished.stderr and OLD_TOKEN not in finished.stderr
    assert "serving" not in finished.stdout
