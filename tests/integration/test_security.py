"""TLS only, mTLS, and bearer tokens with roles, on real servers on port 0 with certificates made at test time.

One server serves the tiny Flux model with TLS and a token file (every token rule, health and reflection left
open); another requires client certificates (mTLS) and serves a scripted engine, since only the handshake
matters there.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import sys

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from loraswap.client import AsyncLoraswapClient, LoraswapError, TlsConfig
from loraswap.client import cli as client_cli
from tests.support.certificates import TestCertificateAuthority
from tests.support.engines import ScriptedEngine, one_step
from tests.support.servers import address_of, client_of, scripted_settings, serving

pytestmark = pytest.mark.asyncio(loop_scope="session")

GENERATE_TOKEN = "generate-token-0123456789"
ADMIN_TOKEN = "admin-token-0123456789ab"
UNKNOWN_TOKEN = "unknown-token-0123456789"


@dataclasses.dataclass(frozen=True)
class Pki:
    """The test CA's files, and a second CA that the servers do not know."""

    ca: TestCertificateAuthority
    other_ca: TestCertificateAuthority
    files: dict[str, object]


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    directory = tmp_path_factory.mktemp("pki")
    ca, other_ca = TestCertificateAuthority(), TestCertificateAuthority("another CA")
    (directory / "ca.pem").write_bytes(ca.certificate_pem)
    server_cert, server_key = ca.issue_server().write(directory, "server")
    return Pki(
        ca=ca,
        other_ca=other_ca,
        files={"ca": directory / "ca.pem", "server_cert": server_cert, "server_key": server_key},
    )


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def secured_server(pki, flux_adapter_dir, tmp_path_factory):
    token_file = tmp_path_factory.mktemp("tokens") / "tokens"
    token_file.write_text(f"# roles\ngenerate {GENERATE_TOKEN}\nadmin {ADMIN_TOKEN}\n")
    async with serving(
        "tiny-flux", flux_adapter_dir, compile=False,
        tls_cert=pki.files["server_cert"], tls_key=pki.files["server_key"], auth_token_file=token_file,
    ) as running:  # fmt: skip
        yield running


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def mtls_server(pki):
    settings = scripted_settings(
        tls_cert=pki.files["server_cert"], tls_key=pki.files["server_key"], tls_client_ca=pki.files["ca"]
    )
    async with serving(settings, engine=ScriptedEngine(one_step)) as running:
        yield running


def _client(server, tls: TlsConfig | None, token: str | None = None) -> AsyncLoraswapClient:
    # No waiting for a server that refuses the connection: the refusal is what some tests look for.
    return client_of(server, tls=tls, token=token, default_timeout=60, wait_for_ready=False)


# -- TLS ------------------------------------------------------------------------------------------------------


async def test_tls_serves_clients_that_trust_its_ca(secured_server, pki) -> None:
    async with _client(secured_server, TlsConfig(ca_bundle=pki.ca.certificate_pem), GENERATE_TOKEN) as client:
        assert (await client.server_info()).model == "tiny-flux"


async def test_plaintext_is_refused_on_a_tls_server(secured_server) -> None:
    async with _client(secured_server, None, GENERATE_TOKEN) as client:
        with pytest.raises(LoraswapError) as refused:
            await client.server_info(timeout=10)
    assert refused.value.code is grpc.StatusCode.UNAVAILABLE


async def test_a_client_that_does_not_trust_the_servers_ca_is_refused(secured_server, pki) -> None:
    async with _client(secured_server, TlsConfig(ca_bundle=pki.other_ca.certificate_pem), GENERATE_TOKEN) as client:
        with pytest.raises(LoraswapError) as refused:
            await client.server_info(timeout=10)
    assert refused.value.code is grpc.StatusCode.UNAVAILABLE


