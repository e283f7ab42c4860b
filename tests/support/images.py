"""Decoding served images and comparing them with a stated tolerance."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

# Image comparisons: decoded 8-bit RGB; the server's image and the fresh-diffusers
# reference may differ by float rounding (compiled graphs, padded rank), never by more.
MAX_PIXEL_DIFF = 3
MEAN_PIXEL_DIFF = 0.5
# Every adapter used in the swap tests changes the image by far more than that.
MIN_ADAPTER_EFFECT = 8


def decode(data: bytes) -> np.ndarray:
    """Image file bytes -> HxWx3 int array."""
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).astype(np.int32)


def assert_images_close(actual: np.ndarray, expected: np.ndarray, what: str = "") -> None:
    """Fail unless the two decoded images agree within MAX_PIXEL_DIFF / MEAN_PIXEL_DIFF (`what`: named on failure)."""
    diff = np.abs(actual - expected)
    assert actual.shape == expected.shape, what
    assert diff.max() <= MAX_PIXEL_DIFF and diff.mean() <= MEAN_PIXEL_DIFF, (
        f"{what + ': ' if what else ''}images differ: max {diff.max()}, mean {diff.mean():.3f}"
    )
