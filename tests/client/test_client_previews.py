"""The client's side of step previews: preview_every is sent, Progress exposes the preview, the CLI writes them.

Against the test double of DiffusionService (tests/client/test_client_fake_server.py), which here
answers preview_every the way the contract says: a preview every N steps and at the last.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from loraswap.client import AsyncLoraswapClient, InvalidRequest, LoraswapClient, Progress
from loraswap.client.aio import build_generate_request
from loraswap.v1 import diffusion_service_pb2 as pb
from tests.client.test_client_fake_server import FakeDiffusionService, image_for, parse_cli

STEPS = 5


def preview_bytes(step: int) -> bytes:
    # The client passes previews through without decoding them (and tests/client run without Pillow): distinct
    # bytes per step, starting like a JPEG, are all it needs.
    return b"\xff\xd8\xff\xe0" + f"preview of step {step}".encode() + b"\xff\xd9"


async def previewing_generation(
    request: pb.GenerateRequest, context: grpc.aio.ServicerContext
) -> AsyncIterator[pb.GenerateResponse]:
    every = request.preview_every
    for step in range(1, STEPS + 1):
        progress = pb.Progress(step=step, total_steps=STEPS, elapsed_ms=float(step))
        if every and (step % every == 0 or step == STEPS):
            progress.preview, progress.preview_mime_type = preview_bytes(step), "image/jpeg"
        yield pb.GenerateResponse(progress=progress)
    yield pb.GenerateResponse(image=image_for(request))


@pytest.fixture
async def service() -> FakeDiffusionService:
    service = FakeDiffusionService()
    service.generate_behaviour = previewing_generation
    return service


async def test_progress_exposes_the_preview_and_its_type(target: str, service: FakeDiffusionService) -> None:
    async with AsyncLoraswapClient(target, default_timeout=30.0) as client:
        steps = [
            event async for event in client.generate("a lighthouse", preview_every=2) if isinstance(event, Progress)
        ]

    assert service.generate_requests[-1].preview_every == 2
    assert [(event.step, event.preview_mime_type, event.preview_extension) for event in steps if event.preview] == [
        (2, "image/jpeg", "jpg"),
        (4, "image/jpeg", "jpg"),
        (5, "image/jpeg", "jpg"),
    ]
    assert steps[1].preview == preview_bytes(2)
    assert (steps[0].preview, steps[0].preview_mime_type, steps[0].preview_extension) == (b"", "", "")
    assert "preview=" not in repr(steps[1])  # the bytes stay out of printed events


async def test_no_preview_is_asked_for_by_default(target: str, service: FakeDiffusionService) -> None:
    steps = []

    def run() -> None:  # the blocking client, off this loop (which serves the double)
        with LoraswapClient(target, default_timeout=30.0) as client:
            client.generate_image("a lighthouse", on_progress=steps.append)

    await asyncio.to_thread(run)

    assert service.generate_requests[-1].preview_every == 0
    assert len(steps) == STEPS and not any(event.preview for event in steps)


def test_a_negative_preview_every_cannot_be_encoded() -> None:
    with pytest.raises(InvalidRequest, match="cannot encode"):
        build_generate_request("a lighthouse", preview_every=-1)


async def test_cli_preview_writes_every_steps_preview(
    target: str, service: FakeDiffusionService, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "previews" / "run-1"
    args = parse_cli(
        "generate", "a lighthouse", "--server", target, "-q", "-o", str(tmp_path / "out.png"), "--preview", str(folder)
    )

    assert await asyncio.to_thread(args.func, args) == 0

    assert service.generate_requests[-1].preview_every == 1
    written = sorted(folder.iterdir())
    assert [path.name for path in written] == [f"step-{step:04d}.jpg" for step in range(1, STEPS + 1)]
    assert all(path.read_bytes() == preview_bytes(step) for step, path in enumerate(written, start=1))
    assert json.loads(capsys.readouterr().out)["previews"] == [str(path) for path in written]