# -- mTLS -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("client_certificate", ["none", "from another CA"])
async def test_mtls_refuses_clients_without_a_certificate_from_its_ca(mtls_server, pki, client_certificate) -> None:
    tls = TlsConfig(ca_bundle=pki.ca.certificate_pem)
    if client_certificate == "from another CA":
        issued = pki.other_ca.issue_client()
        tls = dataclasses.replace(tls, client_certificate=issued.certificate_pem, client_key=issued.key_pem)
    async with _client(mtls_server, tls) as client:
        with pytest.raises(LoraswapError) as refused:
            await client.server_info(timeout=10)
    assert refused.value.code is grpc.StatusCode.UNAVAILABLE


async def test_mtls_serves_a_client_certificate_from_its_ca(mtls_server, pki) -> None:
    issued = pki.ca.issue_client()
    tls = TlsConfig(
        ca_bundle=pki.ca.certificate_pem, client_certificate=issued.certificate_pem, client_key=issued.key_pem
    )
    async with _client(mtls_server, tls) as client:
        assert (await client.server_info()).model == "scripted"
        image = await client.generate_image("over mTLS", width=32, height=32, seed=2)
    assert image.width == 32


# -- tokens ---------------------------------------------------------------------------------------------------

RPCS = {
    "Generate": lambda client: client.generate_image("a red circle", num_inference_steps=1, seed=1),
    "ListAdapters": lambda client: client.list_adapters(),
    "GetServerInfo": lambda client: client.server_info(),
    "PreloadAdapter": lambda client: client.preload_adapter("r4-attn"),
    "Evict": lambda client: client.evict("r8-context"),
}
ADMIN_RPCS = {"PreloadAdapter", "Evict"}

# token sent -> what each RPC gets: None (served) or (status code, reason)
TOKEN_RULES = {
    None: (grpc.StatusCode.UNAUTHENTICATED, "TOKEN_MISSING"),
    UNKNOWN_TOKEN: (grpc.StatusCode.UNAUTHENTICATED, "TOKEN_INVALID"),
    GENERATE_TOKEN: None,
}


@pytest.mark.parametrize("rpc", RPCS)
@pytest.mark.parametrize("token", list(TOKEN_RULES), ids=["missing", "unknown", "generate"])
async def test_token_rules(secured_server, pki, token: str | None, rpc: str) -> None:
    expected = TOKEN_RULES[token]
    if token == GENERATE_TOKEN and rpc in ADMIN_RPCS:
        expected = (grpc.StatusCode.PERMISSION_DENIED, "ADMIN_REQUIRED")
    async with _client(secured_server, TlsConfig(ca_bundle=pki.ca.certificate_pem), token) as client:
        if expected is None:
            await RPCS[rpc](client)
            return
        with pytest.raises(LoraswapError) as refused:
            await RPCS[rpc](client)
    assert (refused.value.code, refused.value.reason) == expected
    assert all(sent not in str(refused.value) for sent in (GENERATE_TOKEN, ADMIN_TOKEN, UNKNOWN_TOKEN))


async def test_an_admin_token_may_call_everything(secured_server, pki) -> None:
    async with _client(secured_server, TlsConfig(ca_bundle=pki.ca.certificate_pem), ADMIN_TOKEN) as client:
        preloaded = await client.preload_adapter("r8-context")
        assert "r8-context" in {adapter.id for adapter in (await client.list_adapters()).adapters}
        assert await client.evict("r8-context") == preloaded.adapter.size_bytes
        assert (await client.generate_image("a red circle", num_inference_steps=1, seed=1)).seed == 1
        assert (await client.server_info()).model == "tiny-flux"


async def test_health_and_reflection_need_no_token(secured_server, pki) -> None:
    credentials = grpc.ssl_channel_credentials(pki.ca.certificate_pem)
    async with grpc.aio.secure_channel(address_of(secured_server), credentials) as channel:
        response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert response.status == health_pb2.HealthCheckResponse.SERVING

    def list_services() -> list[str]:
        with grpc.secure_channel(address_of(secured_server), credentials) as channel:
            return list(ProtoReflectionDescriptorDatabase(channel).get_services())

    assert "loraswap.v1.DiffusionService" in await asyncio.to_thread(list_services)


