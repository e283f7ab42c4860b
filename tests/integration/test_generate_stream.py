"""A Generate stream: queued, one progress event per step in order, then exactly one image."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from loraswap.client import GeneratedImage, Progress, Queued

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest.mark.parametrize(
    ("image_format", "pil_format", "mime_type"),
    [("png", "PNG", "image/png"), ("jpeg", "JPEG", "image/jpeg"), ("webp", "WEBP", "image/webp")],
)
@pytest.mark.parametrize(("width", "height", "steps"), [(64, 64, 3), (96, 48, 5)])
async def test_stream_has_each_step_then_one_image(
    flux_client, image_format, pil_format, mime_type, width, height, steps
):
    events = [
        event
        async for event in flux_client.generate(
            "a red circle", num_inference_steps=steps, width=width, height=height, seed=3, image_format=image_format
        )
    ]
    progress = [event for event in events if isinstance(event, Progress)]
    images = [event for event in events if isinstance(event, GeneratedImage)]
    assert [p.step for p in progress] == list(range(1, steps + 1))
    assert all(p.total_steps == steps for p in progress)
    assert [p.elapsed_ms for p in progress] == sorted(p.elapsed_ms for p in progress)
    assert len(images) == 1 and events[-1] is images[0]
    assert all(isinstance(event, Queued) for event in events[: events.index(progress[0])])
    image = images[0]
    decoded = Image.open(io.BytesIO(image.data))
    assert decoded.format == pil_format and decoded.size == (width, height)
    assert (image.mime_type, image.width, image.height, image.seed) == (mime_type, width, height, 3)
    assert image.timings.denoise_ms > 0 and image.timings.total_ms >= image.timings.denoise_ms


async def test_progress_arrives_while_the_generation_runs(flux_client):
    """The first step reaches the client long before the image: steps are streamed, not batched."""
    import time

    arrivals = []
    async for event in flux_client.generate("a green square", num_inference_steps=40, seed=1):
        arrivals.append((type(event).__name__, time.perf_counter()))
    first_step = next(t for name, t in arrivals if name == "Progress")
    image_at = arrivals[-1][1]
    last_step = [t for name, t in arrivals if name == "Progress"][-1]
    assert arrivals[-1][0] == "GeneratedImage"
    assert image_at - first_step > 0.5 * (last_step - first_step) > 0


async def test_unset_seed_is_picked_and_returned(flux_client):
    first = await flux_client.generate_image("a blue triangle")
    again = await flux_client.generate_image("a blue triangle", seed=first.seed)
    assert first.data == again.data


async def test_defaults_come_from_the_model(flux_client):
    info = await flux_client.server_info()
    steps = []
    image = await flux_client.generate_image("a cat", on_progress=steps.append)
    assert (image.width, image.height) == (info.default_width, info.default_height)
    assert len(steps) == info.default_num_inference_steps
