"""Access lines and request ids of a real `shapes` server, in both log formats; start-up phases; `serve --log-format`.

The server runs in this process; a handler on the `loraswap` logger keeps the records it writes, and the
formatters `loraswap serve` uses render them, as text and as JSON, for the assertions.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading

import grpc
import pytest
import pytest_asyncio

from loraswap.client import LoraswapClient
from loraswap.server.engine.models.shapes import shapes_adapter_dir
from loraswap.server.observability.log_format import formatter_for
from loraswap.v1 import diffusion_service_pb2 as pb
from loraswap.v1 import diffusion_service_pb2_grpc as pb_grpc
from tests.support.engines import ScriptedEngine, one_step
from tests.support.logs import keeping_records
from tests.support.servers import TEST_TORCH_THREADS, address_of, client_of, server_settings, serving

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROMPT = "a secret green triangle on a yellow background"
TIMING_FIELDS = ("queue_ms", "load_ms", "swap_ms", "denoise_ms", "decode_ms")


def as_json(record: logging.LogRecord) -> dict:
    line = formatter_for("json").format(record)
    assert "\n" not in line
    return json.loads(line)


def as_text(record: logging.LogRecord) -> dict:
    """The key=value pairs of a text line (quoted values are JSON strings)."""
    line = formatter_for("text").format(record)
    assert "\n" not in line and line.startswith(f"{record.asctime} INFO loraswap.access: ")
    return {
        key: json.loads(value) if value.startswith('"') else value
        for key, value in re.findall(r' (\w+)=("(?:[^"\\]|\\.)*"|\S+)', line)
    }


@pytest.fixture(scope="module")
def kept():
    with keeping_records("loraswap", {"loraswap": logging.INFO}, logging.INFO) as handler:
        yield handler


def shapes_settings(**changes):
    return server_settings("shapes", shapes_adapter_dir(), compile=False, max_rank=32, **changes)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stub(kept):
    async with serving(shapes_settings()) as running, grpc.aio.insecure_channel(address_of(running)) as channel:
        yield pb_grpc.DiffusionServiceStub(channel)


def request_id_of(trailing_metadata) -> str:
    (value,) = [value for key, value in trailing_metadata if key == "x-request-id"]
    return value


async def generate(stub, request: pb.GenerateRequest, metadata=()) -> tuple[pb.Image, str]:
    call = stub.Generate(request, metadata=metadata, timeout=120)
    image = [response.image async for response in call if response.HasField("image")][-1]
    return image, request_id_of(await call.trailing_metadata())


async def test_generate_access_line_carries_its_fields_in_both_formats(stub, kept):
    image, request_id = await generate(
        stub, pb.GenerateRequest(prompt=PROMPT, adapter="outline", num_inference_steps=2, seed=1)
    )
    assert re.fullmatch(r"[0-9a-f]{32}", request_id)  # none sent: the server made one
    record = kept.access(request_id)
    for fields in (as_json(record), as_text(record)):
        assert {key: fields[key] for key in ("request_id", "method", "code", "reason", "adapter", "size")} == {
            "request_id": request_id, "method": "Generate", "code": "OK", "reason": "", "adapter": "outline",
            "size": f"{image.width}x{image.height}",
        }  # fmt: skip
        assert int(fields["steps"]) == 2
        assert str(fields["fused"]).lower() == str(image.fused).lower()  # as the image says (JSON true, text True)
        timings = (image.timings.queue_ms, image.timings.adapter_load_ms, image.timings.adapter_swap_ms,
                   image.timings.denoise_ms, image.timings.decode_ms)  # fmt: skip
        for field, ms in zip(TIMING_FIELDS, timings):
            assert float(fields[field]) == pytest.approx(ms, abs=0.051), field
        assert float(fields["duration_ms"]) >= image.timings.total_ms - 0.051
        assert "prompt" not in fields
    assert "secret" not in formatter_for("text").format(record) + formatter_for("json").format(record)


async def test_a_sent_request_id_round_trips_on_success_and_on_refusal(stub, kept):
    _, request_id = await generate(
        stub,
        pb.GenerateRequest(
            prompt=PROMPT,
            adapters=[pb.StackedAdapter(adapter="outline"), pb.StackedAdapter(adapter="purple", scale=0.5)],
            num_inference_steps=1,
        ),
        metadata=(("x-request-id", "caller-id-1"),),
    )
    assert request_id == "caller-id-1"
    assert as_json(kept.access("caller-id-1"))["adapter"] == "outline,purple"

    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await generate(
            stub, pb.GenerateRequest(prompt=PROMPT, num_inference_steps=0), (("x-request-id", "caller-id-2"),)
        )
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert request_id_of(refused.value.trailing_metadata()) == "caller-id-2"
    fields = as_json(kept.access("caller-id-2"))
    assert (fields["code"], fields["reason"]) == ("INVALID_ARGUMENT", "INVALID_REQUEST")
    assert not any(field in fields for field in TIMING_FIELDS)  # no image, no timings

    call = stub.Evict(pb.EvictRequest(adapter="never-loaded"), metadata=(("x-request-id", "caller-id-3"),))
    with pytest.raises(grpc.aio.AioRpcError) as missing:
        await call
    assert request_id_of(missing.value.trailing_metadata()) == "caller-id-3"
    assert as_text(kept.access("caller-id-3")) | {"duration_ms": 0} == {
        "request_id": "caller-id-3", "method": "Evict", "code": "NOT_FOUND", "reason": "ADAPTER_NOT_FOUND",
        "adapter": "never-loaded", "duration_ms": 0,
    }  # fmt: skip

    info = stub.GetServerInfo(pb.GetServerInfoRequest())
    await info
    generated = request_id_of(await info.trailing_metadata())
    assert as_json(kept.access(generated))["method"] == "GetServerInfo"


async def test_cancelled_and_timed_out_calls_are_logged_as_such(stub, kept):
    request = pb.GenerateRequest(prompt=PROMPT, num_inference_steps=200, seed=5)
    call = stub.Generate(request, metadata=(("x-request-id", "gave-up"),), timeout=120)
    async for response in call:
        if response.HasField("progress"):
            call.cancel()
            break
    with pytest.raises(grpc.aio.AioRpcError) as late:
        async for _ in stub.Generate(request, metadata=(("x-request-id", "too-late"),), timeout=0.5):
            pass
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert as_json(await kept.logged_soon("gave-up"))["code"] == "CANCELLED"
    assert as_json(await kept.logged_soon("too-late"))["code"] == "DEADLINE_EXCEEDED"


async def test_an_unusable_request_id_is_replaced(stub, kept):
    call = stub.ListAdapters(pb.ListAdaptersRequest(), metadata=(("x-request-id", "x" * 129),))
    await call
    assert re.fullmatch(r"[0-9a-f]{32}", request_id_of(await call.trailing_metadata()))


async def test_start_up_logs_each_phase_with_its_duration(stub, kept):
    phases = {
        r.phase: r.seconds for r in kept.records if r.name == "loraswap.server.engine.pipeline.startup" and hasattr(r, "phase")
    }
    assert set(phases) == {"load", "slot", "warm-up"}  # compile only when compiling
    assert all(seconds >= 0 for seconds in phases.values())


async def test_prompts_are_logged_only_with_log_prompts(kept, tmp_path):
    token = "0123456789abcdef0123456789abcdef"
    (tmp_path / "tokens").write_text(f"generate {token}\n")
    settings = shapes_settings(log_prompts=True, auth_token_file=tmp_path / "tokens")
    async with serving(settings, engine=ScriptedEngine(one_step)) as running:
        async with client_of(running, token=token) as client:
            await client.generate_image(PROMPT, seed=1)
        async with grpc.aio.insecure_channel(address_of(running)) as channel:
            call = pb_grpc.DiffusionServiceStub(channel).GetServerInfo(pb.GetServerInfoRequest())
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call
    logged = [as_json(r) for r in kept.records if r.name == "loraswap.access"]
    assert [fields["method"] for fields in logged if fields.get("prompt") == PROMPT] == ["Generate"]
    # A call the token check refuses (before any handler) is logged, with its request id returned.
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    fields = as_json(kept.access(request_id_of(refused.value.trailing_metadata())))
    assert (fields["method"], fields["code"], fields["reason"]) == ("GetServerInfo", "UNAUTHENTICATED", "TOKEN_MISSING")


async def test_serve_log_format_json_writes_one_object_per_line():
    """`loraswap serve --log-format json`: start-up phases and access lines as JSON objects on stderr."""
    errors = await asyncio.to_thread(serve_json_and_stop)
    ours = [json.loads(line) for line in errors if line.startswith('{"')]
    assert not [line for line in errors if re.match(r"\d{4}-\d\d-\d\d \S+ (INFO|WARNING|ERROR) loraswap", line)]
    phases = {
        fields["phase"]
        for fields in ours
        if fields.get("logger") == "loraswap.server.engine.pipeline.startup" and "phase" in fields
    }
    assert phases == {"load", "slot", "warm-up"}
    (access,) = [fields for fields in ours if fields.get("logger") == "loraswap.access"]
    assert (access["method"], access["code"], access["level"]) == ("GetServerInfo", "OK", "INFO")
    assert any("metrics on http://127.0.0.1:" in fields["message"] for fields in ours)


def serve_json_and_stop() -> list[str]:
    """Run `loraswap serve --log-format json`, make one call, SIGTERM it; its stderr lines."""
    process = subprocess.Popen(
        [sys.executable, "-m", "loraswap.client.command", "serve", "--host", "127.0.0.1", "--port", "0",
         "--no-compile", "--log-format", "json", "--metrics-port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "LORASWAP_TORCH_THREADS": str(TEST_TORCH_THREADS)},
    )  # fmt: skip
    errors: list[str] = []
    reader = threading.Thread(target=lambda: errors.extend(process.stderr), daemon=True)
    reader.start()
    try:
        port = None
        for line in process.stdout:
            if match := re.search(r"serving .* on port (\d+)", line):
                port = int(match.group(1))
                break
        assert port is not None, "".join(errors[-20:])
        with LoraswapClient(f"127.0.0.1:{port}", default_timeout=60) as client:
            client.server_info()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
    reader.join(timeout=10)
    return errors
