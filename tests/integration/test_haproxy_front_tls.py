"""TLS through HAProxy: the front terminates TLS with its own certificate and re-encrypts to replicas that serve
TLS only, verifying their certificates; its gRPC health checks of those replicas run over TLS too.

Certificates come from a CA made at test time (tests/support/certificates.py); real `loraswap serve` replicas
with --tls-cert/--tls-key, a real HAProxy 2.6, real TLS channels.
"""

from __future__ import annotations

import os
import shutil
import socket
import ssl

import grpc
import pytest
from deploy.haproxy.front import LocalFront
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loraswap.client import GeneratedImage, LoraswapClient, Progress, TlsConfig
from tests.support.certificates import TestCertificateAuthority, serial_number_of

if shutil.which("haproxy") is None:
    if os.environ.get("CI"):
        raise RuntimeError("haproxy is missing in CI: .ci/run must install it (apt-get install haproxy)")
    pytest.skip("haproxy is not installed here (.ci/run installs it: apt-get install haproxy)", allow_module_level=True)

PROMPT = "a red circle on a blue background"
SERVE_FLAGS = ["--no-compile", "--torch-threads", "1", "--log-level", "WARNING"]


@pytest.fixture(scope="module")
def certificates(tmp_path_factory):
    directory = tmp_path_factory.mktemp("certificates")
    authority = TestCertificateAuthority()
    (directory / "ca.pem").write_bytes(authority.certificate_pem)
    front, replica = authority.issue_server(), authority.issue_server()
    front.write(directory, "front")
    replica.write(directory, "replica")
    return directory, front


@pytest.fixture(scope="module")
def front(certificates, tmp_path_factory):
    directory, _ = certificates
    flags = [*SERVE_FLAGS, "--tls-cert", str(directory / "replica.crt"), "--tls-key", str(directory / "replica.key")]
    with LocalFront(
        workdir=tmp_path_factory.mktemp("front"),
        replicas=2,
        serve_flags=flags,
        ready_timeout=300,
        tls_cert=directory / "front.crt",
        tls_key=directory / "front.key",
        replica_ca=directory / "ca.pem",
    ) as running:
        yield running


def test_health_checks_reach_replicas_that_serve_tls_only(front) -> None:
    stats = front.server_stats()
    assert {name: (row["status"], row["check_status"]) for name, row in stats.items()} == {
        "replica1": ("UP", "L7OK"),
        "replica2": ("UP", "L7OK"),
    }
    # The replicas refuse plaintext, so those checks (and the calls below) reached them over TLS.
    with grpc.insecure_channel(front.started[0].address) as channel, pytest.raises(grpc.RpcError) as caught:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_tls_client_generates_through_the_front_with_every_step(front, certificates) -> None:
    directory, _ = certificates
    tls = TlsConfig(ca_bundle=(directory / "ca.pem").read_bytes())
    with LoraswapClient(front.address, tls=tls, default_timeout=120) as client:
        events = list(client.generate(PROMPT, adapter="outline", seed=3, num_inference_steps=4))
    assert [event.step for event in events if isinstance(event, Progress)] == [1, 2, 3, 4]
    assert isinstance(events[-1], GeneratedImage) and events[-1].adapter == "outline"


def test_the_front_presents_its_own_certificate_and_speaks_h2(front, certificates) -> None:
    """TLS ends at the front: it shows the front's certificate (not a replica's) and selects h2 by ALPN."""
    directory, issued = certificates
    context = ssl.create_default_context(cafile=str(directory / "ca.pem"))
    context.set_alpn_protocols(["h2"])
    with (
        socket.create_connection(("127.0.0.1", front.port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        assert serial_number_of(tls.getpeercert(binary_form=True)) == issued.serial_number
        assert tls.selected_alpn_protocol() == "h2"


def test_a_plaintext_client_is_refused_by_the_tls_front(front) -> None:
    with grpc.insecure_channel(front.address) as channel, pytest.raises(grpc.RpcError) as caught:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
