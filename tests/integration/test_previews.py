"""Step previews over gRPC: Progress.preview on the right steps, decodable, with the image's aspect ratio.

A real `shapes` server (a Flux pipeline: packed latents, its own fitted factors) and a tiny-sdxl
server (the SDXL family's published factors) on port 0; the client reads Progress.preview.
Both run eager: previews are computed outside the compiled denoiser, and compiling would cost
this module minutes on two cores.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from PIL import Image

from loraswap.client import AsyncLoraswapClient, GeneratedImage, Progress
from loraswap.server.engine.models.shapes import shapes_adapter_dir
from loraswap.server.engine.pipeline.previews import MAX_PREVIEW_SIDE
from tests.support.previews import dominant_colours_agree
from tests.support.servers import client_of, serving

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROMPT = "a red circle on a blue background"


@contextlib.asynccontextmanager
async def eager_client(model: str, adapter_dir) -> AsyncIterator[AsyncLoraswapClient]:
    async with serving(model, adapter_dir, compile=False) as running, client_of(running) as client:
        yield client


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def shapes_client():
    async with eager_client("shapes", shapes_adapter_dir()) as client:
        yield client


async def generate(client: AsyncLoraswapClient, **fields) -> tuple[list[Progress], GeneratedImage]:
    steps, image = [], None
    async for event in client.generate(PROMPT, seed=5, **fields):
        if isinstance(event, Progress):
            steps.append(event)
        elif isinstance(event, GeneratedImage):
            image = event
    assert image is not None
    return steps, image


def preview_of(event: Progress) -> Image.Image:
    assert event.preview_mime_type == "image/jpeg"
    picture = Image.open(io.BytesIO(event.preview))
    assert picture.format == "JPEG"
    picture.load()
    return picture


def assert_aspect_ratio(picture: Image.Image, width: int, height: int) -> None:
    """The preview's sides are the image's scaled by one factor, to within a pixel's rounding."""
    assert max(picture.size) <= MAX_PREVIEW_SIDE
    assert abs(picture.width * height - picture.height * width) <= max(width, height), (picture.size, width, height)


@pytest.mark.parametrize(
    ("every", "expected"), [(3, [3, 6, 9, 10]), (4, [4, 8, 10]), (1, list(range(1, 11))), (50, [10])]
)
async def test_previews_come_every_n_steps_and_at_the_last(shapes_client, every: int, expected: list[int]) -> None:
    steps, _ = await generate(shapes_client, num_inference_steps=10, preview_every=every)

    assert [event.step for event in steps] == list(range(1, 11))
    assert [event.step for event in steps if event.preview] == expected
    for event in steps:
        if event.preview:
            preview_of(event)
        else:
            assert event.preview_mime_type == ""


async def test_no_previews_when_preview_every_is_0(shapes_client) -> None:
    steps, _ = await generate(shapes_client, num_inference_steps=4)
    assert len(steps) == 4 and not any(event.preview or event.preview_mime_type for event in steps)


@pytest.mark.parametrize(("width", "height"), [(128, 64), (48, 96), (1536, 96)])
async def test_previews_have_the_images_aspect_ratio(shapes_client, width: int, height: int) -> None:
    steps, image = await generate(shapes_client, num_inference_steps=2, width=width, height=height, preview_every=1)

    assert (image.width, image.height) == (width, height)
    for event in steps:
        assert_aspect_ratio(preview_of(event), width, height)
    # 1536 px wide is 384 latent pixels: shrunk to the limit.
    if width == 1536:
        assert preview_of(steps[-1]).size == (MAX_PREVIEW_SIDE, 16)


async def test_the_last_preview_has_the_final_images_dominant_colours(shapes_client) -> None:
    steps, image = await generate(shapes_client, preview_every=5)

    agree, detail = dominant_colours_agree(steps[-1].preview, image.data)
    assert agree, detail


async def test_sdxl_previews_come_at_the_right_steps_with_the_images_aspect_ratio(sdxl_adapter_dir) -> None:
    steps = []
    async with eager_client("tiny-sdxl", sdxl_adapter_dir) as client:
        image = await client.generate_image(
            "a lighthouse", width=96, height=64, num_inference_steps=5, seed=1, preview_every=2,
            on_progress=steps.append,
        )  # fmt: skip
    assert [event.step for event in steps if event.preview] == [2, 4, 5]
    for event in steps:
        if event.preview:
            assert_aspect_ratio(preview_of(event), image.width, image.height)