async def _probe(server, *flags: str) -> tuple[int, str]:
    """`python -m loraswap.server.healthcheck 127.0.0.1:PORT FLAGS` as a container runs it: exit code, stdout.
    A subprocess the event loop waits on, so the server in this loop keeps answering."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "loraswap.server.healthcheck", address_of(server), "--timeout", "10", *flags,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    stdout, _ = await asyncio.wait_for(process.communicate(), 60)
    return process.returncode, stdout.decode().strip()


async def test_the_health_probe_speaks_tls_with_the_servers_ca(secured_server, pki) -> None:
    """The Docker HEALTHCHECK probe on a TLS server: SERVING over TLS with --tls-ca (no token needed), unhealthy
    in plaintext or when the certificate does not carry the name it is told to check. Exit 1 means unhealthy,
    bad flags included (Docker reserves 2)."""
    ca = str(pki.files["ca"])
    assert await _probe(secured_server, "--tls-ca", ca) == (0, "SERVING")
    assert await _probe(secured_server, "--tls-ca", ca, "--tls-server-name", "localhost") == (0, "SERVING")
    assert (await _probe(secured_server))[0] == 1
    assert (await _probe(secured_server, "--tls-ca", ca, "--tls-server-name", "elsewhere.example"))[0] == 1


async def test_the_health_probe_presents_a_client_certificate_to_an_mtls_server(mtls_server, pki, tmp_path) -> None:
    cert, key = pki.ca.issue_client().write(tmp_path, "probe")
    ca = str(pki.files["ca"])
    assert await _probe(mtls_server, "--tls-ca", ca, "--tls-cert", str(cert), "--tls-key", str(key)) == (0, "SERVING")
    assert (await _probe(mtls_server, "--tls-ca", ca))[0] == 1
    assert (await _probe(mtls_server, "--tls-cert", str(cert), "--tls-key", str(key)))[0] == 1  # no --tls-ca


async def test_tokens_are_never_logged(secured_server, pki, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="loraswap"):
        for token in (UNKNOWN_TOKEN, GENERATE_TOKEN):
            async with _client(secured_server, TlsConfig(ca_bundle=pki.ca.certificate_pem), token) as client:
                with pytest.raises(LoraswapError):
                    await client.evict("r4-attn")
    assert "TOKEN_INVALID" in caplog.text and "ADMIN_REQUIRED" in caplog.text  # the refusals were logged...
    assert UNKNOWN_TOKEN not in caplog.text and GENERATE_TOKEN not in caplog.text  # ...without the tokens


# -- the CLI --------------------------------------------------------------------------------------------------


async def test_the_cli_connects_with_a_ca_a_client_certificate_and_a_token(
    secured_server, mtls_server, pki, tmp_path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.setenv(client_cli.TOKEN_ENV, ADMIN_TOKEN)  # read when the CLI's flags are declared
    parser = argparse.ArgumentParser()
    client_cli.register(parser.add_subparsers(dest="command", required=True))
    client_cert, client_key = pki.ca.issue_client().write(tmp_path, "client")
    ca = str(pki.files["ca"])

    mtls = parser.parse_args(["info", "--server", address_of(mtls_server), "--tls-ca", ca,
                              "--tls-cert", str(client_cert), "--tls-key", str(client_key)])  # fmt: skip
    assert await asyncio.to_thread(mtls.func, mtls) == 0
    assert json.loads(capsys.readouterr().out)["model"] == "scripted"

    admin = parser.parse_args(["preload", "r16-mlp", "--server", address_of(secured_server), "--tls-ca", ca])
    assert await asyncio.to_thread(admin.func, admin) == 0
    assert json.loads(capsys.readouterr().out)["adapter"]["id"] == "r16-mlp"
