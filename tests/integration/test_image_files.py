"""Image files over gRPC, now written on the encoder's thread: the same bytes, events in order, the phases timed.

A real tiny-flux server on port 0 (eager, so that its bytes can be compared with an eager run in this process)
answers one request per format; the file must be byte for byte the one the same runtime writes in place
(DiffusionRuntime.generate, on the calling thread). Every progress event comes before the image, and the timings
carry the prompt's and the file's parts. A lossless WebP too large to write quickly is refused by name.
"""

from __future__ import annotations

import pytest
import pytest_asyncio

from loraswap.client import GeneratedImage, InvalidRequest, Progress
from loraswap.server.engine.config import EngineConfig
from loraswap.server.engine.pipeline.startup import start_runtime
from loraswap.server.engine.types import GenerationRequest, ImageFormat
from tests.support.servers import TEST_TORCH_THREADS, client_of, serving

pytestmark = pytest.mark.asyncio(loop_scope="session")

REQUEST = dict(prompt="a red circle on a blue background", seed=11, num_inference_steps=3, width=64, height=48)
MAX_SIZE = 4096


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def client():
    async with serving("tiny-flux", None, compile=False, max_size=MAX_SIZE) as running, client_of(running) as client:
        yield client


@pytest.fixture(scope="module")
def in_place():
    """The same model in this process: its files written in place, on the calling thread."""
    runtime = start_runtime(
        EngineConfig(model="tiny-flux", device="cpu", compile=False, warmup=False, max_size=MAX_SIZE,
                     torch_threads=TEST_TORCH_THREADS)
    )  # fmt: skip

    def generate(image_format: ImageFormat) -> bytes:
        params = runtime.request_rules.resolve(GenerationRequest(**REQUEST, image_format=image_format))
        return runtime.generate(params, (), on_step=lambda progress: None, is_cancelled=bool).data

    return generate


@pytest.mark.parametrize("image_format", list(ImageFormat), ids=lambda image_format: image_format.value)
async def test_the_file_is_the_one_written_in_place_after_every_step(client, in_place, image_format) -> None:
    events = [event async for event in client.generate(**REQUEST, image_format=image_format.value)]
    steps = [event.step for event in events if isinstance(event, Progress)]
    image = events[-1]

    assert isinstance(image, GeneratedImage) and steps == [1, 2, 3]
    assert not any(isinstance(event, GeneratedImage) for event in events[:-1])
    assert image.mime_type == image_format.mime_type
    assert image.data == in_place(image_format)
    timings = image.timings
    assert 0 < timings.encode_prompt_ms < timings.denoise_ms
    assert 0 < timings.encode_image_ms < timings.decode_ms


async def test_a_lossless_webp_too_large_to_write_quickly_is_refused_naming_the_field(client) -> None:
    with pytest.raises(InvalidRequest) as refused:
        await client.generate_image(
            "a red circle", width=MAX_SIZE, height=2064, num_inference_steps=1, image_format="webp"
        )
    assert refused.value.reason == "INVALID_REQUEST"
    assert "ask for PNG or JPEG" in str(refused.value)
    assert [violation.field for violation in refused.value.field_violations] == ["image_format"]
