"""The client library and its CLI against a test double of DiffusionService on port 0.

The double is enough here: these tests check what the client sends and how
it reads what comes back (typing, order, unset fields, deadlines,
cancellation, the blocking wrapper). The real server has its own tests.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from loraswap.client import (
    AdapterInfo,
    AdapterList,
    AsyncLoraswapClient,
    DeadlineExceeded,
    GeneratedImage,
    InvalidRequest,
    LoraswapClient,
    NotFound,
    PreloadResult,
    Progress,
    Queued,
    StackedAdapter,
    Timings,
)
from loraswap.client import cli as client_cli
from loraswap.v1 import diffusion_service_pb2 as pb
from loraswap.v1 import diffusion_service_pb2_grpc as pb_grpc

IMAGE_BYTES = b"\x89PNG\r\n\x1a\n not really a png"
MIME_BY_FORMAT = {
    pb.IMAGE_FORMAT_UNSPECIFIED: "image/png",
    pb.IMAGE_FORMAT_PNG: "image/png",
    pb.IMAGE_FORMAT_JPEG: "image/jpeg",
    pb.IMAGE_FORMAT_WEBP: "image/webp",
}
OPTIONAL_GENERATE_FIELDS = ("adapter_scale", "num_inference_steps", "guidance_scale", "width", "height", "seed")
CACHED_ADAPTER = AdapterInfo(
    id="styles/ink",
    rank=16,
    target_layers=("down.0.attn1.to_q", "down.0.attn1.to_k"),
    size_bytes=4096,
    source="/adapters/styles/ink.safetensors",
    hits=3,
    last_used_unix_ms=1_700_000_000_000,
    resident=True,
    load_ms=12.5,
    warnings=("dropped 4 text-encoder layers",),
)
# Generous enough for a loaded CI machine, short enough to keep the suite fast.
EVENT_WAIT_S = 5.0

GenerateBehaviour = Callable[[pb.GenerateRequest, grpc.aio.ServicerContext], AsyncIterator[pb.GenerateResponse]]


def applied_adapters(request: pb.GenerateRequest) -> list[pb.StackedAdapter]:
    """What the real server reports in Image.adapters: the stack, or the single adapter, each with its strength."""
    if request.adapters:
        return [
            pb.StackedAdapter(adapter=entry.adapter, scale=entry.scale if entry.HasField("scale") else 1.0)
            for entry in request.adapters
        ]
    scale = request.adapter_scale if request.HasField("adapter_scale") else 1.0
    return [pb.StackedAdapter(adapter=request.adapter, scale=scale)] if request.adapter else []


def image_for(request: pb.GenerateRequest) -> pb.Image:
    """The image the double 'generates': it echoes the request the way the real server reports it."""
    return pb.Image(
        data=IMAGE_BYTES,
        mime_type=MIME_BY_FORMAT[request.image_format],
        width=request.width if request.HasField("width") else 64,
        height=request.height if request.HasField("height") else 48,
        seed=request.seed if request.HasField("seed") else 1234,
        adapter=request.adapter,
        adapter_scale=request.adapter_scale if request.HasField("adapter_scale") else 1.0,
        timings=pb.Timings(
            queue_ms=1.0, adapter_load_ms=2.0, adapter_swap_ms=3.0, denoise_ms=4.0, decode_ms=5.0, total_ms=15.0,
            encode_prompt_ms=0.5, encode_image_ms=1.5,
        ),
        warnings=["dropped 4 text-encoder layers"],
        adapters=applied_adapters(request),
    )


async def scripted_generation(
    request: pb.GenerateRequest, context: grpc.aio.ServicerContext
) -> AsyncIterator[pb.GenerateResponse]:
    """Two queue positions, three steps, then the image."""
    yield pb.GenerateResponse(queued=pb.Queued(position=2))
    yield pb.GenerateResponse(queued=pb.Queued(position=1))
    for step in (1, 2, 3):
        yield pb.GenerateResponse(progress=pb.Progress(step=step, total_steps=3, elapsed_ms=10.0 * step))
    yield pb.GenerateResponse(image=image_for(request))


async def endless_generation(
    request: pb.GenerateRequest, context: grpc.aio.ServicerContext
) -> AsyncIterator[pb.GenerateResponse]:
    """Steps that never finish, until the client goes away."""
    step = 0
    while True:
        step += 1
        yield pb.GenerateResponse(progress=pb.Progress(step=step, total_steps=1000, elapsed_ms=step))
        await asyncio.sleep(0.02)


def rich_abort_status(code: grpc.StatusCode, message: str, reason: str, **metadata: str) -> grpc.Status:
    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.ErrorInfo(reason=reason, domain="loraswap", metadata=metadata))
    return rpc_status.to_status(status_pb2.Status(code=code.value[0], message=message, details=[detail]))


class FakeDiffusionService(pb_grpc.DiffusionServiceServicer):
    """Records what it was sent; generates by whatever ``generate_behaviour`` a test sets."""

    def __init__(self) -> None:
        self.generate_behaviour: GenerateBehaviour = scripted_generation
        self.generate_requests: list[pb.GenerateRequest] = []
        self.time_remaining_s: list[float | None] = []
        self.generate_cancelled = asyncio.Event()

    async def Generate(self, request, context):
        self.generate_requests.append(request)
        self.time_remaining_s.append(context.time_remaining())
        try:
            async for response in self.generate_behaviour(request, context):
                yield response
        except asyncio.CancelledError:
            # What a real servicer does to stop the pipeline when the client goes away.
            self.generate_cancelled.set()
            raise

    async def PreloadAdapter(self, request, context):
        return pb.PreloadAdapterResponse(adapter=adapter_info_pb(request.adapter), already_cached=True)

    async def Evict(self, request, context):
        if request.adapter != CACHED_ADAPTER.id:
            await context.abort_with_status(
                rich_abort_status(
                    grpc.StatusCode.NOT_FOUND,
                    f"adapter {request.adapter!r} is not cached; see `loraswap adapters`",
                    "ADAPTER_NOT_FOUND",
                    adapter=request.adapter,
                )
            )
        return pb.EvictResponse(freed_bytes=CACHED_ADAPTER.size_bytes)

    async def ListAdapters(self, request, context):
        return pb.ListAdaptersResponse(
            adapters=[adapter_info_pb(CACHED_ADAPTER.id)], cache_bytes=4096, cache_budget_bytes=1 << 30
        )

    async def GetServerInfo(self, request, context):
        self.time_remaining_s.append(context.time_remaining())
        return pb.GetServerInfoResponse(
            model="tiny-sdxl",
            family=pb.MODEL_FAMILY_SDXL,
            dtype="float32",
            device="cpu",
            max_rank=64,
            target_layers=["down.0.attn1.to_q"],
            compiled=False,
            recompilations=0,
            resident_adapter="styles/ink",
            size_multiple=16,
            min_size=32,
            max_size=1024,
            default_width=64,
            default_height=48,
            default_num_inference_steps=3,
            default_guidance_scale=7.5,
        )


def adapter_info_pb(name: str) -> pb.AdapterInfo:
    return pb.AdapterInfo(
        id=name,
        rank=CACHED_ADAPTER.rank,
        target_layers=CACHED_ADAPTER.target_layers,
        bytes=CACHED_ADAPTER.size_bytes,
        source=CACHED_ADAPTER.source,
        hits=CACHED_ADAPTER.hits,
        last_used_unix_ms=CACHED_ADAPTER.last_used_unix_ms,
        resident=CACHED_ADAPTER.resident,
        load_ms=CACHED_ADAPTER.load_ms,
        warnings=CACHED_ADAPTER.warnings,
    )


@pytest.fixture
async def service() -> FakeDiffusionService:
    return FakeDiffusionService()


@pytest.fixture
async def client(target: str) -> AsyncIterator[AsyncLoraswapClient]:
    async with AsyncLoraswapClient(target, default_timeout=30.0) as client:
        yield client


async def test_generate_yields_typed_events_in_order(client: AsyncLoraswapClient) -> None:
    events = [event async for event in client.generate("a lighthouse", adapter="styles/ink", adapter_scale=0.8, seed=7)]

    assert events == [
        Queued(position=2),
        Queued(position=1),
        Progress(step=1, total_steps=3, elapsed_ms=10.0),
        Progress(step=2, total_steps=3, elapsed_ms=20.0),
        Progress(step=3, total_steps=3, elapsed_ms=30.0),
        GeneratedImage(
            data=IMAGE_BYTES,
            mime_type="image/png",
            width=64,
            height=48,
            seed=7,
            adapter="styles/ink",
            adapter_scale=0.8,
            timings=Timings(
                queue_ms=1.0, adapter_load_ms=2.0, adapter_swap_ms=3.0, denoise_ms=4.0, decode_ms=5.0, total_ms=15.0,
                encode_prompt_ms=0.5, encode_image_ms=1.5,
            ),
            warnings=("dropped 4 text-encoder layers",),
            adapters=(StackedAdapter("styles/ink", 0.8),),
        ),
    ]


async def test_unset_optional_arguments_stay_unset(client: AsyncLoraswapClient, service: FakeDiffusionService) -> None:
    await client.generate_image("a lighthouse")

    request = service.generate_requests[-1]
    assert [name for name in OPTIONAL_GENERATE_FIELDS if request.HasField(name)] == []
    assert (request.prompt, request.adapter, request.negative_prompt) == ("a lighthouse", "", "")
    assert request.image_format == pb.IMAGE_FORMAT_PNG


async def test_zero_valued_optional_arguments_are_sent(
    client: AsyncLoraswapClient, service: FakeDiffusionService
) -> None:
    # Every optional field at its zero value: sent, not taken for unset.
    await client.generate_image(
        "a lighthouse", negative_prompt="fog", image_format="webp", **dict.fromkeys(OPTIONAL_GENERATE_FIELDS, 0)
    )

    request = service.generate_requests[-1]
    assert [name for name in OPTIONAL_GENERATE_FIELDS if request.HasField(name)] == list(OPTIONAL_GENERATE_FIELDS)
    assert request.negative_prompt == "fog"
    assert request.image_format == pb.IMAGE_FORMAT_WEBP


@pytest.mark.parametrize(
    ("seed", "image_format"),
    [(-1, "png"), (2**64, "png"), (None, "gif")],
    ids=["negative-seed", "seed-too-big", "unknown-format"],
)
async def test_unencodable_arguments_raise_invalid_request(
    client: AsyncLoraswapClient, service: FakeDiffusionService, seed: int | None, image_format: str
) -> None:
    with pytest.raises(InvalidRequest):
        await client.generate_image("a lighthouse", seed=seed, image_format=image_format)  # type: ignore[arg-type]

    assert service.generate_requests == []


@pytest.mark.parametrize(("fuse", "sent"), [(None, pb.FUSE_CHOICE_UNSPECIFIED), ("fused", pb.FUSE_CHOICE_FUSED),
                                           ("unfused", pb.FUSE_CHOICE_UNFUSED), ("FUSED", pb.FUSE_CHOICE_FUSED)])  # fmt: skip
async def test_the_fuse_pin_is_sent_as_the_contracts_choice(
    client: AsyncLoraswapClient, service: FakeDiffusionService, fuse: str | None, sent: int
) -> None:
    await client.generate_image("a lighthouse", adapter="ink", fuse=fuse)  # type: ignore[arg-type]

    assert service.generate_requests[-1].fuse == sent


async def test_an_unknown_fuse_pin_is_refused_before_anything_is_sent(
    client: AsyncLoraswapClient, service: FakeDiffusionService
) -> None:
    with pytest.raises(InvalidRequest, match="use fused or unfused"):
        await client.generate_image("a lighthouse", adapter="ink", fuse="sometimes")  # type: ignore[arg-type]

    assert service.generate_requests == []


async def test_a_stack_is_sent_in_any_form_and_reported_typed(
    client: AsyncLoraswapClient, service: FakeDiffusionService
) -> None:
    image = await client.generate_image(
        "a lighthouse", adapters=["styles/ink", ("paper", 0.5), StackedAdapter("hf:owner/repo", -1.25), ("fog", None)]
    )

    request = service.generate_requests[-1]
    assert (request.adapter, request.HasField("adapter_scale")) == ("", False)
    sent = [(entry.adapter, entry.scale if entry.HasField("scale") else None) for entry in request.adapters]
    assert sent == [("styles/ink", None), ("paper", 0.5), ("hf:owner/repo", -1.25), ("fog", None)]
    assert image.adapters == (
        StackedAdapter("styles/ink", 1.0),
        StackedAdapter("paper", 0.5),
        StackedAdapter("hf:owner/repo", -1.25),
        StackedAdapter("fog", 1.0),
    )


@pytest.mark.parametrize(
    "adapters",
    ["styles/ink", [("a", 1.0, 2.0)], [("a", "strong")], [3]],
    ids=["a-string", "a-triple", "a-text-scale", "a-number"],
)
async def test_unencodable_stacks_raise_invalid_request(
    client: AsyncLoraswapClient, service: FakeDiffusionService, adapters: Any
) -> None:
    with pytest.raises(InvalidRequest):
        await client.generate_image("a lighthouse", adapters=adapters)

    assert service.generate_requests == []


@pytest.mark.parametrize(
    ("timeout_kwargs", "expected_deadline_s"),
    [({}, 30.0), ({"timeout": 5.0}, 5.0), ({"timeout": None}, None)],
    ids=["client-default", "per-call", "none"],
)
async def test_deadline_is_sent(
    client: AsyncLoraswapClient,
    service: FakeDiffusionService,
    timeout_kwargs: dict[str, Any],
    expected_deadline_s: float | None,
) -> None:
    await client.server_info(**timeout_kwargs)
    await client.generate_image("a lighthouse", **timeout_kwargs)

    for remaining_s in service.time_remaining_s:
        if expected_deadline_s is None:
            assert remaining_s is None
        else:
            # gRPC rounds the deadline it puts on the wire, so allow some slack both ways.
            assert remaining_s == pytest.approx(expected_deadline_s, abs=1.0)


async def test_passed_deadline_raises_deadline_exceeded(
    client: AsyncLoraswapClient, service: FakeDiffusionService
) -> None:
    service.generate_behaviour = endless_generation

    with pytest.raises(DeadlineExceeded) as raised:
        await client.generate_image("a lighthouse", timeout=0.2)

    assert isinstance(raised.value.__cause__, grpc.aio.AioRpcError)


async def test_breaking_out_of_the_stream_cancels_the_rpc(
    client: AsyncLoraswapClient, service: FakeDiffusionService
) -> None:
    service.generate_behaviour = endless_generation

    async for event in client.generate("a lighthouse"):
        assert isinstance(event, Progress)
        break

    await asyncio.wait_for(service.generate_cancelled.wait(), EVENT_WAIT_S)


async def test_closing_the_stream_cancels_the_rpc_at_once(
    client: AsyncLoraswapClient, service: FakeDiffusionService
) -> None:
    service.generate_behaviour = endless_generation
    events = client.generate("a lighthouse")

    async with contextlib.aclosing(events):
        assert isinstance(await anext(events), Progress)

    # `events` is still referenced (it is read below), so only aclose() can have cancelled the call.
    await asyncio.wait_for(service.generate_cancelled.wait(), EVENT_WAIT_S)
    with pytest.raises(StopAsyncIteration):  # and the closed stream gives nothing more
        await anext(events)
    assert len(service.generate_requests) == 1


async def test_cancelling_the_consuming_task_cancels_the_rpc(
    client: AsyncLoraswapClient, service: FakeDiffusionService
) -> None:
    service.generate_behaviour = endless_generation
    first_event_seen = asyncio.Event()

    async def consume() -> None:
        async for _ in client.generate("a lighthouse"):
            first_event_seen.set()

    consumer = asyncio.create_task(consume())
    await asyncio.wait_for(first_event_seen.wait(), EVENT_WAIT_S)
    consumer.cancel()

    with pytest.raises(asyncio.CancelledError):
        await consumer
    await asyncio.wait_for(service.generate_cancelled.wait(), EVENT_WAIT_S)


async def test_unary_calls_return_typed_results(client: AsyncLoraswapClient) -> None:
    preload = await client.preload_adapter(CACHED_ADAPTER.id)
    adapters = await client.list_adapters()
    freed_bytes = await client.evict(CACHED_ADAPTER.id)
    info = await client.server_info()

    assert preload == PreloadResult(adapter=CACHED_ADAPTER, already_cached=True)
    assert adapters == AdapterList(adapters=(CACHED_ADAPTER,), cache_bytes=4096, cache_budget_bytes=1 << 30)
    assert freed_bytes == CACHED_ADAPTER.size_bytes
    assert (info.family, info.default_guidance_scale, info.target_layers) == ("sdxl", 7.5, ("down.0.attn1.to_q",))
    assert (info.size_multiple, info.min_size, info.max_size) == (16, 32, 1024)


async def test_server_errors_raise_typed_errors_chained_to_the_rpc_error(client: AsyncLoraswapClient) -> None:
    with pytest.raises(NotFound) as raised:
        await client.evict("styles/missing")

    assert raised.value.reason == "ADAPTER_NOT_FOUND"
    assert raised.value.metadata == {"adapter": "styles/missing"}
    assert isinstance(raised.value.__cause__, grpc.aio.AioRpcError)


async def test_generate_image_reports_progress(client: AsyncLoraswapClient) -> None:
    steps: list[int] = []

    image = await client.generate_image("a lighthouse", on_progress=lambda progress: steps.append(progress.step))

    assert steps == [1, 2, 3]
    assert image.data == IMAGE_BYTES


async def test_sync_client_streams_events_as_they_arrive(target: str, service: FakeDiffusionService) -> None:
    test_loop = asyncio.get_running_loop()
    release_image = asyncio.Event()

    async def image_after_release(request, context):
        yield pb.GenerateResponse(progress=pb.Progress(step=1, total_steps=1, elapsed_ms=1.0))
        # The image is held back until the client has seen the step; a
        # wrapper that buffered the stream would never see it and time out.
        await asyncio.wait_for(release_image.wait(), EVENT_WAIT_S)
        yield pb.GenerateResponse(image=image_for(request))

    service.generate_behaviour = image_after_release

    def consume() -> list[object]:
        with LoraswapClient(target, default_timeout=30.0) as client:
            events = client.generate("a lighthouse")
            first = next(events)
            test_loop.call_soon_threadsafe(release_image.set)
            return [first, *events]

    events = await asyncio.to_thread(consume)

    assert events[0] == Progress(step=1, total_steps=1, elapsed_ms=1.0)
    assert isinstance(events[1], GeneratedImage) and len(events) == 2


async def test_sync_client_break_cancels_the_rpc(target: str, service: FakeDiffusionService) -> None:
    service.generate_behaviour = endless_generation

    def consume_one_event() -> None:
        with LoraswapClient(target, default_timeout=30.0) as client:
            for _ in client.generate("a lighthouse"):
                break
            # The client is still open here, so only the break can have cancelled the RPC.
            if not cancelled_while_open.wait(EVENT_WAIT_S):
                raise AssertionError("the server never saw the RPC cancelled")

    cancelled_while_open = threading.Event()
    waiter = asyncio.create_task(service.generate_cancelled.wait())
    waiter.add_done_callback(lambda _: cancelled_while_open.set())

    await asyncio.to_thread(consume_one_event)


async def test_sync_client_unary_calls_and_errors(target: str) -> None:
    def call_blocking() -> tuple[AdapterList, NotFound]:
        with LoraswapClient(target, default_timeout=30.0) as client:
            adapters = client.list_adapters()
            with pytest.raises(NotFound) as raised:
                client.evict("styles/missing")
            return adapters, raised.value

    adapters, not_found = await asyncio.to_thread(call_blocking)

    assert adapters.adapters == (CACHED_ADAPTER,)
    assert not_found.reason == "ADAPTER_NOT_FOUND"


def parse_cli(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="loraswap")
    client_cli.register(parser.add_subparsers(required=True))
    return parser.parse_args(argv)


async def test_cli_generate_writes_image_and_prints_summary(
    target: str, service: FakeDiffusionService, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output = tmp_path / "out.webp"
    args = parse_cli(
        "generate", "a lighthouse", "--server", target, "--adapter", "styles/ink", "--scale", "0.8",
        "--steps", "3", "--seed", "7", "-o", str(output),
    )  # fmt: skip

    exit_code = await asyncio.to_thread(args.func, args)

    captured = capsys.readouterr()
    assert exit_code == 0
    assert output.read_bytes() == IMAGE_BYTES
    request = service.generate_requests[-1]
    assert (request.num_inference_steps, request.seed) == (3, 7)
    assert request.image_format == pb.IMAGE_FORMAT_WEBP
    assert not request.HasField("width")
    summary = json.loads(captured.out)
    assert captured.out.count("\n") == 1
    assert summary == {
        "output": str(output),
        "seed": 7,
        "adapter": "styles/ink",
        "adapter_scale": 0.8,
        "width": 64,
        "height": 48,
        "mime_type": "image/webp",
        "bytes": len(IMAGE_BYTES),
        "timings": {
            "queue_ms": 1.0,
            "adapter_load_ms": 2.0,
            "adapter_swap_ms": 3.0,
            "denoise_ms": 4.0,
            "decode_ms": 5.0,
            "total_ms": 15.0,
            "encode_prompt_ms": 0.5,
            "encode_image_ms": 1.5,
        },
        "warnings": ["dropped 4 text-encoder layers"],
        "adapters": [{"adapter": "styles/ink", "scale": 0.8}],
        "fused": False,
        "changed_components": [],
    }
    assert captured.err == ""  # stderr is not a terminal here: the progress bar stays quiet


@pytest.mark.parametrize(
    ("argv", "adapter", "adapter_scale", "stack"),
    [
        (("--adapter", "ink"), "ink", None, []),
        (("--adapter", "ink", "--scale", "0.5"), "ink", 0.5, []),
        (("--adapter", "ink:0.5"), "ink", 0.5, []),
        (("--adapter", "hf:owner/repo:style.safetensors"), "hf:owner/repo:style.safetensors", None, []),
        (("--adapter", "ink:0.8", "--adapter", "paper:-0.5"), "", None, [("ink", 0.8), ("paper", -0.5)]),
        (("--adapter", "ink", "--adapter", "hf:o/r@v1:1.5"), "", None, [("ink", None), ("hf:o/r@v1", 1.5)]),
        (("--adapter", "https://h:8443"), "https://h:8443", None, []),
        (("--adapter", "https://h:8443/a.safetensors?sig=x:0.5"), "https://h:8443/a.safetensors?sig=x", 0.5, []),
    ],
    ids=[
        "one",
        "one-with-scale",
        "one-name-colon-scale",
        "hub-reference",
        "stack",
        "stack-default-strength",
        "url-port",
        "url-scale",
    ],
)
async def test_cli_adapter_options_send_one_adapter_or_a_stack(
    target: str, service: FakeDiffusionService, tmp_path: Path, argv, adapter, adapter_scale, stack
) -> None:
    args = parse_cli("generate", "a lighthouse", "--server", target, "-q", "-o", str(tmp_path / "out.png"), *argv)

    assert await asyncio.to_thread(args.func, args) == 0

    request = service.generate_requests[-1]
    assert request.adapter == adapter
    assert (request.adapter_scale if request.HasField("adapter_scale") else None) == adapter_scale
    # Proto floats are float32: compare what was sent rounded back to what was written.
    sent = [(entry.adapter, round(entry.scale, 6) if entry.HasField("scale") else None) for entry in request.adapters]
    assert sent == stack


@pytest.mark.parametrize(("argv", "sent"), [((), pb.FUSE_CHOICE_UNSPECIFIED), (("--fuse", "fused"), pb.FUSE_CHOICE_FUSED),
                                           (("--fuse", "unfused"), pb.FUSE_CHOICE_UNFUSED)])  # fmt: skip
async def test_cli_fuse_pins_the_path(target: str, service: FakeDiffusionService, tmp_path: Path, argv, sent) -> None:
    args = parse_cli("generate", "a lighthouse", "--server", target, "-q", "-o", str(tmp_path / "out.png"),
                     "--adapter", "ink", *argv)  # fmt: skip

    assert await asyncio.to_thread(args.func, args) == 0

    assert service.generate_requests[-1].fuse == sent


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--adapter", "ink:0.8", "--scale", "0.5"), "--adapter ink:0.8 and --scale both give a strength"),
        (("--adapter", "ink", "--adapter", "paper", "--scale", "0.5"), "--scale applies to a single --adapter"),
    ],
)
async def test_cli_refuses_ambiguous_strengths(
    target: str, service: FakeDiffusionService, capsys: pytest.CaptureFixture[str], argv, message
) -> None:
    args = parse_cli("generate", "a lighthouse", "--server", target, *argv)

    assert await asyncio.to_thread(args.func, args) == 1

    assert message in capsys.readouterr().err
    assert service.generate_requests == []


@pytest.mark.parametrize(
    ("argv", "expected_output"),
    [
        (("info",), {"family": "sdxl", "model": "tiny-sdxl", "max_rank": 64}),
        (("adapters",), {"cache_bytes": 4096, "cache_budget_bytes": 1 << 30}),
        (("preload", "styles/ink"), {"already_cached": True}),
        (("evict", "styles/ink"), {"adapter": "styles/ink", "freed_bytes": 4096}),
    ],
    ids=lambda value: value[0] if isinstance(value, tuple) else None,
)
async def test_cli_commands_print_json(
    target: str, capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], expected_output: dict[str, object]
) -> None:
    args = parse_cli(*argv, "--server", target)

    exit_code = await asyncio.to_thread(args.func, args)

    output = json.loads(capsys.readouterr().out)
    assert exit_code == 0
    assert output.items() >= expected_output.items()


async def test_cli_reports_server_error_on_stderr(target: str, capsys: pytest.CaptureFixture[str]) -> None:
    args = parse_cli("evict", "styles/missing", "--server", target)

    exit_code = await asyncio.to_thread(args.func, args)

    captured = capsys.readouterr()
    assert exit_code == 1
    assert captured.out == ""
    assert captured.err == (
        "error: NOT_FOUND ADAPTER_NOT_FOUND: adapter 'styles/missing' is not cached; see `loraswap adapters`\n"
    )
