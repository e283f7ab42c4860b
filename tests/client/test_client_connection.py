"""How the client connects: the published service config (retry, wait for ready), bearer tokens, images sent in
pieces, keepalive numbers, and the blocking client over a channel the caller made.

A test double of DiffusionService on port 0 stands in for the server; only the client is needed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path

import grpc
import pytest

from loraswap import wire
from loraswap.client import (
    AsyncLoraswapClient,
    GeneratedImage,
    LoraswapClient,
    NotFound,
    Progress,
    TlsConfig,
    Unavailable,
    connection,
)
from loraswap.client import cli as client_cli
from loraswap.v1 import diffusion_service_pb2 as pb
from loraswap.v1 import diffusion_service_pb2_grpc as pb_grpc

PUBLISHED_SERVICE_CONFIG = Path(__file__).resolve().parents[2] / "protos" / "loraswap" / "v1" / "service_config.json"
TOKEN = "tok-0123456789abcdef"
MIB = 1024 * 1024
LARGE_IMAGE = os.urandom(5 * MIB + 17)  # over gRPC's default 4 MiB receive limit


class ScriptedService(pb_grpc.DiffusionServiceServicer):
    """Fails the first `unavailable_attempts` calls with a plain UNAVAILABLE; records metadata; sends a large image."""

    def __init__(self) -> None:
        self.unavailable_attempts = 0
        self.attempts = 0
        self.metadata: list[dict[str, str]] = []
        self.generate_cancelled = asyncio.Event()

    async def _count_attempt(self, context: grpc.aio.ServicerContext) -> None:
        self.attempts += 1
        self.metadata.append({key: value for key, value in context.invocation_metadata() if isinstance(value, str)})
        if self.attempts <= self.unavailable_attempts:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "try again")

    async def Generate(self, request, context):
        await self._count_attempt(context)
        if request.prompt == "endless":
            try:
                for step in range(1, 10_000):
                    yield pb.GenerateResponse(progress=pb.Progress(step=step, total_steps=10_000))
                    await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                self.generate_cancelled.set()
                raise
        yield pb.GenerateResponse(progress=pb.Progress(step=1, total_steps=1, elapsed_ms=1.0))
        # As the contract says: pieces of at most 1 MiB, then the image with the last piece.
        pieces = [LARGE_IMAGE[start : start + MIB - 1024] for start in range(0, len(LARGE_IMAGE), MIB - 1024)]
        for piece in pieces[:-1]:
            yield pb.GenerateResponse(image_chunk=pb.ImageChunk(data=piece))
        yield pb.GenerateResponse(
            image=pb.Image(data=pieces[-1], mime_type="image/png", width=2048, height=2048, seed=5)
        )

    async def GetServerInfo(self, request, context):
        await self._count_attempt(context)
        return pb.GetServerInfoResponse(model="tiny-flux", family=pb.MODEL_FAMILY_FLUX)

    async def Evict(self, request, context):
        await self._count_attempt(context)
        await context.abort(grpc.StatusCode.NOT_FOUND, f"{request.adapter} is not cached")


@pytest.fixture
async def service() -> ScriptedService:
    return ScriptedService()


def test_the_client_uses_the_published_service_config() -> None:
    published = json.loads(PUBLISHED_SERVICE_CONFIG.read_text())
    assert json.loads(wire.service_config_json()) == published
    (method_config,) = published["methodConfig"]
    assert method_config["name"] == [{"service": pb.DESCRIPTOR.services_by_name["DiffusionService"].full_name}]
    assert method_config["waitForReady"] is True
    assert method_config["retryPolicy"]["retryableStatusCodes"] == ["UNAVAILABLE"]
    options = dict(connection.client_channel_options())
    assert options["grpc.service_config"] == wire.service_config_json()
    assert "grpc.max_receive_message_length" not in options  # the default 4 MiB is enough


async def test_unavailable_is_retried_with_backoff_per_the_service_config(
    target: str, service: ScriptedService
) -> None:
    service.unavailable_attempts = 2
    async with AsyncLoraswapClient(target, default_timeout=30) as client:
        assert (await client.server_info()).model == "tiny-flux"
        assert service.attempts == 3
        image = await client.generate_image("a boat")
        assert service.attempts == 4 and image.data == LARGE_IMAGE


async def test_without_the_service_config_the_same_unavailable_fails_the_call(
    target: str, service: ScriptedService
) -> None:
    """The control: a plain channel (no retry policy) sees the first UNAVAILABLE."""
    service.unavailable_attempts = 1
    async with grpc.aio.insecure_channel(target) as plain_channel:
        client = AsyncLoraswapClient(target, channel=plain_channel, default_timeout=30)
        with pytest.raises(Unavailable):
            await client.server_info()
    assert service.attempts == 1


async def test_a_large_image_arrives_whole_through_the_default_receive_limit(target: str) -> None:
    async with AsyncLoraswapClient(target, default_timeout=30) as client:
        events = [event async for event in client.generate("a large one")]
    assert [type(event) for event in events] == [Progress, GeneratedImage]
    assert events[-1].data == LARGE_IMAGE and (events[-1].width, events[-1].seed) == (2048, 5)


@pytest.mark.parametrize("api", ["aio", "sync"])
async def test_the_token_travels_as_bearer_metadata_on_every_call(
    target: str, service: ScriptedService, api: str
) -> None:
    if api == "aio":
        async with AsyncLoraswapClient(target, token=TOKEN, default_timeout=30) as client:
            await client.server_info()
            await client.generate_image("a boat")
    else:

        def calls() -> None:
            with LoraswapClient(target, token=TOKEN, default_timeout=30) as client:
                client.server_info()
                client.generate_image("a boat")

        await asyncio.to_thread(calls)
    assert [metadata.get("authorization") for metadata in service.metadata] == [f"Bearer {TOKEN}"] * 2


async def test_no_token_sends_no_authorization(target: str, service: ScriptedService) -> None:
    async with AsyncLoraswapClient(target, default_timeout=30) as client:
        await client.server_info()
    assert "authorization" not in service.metadata[0]


@pytest.mark.parametrize("token", ["has space-0123456789", "tökén-0123456789abcd", "line\nbreak-0123456789"])
def test_a_token_metadata_cannot_carry_is_refused_at_once(token: str) -> None:
    with pytest.raises(ValueError, match="visible ASCII"):
        AsyncLoraswapClient("localhost:1", token=token)


async def test_sync_client_over_a_channel_the_caller_made(target: str, service: ScriptedService) -> None:
    def calls() -> None:
        with grpc.insecure_channel(target) as channel:
            with LoraswapClient(target, channel=channel, token=TOKEN, default_timeout=30) as client:
                assert client.server_info().model == "tiny-flux"
                assert client.generate_image("a boat").data == LARGE_IMAGE
                with pytest.raises(NotFound, match="ink is not cached"):
                    client.evict("ink")
                for event in client.generate("endless"):
                    if isinstance(event, Progress) and event.step == 3:
                        break  # leaving the loop cancels the RPC
            # close() left the caller's channel open.
            pb_grpc.DiffusionServiceStub(channel).GetServerInfo(pb.GetServerInfoRequest(), timeout=10)

    await asyncio.to_thread(calls)
    await asyncio.wait_for(service.generate_cancelled.wait(), 10)
    assert all(metadata.get("authorization") == f"Bearer {TOKEN}" for metadata in service.metadata[:-1])


def test_keepalive_numbers_agree_between_client_and_server() -> None:
    """The client pings at most half as often as the server tolerates, both well inside a 60 s idle timeout."""
    assert wire.CLIENT_KEEPALIVE_TIME_MS >= 2 * wire.SERVER_MIN_PING_INTERVAL_MS
    assert wire.CLIENT_KEEPALIVE_TIME_MS < 60_000 and wire.SERVER_KEEPALIVE_TIME_MS < 60_000
    client = dict(connection.client_channel_options())  # what the client's channels are opened with
    server = dict(wire.server_keepalive_options())  # what the server imports (app.py)
    assert client["grpc.keepalive_time_ms"] == wire.CLIENT_KEEPALIVE_TIME_MS
    assert server["grpc.http2.min_ping_interval_without_data_ms"] == wire.SERVER_MIN_PING_INTERVAL_MS
    # Without these, gRPC stops pinging after two pings on a stream that sends nothing.
    assert client["grpc.http2.max_pings_without_data"] == server["grpc.http2.max_pings_without_data"] == 0


def test_the_client_still_offers_the_wire_facts_where_it_did() -> None:
    # loraswap.wire holds them; loraswap.client.connection re-exports them for code written against it.
    for name in ("CLIENT_KEEPALIVE_TIME_MS", "KEEPALIVE_TIMEOUT_MS", "LORA_METADATA_KEY", "SERVER_KEEPALIVE_TIME_MS",
                 "SERVER_MIN_PING_INTERVAL_MS", "server_keepalive_options", "service_config_json"):  # fmt: skip
        assert getattr(connection, name) is getattr(wire, name), name


def test_tls_config_reads_pem_files_and_pairs_certificate_with_key(tmp_path: Path) -> None:
    (tmp_path / "ca.pem").write_bytes(b"CA")
    (tmp_path / "client.crt").write_bytes(b"CERT")
    (tmp_path / "client.key").write_bytes(b"KEY")
    assert TlsConfig.from_files(ca_bundle=tmp_path / "ca.pem") == TlsConfig(ca_bundle=b"CA")
    assert TlsConfig.from_files(None, tmp_path / "client.crt", tmp_path / "client.key") == TlsConfig(
        client_certificate=b"CERT", client_key=b"KEY"
    )
    with pytest.raises(ValueError, match="private key"):
        TlsConfig(client_certificate=b"CERT")


def _parse_cli(*argv: str):
    parser = argparse.ArgumentParser()
    client_cli.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


@pytest.mark.parametrize("source", ["flag", "environment"])
async def test_the_cli_sends_the_token_from_its_flag_or_the_environment(
    target: str, service: ScriptedService, source: str, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    if source == "flag":
        args = _parse_cli("info", "--server", target, "--token", TOKEN)
    else:
        monkeypatch.setenv(client_cli.TOKEN_ENV, TOKEN)
        args = _parse_cli("info", "--server", target)

    assert await asyncio.to_thread(args.func, args) == 0
    assert json.loads(capsys.readouterr().out)["model"] == "tiny-flux"
    assert service.metadata[0]["authorization"] == f"Bearer {TOKEN}"


async def test_the_cli_refuses_a_client_certificate_without_its_key(target: str, tmp_path: Path, capsys) -> None:
    (tmp_path / "client.crt").write_bytes(b"CERT")
    args = _parse_cli("info", "--server", target, "--tls-cert", str(tmp_path / "client.crt"))

    assert await asyncio.to_thread(args.func, args) == 1
    assert "--tls-cert and --tls-key go together" in capsys.readouterr().err


def test_the_cli_names_an_unreadable_pem_file(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit):
        _parse_cli("info", "--tls-ca", str(tmp_path / "missing.pem"))
    assert "cannot read" in capsys.readouterr().err
