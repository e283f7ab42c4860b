"""The hostile-input catalogue of the surfaces beside the RPCs: tokens, the metrics port, the logs.

A sibling of test_hostile_inputs.py, one named case each, tried from outside against a real server: a scripted
engine (these cases are about the transport, not the pipeline) behind a token file, a metrics port and
`--log-prompts`. Some inputs are bytes no gRPC client sends (a header value that is not UTF-8, a method path
with a newline); those go over a raw HTTP/2 connection made with `h2`.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import re
import socket
import struct
import time
from collections.abc import Iterator

import grpc
import h2.config
import h2.connection
import h2.events
import pytest
import pytest_asyncio
from google.rpc import error_details_pb2, status_pb2

from loraswap.server.observability.calls import RPC_METHODS, UNKNOWN_METHOD
from loraswap.server.observability.log_format import formatter_for
from loraswap.server.observability.metrics import REQUEST_BUCKETS
from loraswap.v1 import diffusion_service_pb2 as pb
from loraswap.v1 import diffusion_service_pb2_grpc as pb_grpc
from tests.integration.test_metrics import key, scrape
from tests.support.engines import ScriptedEngine, one_step
from tests.support.logs import LOGGED_WITHIN_S, KeptRecords, keeping_records
from tests.support.servers import address_of, scripted_settings, serving

pytestmark = pytest.mark.asyncio(loop_scope="session")

GENERATE_TOKEN = "generate-token-0123456789"
ADMIN_TOKEN = "admin-token-0123456789ab"
SERVICE_PATH = "/loraswap.v1.DiffusionService"
METRICS_LOGGER = "loraswap.server.observability.metrics"
GRPC_LOGGER = "grpc._cython.cygrpc"


@pytest.fixture(scope="module")
def kept() -> Iterator[KeptRecords]:
    """Every record that reaches the root logger, gRPC's debug lines too: a token must reach no log at any level."""
    with keeping_records("", {"loraswap": logging.INFO, "grpc": logging.DEBUG}) as handler:
        yield handler


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def served(kept, tmp_path_factory):
    token_file = tmp_path_factory.mktemp("tokens") / "tokens"
    token_file.write_text(f"generate {GENERATE_TOKEN}\nadmin {ADMIN_TOKEN}\n")
    settings = scripted_settings(auth_token_file=token_file, metrics_port=0, log_prompts=True)
    async with serving(settings, engine=ScriptedEngine(one_step)) as running:
        yield running


def as_text(record: logging.LogRecord) -> str:
    return formatter_for("text").format(record)


def as_json(record: logging.LogRecord) -> str:
    return formatter_for("json").format(record)


def text_fields(line: str) -> dict[str, str]:
    """The key=value pairs of a text line, quoted values read back as the JSON strings they are."""
    return {
        name: json.loads(value) if value.startswith('"') else value
        for name, value in re.findall(r' (\w+)=("(?:[^"\\]|\\.)*"|\S+)', line)
    }


# -- a raw HTTP/2 client ---------------------------------------------------------------------------------------


