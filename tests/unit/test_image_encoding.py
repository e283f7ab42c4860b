"""Writing image files: the settings chosen by measurement, the WebP size rule, and the encoder's thread.

The formats are checked on pictures made by benchmarks/image_encoding.py (the ones its figures are measured on):
PNG and WebP give back every pixel, PNG's setting is as small as Pillow's default (and far from stored), JPEG is a
JPEG at the contract's quality. The ImageEncoder is checked with real PIL images: order, the bound on waiting
images, a failure handed to its caller. The scheduler's use of it (the worker goes on while an image is written)
runs on a real tiny-flux runtime.
"""

from __future__ import annotations

import io
import threading
import time

import numpy as np
import pytest
from benchmarks.image_encoding import noise_picture, photo_picture
from PIL import Image

from loraswap.server.engine.config import EngineConfig
from loraswap.server.engine.errors import InvalidRequestError
from loraswap.server.engine.pipeline.image_encoding import DecodedImage, ImageEncoder, encode_image
from loraswap.server.engine.request_rules import MAX_WEBP_PIXELS, RequestRules, check_encodable
from loraswap.server.engine.scheduler import GenerationJob, GenerationScheduler
from loraswap.server.engine.types import (
    GeneratedImage,
    GenerationRequest,
    ImageFormat,
    ModelDefaults,
    Queued,
    StepProgress,
    Timings,
)
from tests.support.servers import TEST_TORCH_THREADS

SIDE = 256


@pytest.fixture(scope="module")
def photo() -> Image.Image:
    return photo_picture(SIDE)


@pytest.mark.parametrize("image_format", [ImageFormat.PNG, ImageFormat.WEBP])
def test_png_and_webp_keep_every_pixel(photo, image_format: ImageFormat) -> None:
    data = encode_image(photo, image_format)
    decoded = Image.open(io.BytesIO(data))
    assert decoded.format == image_format.name
    assert np.array_equal(np.asarray(decoded.convert("RGB")), np.asarray(photo))


def test_the_png_setting_is_as_small_as_pillows_default_and_far_from_stored(photo) -> None:
    def png(**options) -> int:
        buffer = io.BytesIO()
        photo.save(buffer, format="PNG", **options)
        return buffer.tell()

    served = len(encode_image(photo, ImageFormat.PNG))
    assert served <= png() * 1.01  # Pillow's default: level 6, Z_FILTERED
    assert served < png(compress_level=0) * 0.7


def test_jpeg_is_written_at_quality_95() -> None:
    data = encode_image(noise_picture(64).convert("RGBA"), ImageFormat.JPEG)  # an alpha channel is dropped
    decoded = Image.open(io.BytesIO(data))
    assert decoded.format == "JPEG" and decoded.mode == "RGB"
    buffer = io.BytesIO()
    noise_picture(64).save(buffer, format="JPEG", quality=95)
    assert data == buffer.getvalue()


RULES = RequestRules(ModelDefaults(64, 64, 4, 5.0), size_multiple=16, min_size=16, max_size=8192)


@pytest.mark.parametrize(
    ("image_format", "width", "height", "refused"),
    [(ImageFormat.WEBP, 2048, 2048, False), (ImageFormat.WEBP, 4096, 2048, False),
     (ImageFormat.WEBP, 4096, 2064, True), (ImageFormat.WEBP, 8192, 8192, True),
     (ImageFormat.PNG, 8192, 8192, False), (ImageFormat.JPEG, 8192, 8192, False)],
)  # fmt: skip
def test_lossless_webp_is_refused_above_the_size_where_it_costs_seconds(image_format, width, height, refused) -> None:
    """Refused where a request is resolved, before it queues."""
    request = GenerationRequest(prompt="p", width=width, height=height, image_format=image_format)
    if not refused:
        check_encodable(RULES.resolve(request))
        return
    with pytest.raises(InvalidRequestError, match="ask for PNG or JPEG") as raised:
        RULES.resolve(request)
    assert raised.value.reason == "INVALID_REQUEST"
    assert raised.value.metadata == {"field": "image_format"}
    assert width * height > MAX_WEBP_PIXELS


# -------------------------------------------------------------------------------- the encoder's thread


def decoded(pixels: Image.Image, image_format: ImageFormat = ImageFormat.PNG, seed: int = 0) -> DecodedImage:
    image = GeneratedImage(
        data=b"", image_format=image_format, width=pixels.width, height=pixels.height, seed=seed, adapter="",
        adapter_scale=1.0, timings=Timings(decode_ms=2.0),
    )  # fmt: skip
    return DecodedImage(pixels=pixels, image=image, decoded_at=time.perf_counter())


