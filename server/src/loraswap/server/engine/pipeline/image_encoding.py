"""Writing a decoded image as a file (PNG, JPEG, WebP), on a thread of its own.

The worker hands each decoded image to an `ImageEncoder` and starts the next request's steps while it is being
written: a 1024² PNG costs the CPU about 0.1 s, which on a GPU would otherwise leave the device idle between
requests. The settings were chosen by measurement (`python -m benchmarks.image_encoding`; the figures are in the
README's "Image formats", 1024² noise-like and photo-like pictures on one core):

- PNG: compress level 1 with zlib's run-length strategy (Z_RLE). Pillow filters every row whatever the level, so
  its level-6 default spends its time searching for long matches that filtered rows rarely have: run-length
  matches give the same size (1.60 MiB for the photo-like picture) in 93 ms instead of 328 ms; level 1 with
  Pillow's own strategy takes 109 ms for a file 12% larger, and level 0 stores the pixels uncompressed.
- JPEG: quality 95, as the contract says (5-8 ms).
- WebP: lossless at the least effort (method 0, quality 0): 40 ms and 1.48 MiB, smaller than the PNG. Pillow's
  default effort (method 4, quality 80) costs 0.17-0.44 s at 1024² and 1.5-2.8 s at 2048² for files 5-8% smaller.
  Above request_rules.MAX_WEBP_PIXELS even the least effort would approach a second, and such requests are refused
  where they are resolved (`check_encodable`).
"""

from __future__ import annotations

import io
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from loraswap.server.engine.types import GeneratedImage, ImageFormat

if TYPE_CHECKING:
    from PIL.Image import Image

log = logging.getLogger(__name__)

Z_RLE = 3  # zlib's run-length strategy: matches at distance 1 only
# Pillow's save() options for each format, the only place they are spelled.
SAVE_OPTIONS: dict[ImageFormat, dict[str, object]] = {
    ImageFormat.PNG: {"format": "PNG", "compress_level": 1, "compress_type": Z_RLE},
    ImageFormat.JPEG: {"format": "JPEG", "quality": 95},
    ImageFormat.WEBP: {"format": "WEBP", "lossless": True, "method": 0, "quality": 0},
}


def encode_image(image: Image, image_format: ImageFormat) -> bytes:
    """A PIL image as file bytes in `image_format` (JPEG drops any alpha channel)."""
    if image_format is ImageFormat.JPEG:
        image = image.convert("RGB")
    buffer = io.BytesIO()
    image.save(buffer, **SAVE_OPTIONS[image_format])
    return buffer.getvalue()


@dataclass(frozen=True)
class DecodedImage:
    """A generation decoded to pixels whose file is not written yet: what the worker hands the encoder."""

    pixels: Image
    # The reply as it will be sent, but for its file: `data` is empty, and its timings' decode_ms covers the VAE
    # decode only (encoding adds the rest).
    image: GeneratedImage
    decoded_at: float  # time.perf_counter() when the decode ended

    def encoded(self) -> GeneratedImage:
        """The reply with its file: `decode_ms` then runs from the last step to the file written (the wait for the
        encoder included), and `encode_image_ms` is the part spent writing it."""
        started = time.perf_counter()
        data = encode_image(self.pixels, self.image.image_format)
        finished = time.perf_counter()
        timings = replace(
            self.image.timings,
            decode_ms=self.image.timings.decode_ms + (finished - self.decoded_at) * 1000.0,
            encode_image_ms=(finished - started) * 1000.0,
        )
        return replace(self.image, data=data, timings=timings)


# What the encoder calls on its thread when an image's file is written, and when writing it failed.
OnEncoded = Callable[[GeneratedImage], None]
OnFailed = Callable[[Exception], None]


class ImageEncoder:
    """Encodes decoded images on one thread of its own, in the order they come.

    At most `max_waiting` images wait to be encoded (besides the one being encoded): `submit` blocks beyond that,
    so a slow encoder slows the worker down instead of piling decoded images up in memory.
    """

    def __init__(self, max_waiting: int = 1) -> None:
        self._slots = threading.BoundedSemaphore(max_waiting + 1)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loraswap-encoder")
        self._lock = threading.Lock()
        self._pending = 0

    def submit(self, decoded: DecodedImage, on_encoded: OnEncoded, on_failed: OnFailed) -> None:
        """Encode `decoded` after those submitted before it, then call on_encoded (or on_failed) on the encoder's
        thread."""
        self._slots.acquire()
        with self._lock:
            self._pending += 1
        try:
            self._pool.submit(self._encode, decoded, on_encoded, on_failed)
        except BaseException:
            self._release()
            raise

    @property
    def idle(self) -> bool:
        """Nothing is being encoded and nothing waits to be."""
        with self._lock:
            return self._pending == 0

    def close(self) -> None:
        """Encode what was submitted, then end the thread."""
        self._pool.shutdown(wait=True)

    def _encode(self, decoded: DecodedImage, on_encoded: OnEncoded, on_failed: OnFailed) -> None:
        try:
            try:
                image = decoded.encoded()
            except Exception as exc:  # noqa: BLE001 - the request's own failure, reported to it
                on_failed(exc)
            else:
                on_encoded(image)
        except Exception:  # a callback's own failure must not end the encoder
            log.exception("delivering an encoded image failed")
        finally:
            self._release()

    def _release(self) -> None:
        with self._lock:
            self._pending -= 1
        self._slots.release()