def raw_grpc_call(port: int, path: bytes, metadata: list[tuple[bytes, bytes]]) -> dict[bytes, bytes]:
    """One unary gRPC call with an empty request, its headers written byte for byte as given (what no gRPC
    client sends: values that are not UTF-8, a path with a newline); the response's headers and trailers."""
    config = h2.config.H2Configuration(
        client_side=True, header_encoding=None, validate_outbound_headers=False, normalize_outbound_headers=False,
        validate_inbound_headers=False,
    )  # fmt: skip
    connection = h2.connection.H2Connection(config)
    connection.initiate_connection()
    stream = connection.get_next_available_stream_id()
    connection.send_headers(
        stream,
        [(b":method", b"POST"), (b":scheme", b"http"), (b":path", path), (b":authority", b"127.0.0.1"),
         (b"content-type", b"application/grpc"), (b"te", b"trailers"), *metadata],
    )  # fmt: skip
    connection.send_data(stream, b"\x00\x00\x00\x00\x00", end_stream=True)  # an empty message, uncompressed
    answer: dict[bytes, bytes] = {}
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(connection.data_to_send())
        while True:
            data = sock.recv(65536)
            assert data, "the server closed the connection before the call ended"
            for event in connection.receive_data(data):
                if isinstance(event, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
                    answer.update(event.headers)
                if isinstance(event, h2.events.StreamReset):
                    pytest.fail(f"the server reset the stream: {event.error_code!r}")
                if isinstance(event, h2.events.StreamEnded):
                    return answer
            sock.sendall(connection.data_to_send())


def status_of(answer: dict[bytes, bytes]) -> tuple[grpc.StatusCode, str]:
    """The status code and ErrorInfo reason of a raw call's trailers."""
    code = next(code for code in grpc.StatusCode if code.value[0] == int(answer[b"grpc-status"]))
    details = answer.get(b"grpc-status-details-bin", b"")
    reason = ""
    for detail in status_pb2.Status.FromString(base64.b64decode(details + b"=" * (-len(details) % 4))).details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            reason = info.reason
    return code, reason


# -- tokens ----------------------------------------------------------------------------------------------------

NON_ASCII_AUTHORIZATION = {
    "a UTF-8 e-acute in the token": "Bearer café-token-0123456789".encode(),
    "a lone 0xff as the token": b"Bearer \xff",
    "0xff before Bearer": b"\xffBearer " + GENERATE_TOKEN.encode(),
}


@pytest.mark.parametrize("value", NON_ASCII_AUTHORIZATION.values(), ids=NON_ASCII_AUTHORIZATION)
async def test_an_authorization_value_with_non_ascii_bytes_is_unauthenticated_logged_and_counted(
    served, kept, value: bytes
) -> None:
    request_id = f"non-ascii-{value.hex()[:24]}"
    before = await scrape(served.metrics_port)
    answer = await asyncio.to_thread(
        raw_grpc_call, served.port, f"{SERVICE_PATH}/GetServerInfo".encode(),
        [(b"authorization", value), (b"x-request-id", request_id.encode())],
    )  # fmt: skip
    assert status_of(answer) == (grpc.StatusCode.UNAUTHENTICATED, "TOKEN_INVALID")
    fields = json.loads(as_json(await kept.logged_soon(request_id)))
    assert (fields["method"], fields["code"], fields["reason"]) == ("GetServerInfo", "UNAUTHENTICATED", "TOKEN_INVALID")
    after = await scrape(served.metrics_port)
    refused = key("loraswap_requests_total", method="GetServerInfo", code="UNAUTHENTICATED")
    assert after[refused] - before.get(refused, 0) == 1
    invalid = key("loraswap_errors_total", reason="TOKEN_INVALID")
    assert after[invalid] - before.get(invalid, 0) == 1


REFUSED = (grpc.StatusCode.UNAUTHENTICATED, "TOKEN_INVALID")
# header sent -> the call's status and reason (the token read with a stray byte is no token this server knows)
STRAY_BYTES_AROUND_A_TOKEN = {
    "0xff after the admin token": ((b"authorization", b"Bearer " + ADMIN_TOKEN.encode() + b"\xff"), REFUSED),
    "0xff before the admin token": ((b"authorization", b"Bearer \xff" + ADMIN_TOKEN.encode()), REFUSED),
    "a bare 0x80 after the admin token": ((b"authorization", b"Bearer " + ADMIN_TOKEN.encode() + b"\x80"), REFUSED),
    "the admin token in another header, then 0xff": (
        (b"x-forwarded-authorization", ADMIN_TOKEN.encode() + b"\xff"), (grpc.StatusCode.OK, ""),
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", STRAY_BYTES_AROUND_A_TOKEN.values(), ids=STRAY_BYTES_AROUND_A_TOKEN)
async def test_a_token_with_stray_bytes_around_it_never_reaches_a_log(
    served, kept, capfd: pytest.CaptureFixture[str], case
) -> None:
    header, expected = case
    start = len(kept.records)
    metadata = [header]
    if header[0] != b"authorization":
        metadata.append((b"authorization", f"Bearer {GENERATE_TOKEN}".encode()))
    answer = await asyncio.to_thread(raw_grpc_call, served.port, f"{SERVICE_PATH}/GetServerInfo".encode(), metadata)
    assert status_of(answer) == expected
    await asyncio.sleep(0.1)  # any line the call makes after its status
    records = kept.since(start)
    # gRPC's line about the undecodable value stays, as one line without the value...
    (undecodable, *_) = [r for r in records if r.name == GRPC_LOGGER and "not logged" in r.getMessage()]
    assert "\n" not in as_text(undecodable)
    # ...and neither it nor any other line, in either format, nor anything on stdout or stderr, holds the token.
    logged = "\n".join(as_text(r) + "\n" + as_json(r) for r in records)
    written = capfd.readouterr()
    assert ADMIN_TOKEN not in logged + written.out + written.err


# -- labels a caller chooses -----------------------------------------------------------------------------------

MADE_UP_METHODS = 100


async def test_made_up_method_names_count_under_one_method_label(served, kept) -> None:
    before = await scrape(served.metrics_port)
    start = len(kept.records)
    async with grpc.aio.insecure_channel(address_of(served)) as channel:
        for number in range(MADE_UP_METHODS):
            call = channel.unary_unary(f"{SERVICE_PATH}/MadeUp{number}")(b"", timeout=30)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call
            assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
    await asyncio.sleep(0.1)
    after = await scrape(served.metrics_port)
    methods = {dict(labels)["method"] for name, labels in after if "method" in dict(labels)}
    assert methods <= {*RPC_METHODS, UNKNOWN_METHOD}
    unknown = key("loraswap_requests_total", method=UNKNOWN_METHOD, code="UNAUTHENTICATED")
    assert after[unknown] - before.get(unknown, 0) == MADE_UP_METHODS
    # At most the one unknown method's series are new: its counter, and its histogram's buckets, sum and count.
    assert len(after) - len(before) <= 1 + len(REQUEST_BUCKETS) + 3
    lines = [as_text(r) for r in kept.since(start)]
    assert not [line for line in lines if "MadeUp" in line]
    assert sum(f"method={UNKNOWN_METHOD} " in line for line in lines) == MADE_UP_METHODS


# -- the text log ----------------------------------------------------------------------------------------------

FAKE_LINE = "2026-05-01 12:00:00,123 INFO loraswap.access: Evict OK in 1.0 ms method=Evict code=OK"
TERMINAL_ESCAPES = "\x1b[2J\x1b[31m\x1b]0;owned\x07\x9b1m"


async def _forged_method_path(served) -> str:
    request_id = "forged-method-path"
    await asyncio.to_thread(
        raw_grpc_call, served.port, f"{SERVICE_PATH}/Made\n{FAKE_LINE}".encode(),
        [(b"x-request-id", request_id.encode())],
    )  # fmt: skip
    return request_id


async def _forged_adapter_name(served) -> str:
    request_id = "forged-adapter-name"
    metadata = (("authorization", f"Bearer {ADMIN_TOKEN}"), ("x-request-id", request_id))
    async with grpc.aio.insecure_channel(address_of(served)) as channel:
        with pytest.raises(grpc.aio.AioRpcError):
            await pb_grpc.DiffusionServiceStub(channel).Evict(
                pb.EvictRequest(adapter=f"x{TERMINAL_ESCAPES}\n{FAKE_LINE}\u2028"), metadata=metadata, timeout=30
            )
    return request_id


async def _forged_prompt(served) -> str:
    request_id = "forged-prompt"
    metadata = (("authorization", f"Bearer {GENERATE_TOKEN}"), ("x-request-id", request_id))
    request = pb.GenerateRequest(prompt=f"a boat{TERMINAL_ESCAPES}\r\n{FAKE_LINE}", width=32, height=32)
    async with grpc.aio.insecure_channel(address_of(served)) as channel:
        async for _ in pb_grpc.DiffusionServiceStub(channel).Generate(request, metadata=metadata, timeout=30):
            pass
    return request_id


FORGERIES = {
    "a method path with a newline": (_forged_method_path, "method", UNKNOWN_METHOD),
    "an adapter name with terminal escapes and a newline": (
        _forged_adapter_name, "adapter", f"x{TERMINAL_ESCAPES}\n{FAKE_LINE}\u2028",
    ),
    "a prompt with terminal escapes and a newline (--log-prompts)": (
        _forged_prompt, "prompt", f"a boat{TERMINAL_ESCAPES}\r\n{FAKE_LINE}",
    ),
}  # fmt: skip


@pytest.mark.parametrize("forgery", FORGERIES.values(), ids=FORGERIES)
async def test_the_text_log_cannot_be_forged(served, kept, forgery) -> None:
    call, field, sent = forgery
    start = len(kept.records)
    request_id = await call(served)
    access = await kept.logged_soon(request_id)
    line = as_text(access)
    assert line.isprintable(), line  # one line, nothing a terminal acts on
    assert text_fields(line)[field] == sent  # and the value reads back as it was sent
    # Every other line the call made (the token check's refusal, say) is one printable line too.
    for record in kept.since(start):
        if record.exc_info is None:
            assert as_text(record).isprintable(), as_text(record)


# -- the metrics port ------------------------------------------------------------------------------------------

# What http.server reads of a request line or a header line: one byte more is too long.
LINE_LIMIT = 65536
OVERSIZED = {
    "a 64 KB request line": (b"G" * (LINE_LIMIT + 1), b"G" * LINE_LIMIT, 414),
    "a 70 KB header": (
        b"GET /metrics HTTP/1.1\r\nX-Big: " + b"a" * (LINE_LIMIT + 1 - len(b"X-Big: ")),
        # 70 KB in two lines, the header never ended.
        b"GET /metrics HTTP/1.1\r\n" + (b"X-Big: " + b"a" * 35_000 + b"\r\n") * 2,
        431,
    ),
}


def _answer_to(port: int, request: bytes) -> bytes:
    """The status line the metrics port answers `request` with (sent whole, so that nothing is left unread)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer.partition(b"\r\n")[0]


def _send_and_reset(port: int, request: bytes) -> None:
    """Send `request`, then reset the connection (SO_LINGER 0) while the server still waits for the rest."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(request)
    time.sleep(0.2)  # for the server to be reading it
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


@pytest.mark.parametrize("oversized", OVERSIZED.values(), ids=OVERSIZED)
async def test_a_metrics_client_that_sends_too_much_and_resets_gets_an_http_error_and_one_log_line(
    served, kept, capfd: pytest.CaptureFixture[str], oversized
) -> None:
    whole, cut_short, status = oversized
    assert (await asyncio.to_thread(_answer_to, served.metrics_port, whole)).split(b" ")[1] == str(status).encode()
    start = len(kept.records)
    await asyncio.to_thread(_send_and_reset, served.metrics_port, cut_short)
    deadline = time.monotonic() + LOGGED_WITHIN_S
    while time.monotonic() < deadline and not [r for r in kept.since(start) if r.name == METRICS_LOGGER]:
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.2)  # anything more it might write
    errors = capfd.readouterr().err
    assert "Traceback" not in errors and "Exception occurred" not in errors
    (logged,) = [r for r in kept.since(start) if r.name == METRICS_LOGGER]
    assert logged.exc_info is None and "\n" not in as_json(logged)
    assert json.loads(as_json(logged))["client"] == "127.0.0.1"
    assert await scrape(served.metrics_port)  # and it still serves


async def test_a_scrape_whose_collection_fails_is_answered_500_and_logged_not_printed(
    kept, capfd: pytest.CaptureFixture[str]
) -> None:
    """Not a finding of the probe, the same cause: wsgiref prints a failing app's traceback on stderr."""

    def broken_levels():
        raise RuntimeError("the engine's levels are unreadable")

    async with serving(scripted_settings(metrics_port=0), engine=ScriptedEngine(one_step)) as running:
        running.observers.metrics.read_levels_from(broken_levels)
        start = len(kept.records)
        status = await asyncio.to_thread(_answer_to, running.metrics_port, b"GET /metrics HTTP/1.0\r\n\r\n")
    assert status.split(b" ")[1] == b"500"
    assert "Traceback" not in capfd.readouterr().err
    (logged,) = [r for r in kept.since(start) if r.name == METRICS_LOGGER]
    assert "unreadable" in json.loads(as_json(logged))["exc_info"]