def test_the_encoder_writes_in_order_off_the_callers_thread_with_the_encoding_inside_decode_ms() -> None:
    encoder = ImageEncoder()
    done: list[tuple[GeneratedImage, str]] = []
    finished = threading.Event()

    def on_encoded(image: GeneratedImage) -> None:
        done.append((image, threading.current_thread().name))
        if len(done) == 3:
            finished.set()

    pictures = [noise_picture(96, seed) for seed in range(3)]
    for seed, picture in enumerate(pictures):
        encoder.submit(decoded(picture, seed=seed), on_encoded, on_failed=pytest.fail)
    assert finished.wait(30)
    encoder.close()

    assert [image.seed for image, _ in done] == [0, 1, 2]
    assert all(name.startswith("loraswap-encoder") for _, name in done)
    for (image, _), picture in zip(done, pictures):
        assert image.data == encode_image(picture, ImageFormat.PNG)
        assert 0 < image.timings.encode_image_ms < image.timings.decode_ms
        assert image.timings.decode_ms > 2.0  # the VAE's part, then the wait and the encoding
    assert encoder.idle


def test_submit_waits_once_an_image_is_being_written_and_another_waits() -> None:
    encoder = ImageEncoder(max_waiting=1)
    release = threading.Event()
    picture = noise_picture(16)

    def on_encoded(image: GeneratedImage) -> None:
        release.wait(30)

    encoder.submit(decoded(picture), on_encoded, pytest.fail)  # being written (its delivery holds the thread)
    encoder.submit(decoded(picture), on_encoded, pytest.fail)  # waiting
    third = threading.Thread(target=encoder.submit, args=(decoded(picture), on_encoded, pytest.fail))
    third.start()
    third.join(0.5)
    assert third.is_alive() and not encoder.idle  # held back: a slow encoder slows the worker instead
    release.set()
    third.join(30)
    encoder.close()
    assert encoder.idle


def test_an_encoding_failure_goes_to_its_caller_and_the_encoder_goes_on() -> None:
    encoder = ImageEncoder()
    failures, images = [], []
    floats = Image.fromarray(np.zeros((8, 8), dtype=np.float32))  # mode F: PNG cannot hold it
    encoder.submit(decoded(floats, ImageFormat.PNG), images.append, failures.append)
    encoder.submit(decoded(noise_picture(8)), images.append, failures.append)
    encoder.close()
    assert len(failures) == 1 and isinstance(failures[0], OSError)
    assert len(images) == 1 and images[0].data.startswith(b"\x89PNG")


# -------------------------------------------------------------------------------- the scheduler's worker and encoder


@pytest.fixture(scope="module")
def tiny_flux():
    from loraswap.server.engine.pipeline.startup import start_runtime

    return start_runtime(
        EngineConfig(model="tiny-flux", device="cpu", compile=False, warmup=False, torch_threads=TEST_TORCH_THREADS)
    )


def test_the_worker_denoises_the_next_request_while_the_last_image_is_delivered(tiny_flux) -> None:
    """The first job's image is held in its delivery (on the encoder's thread) until the second job has made a
    step: with the file written on the worker, the second job could not start, and this would time out."""
    scheduler = GenerationScheduler(lambda stop: tiny_flux, max_queue=4)
    scheduler.start()
    scheduler.ready.result(timeout=120)
    second_stepped = threading.Event()
    overlapped = []  # whether the second job stepped while the first's image was held
    events: dict[int, list] = {1: [], 2: []}
    finished = {1: threading.Event(), 2: threading.Event()}

    def emit_for(job_id: int):
        def emit(event) -> None:
            if isinstance(event, GeneratedImage) and job_id == 1:
                overlapped.append(second_stepped.wait(30))
            events[job_id].append((event, threading.current_thread().name))
            if job_id == 2 and isinstance(event, StepProgress):
                second_stepped.set()
            if not isinstance(event, (StepProgress, Queued)):
                finished[job_id].set()

        return emit

    params = tiny_flux.request_rules.resolve(GenerationRequest(prompt="a red circle", seed=4, num_inference_steps=3))
    for job_id in (1, 2):
        scheduler.submit(GenerationJob(params=params, stack=(), emit=emit_for(job_id)))
    assert finished[1].wait(120) and finished[2].wait(120)
    scheduler.stop()
    reference = tiny_flux.generate(params, (), on_step=lambda progress: None, is_cancelled=bool)

    assert overlapped == [True]
    for job_id in (1, 2):
        kinds = [type(event).__name__ for event, _ in events[job_id] if not isinstance(event, Queued)]
        assert kinds == ["StepProgress"] * 3 + ["GeneratedImage"]  # every step before the image
        image, thread = events[job_id][-1]
        assert thread.startswith("loraswap-encoder")
        assert all(name == "loraswap-worker" for event, name in events[job_id] if isinstance(event, StepProgress))
        assert image.data == reference.data  # the same bytes as a file written in place
    deadline = time.monotonic() + 30
    while scheduler.worker_alive and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not scheduler.worker_alive and scheduler.is_idle()
