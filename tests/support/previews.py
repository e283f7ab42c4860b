"""Reading step previews of the `shapes` model: do they show the final image's colours?"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image
from training.shapes_classifier import PALETTE

_PALETTE_NAMES = tuple(PALETTE)
_PALETTE_RGB = np.array([PALETTE[name] for name in _PALETTE_NAMES], dtype=float)


def palette_histogram(pixels: np.ndarray) -> np.ndarray:
    """The share of pixels nearest each palette colour."""
    flat = pixels.reshape(-1, 3).astype(float)
    nearest = ((flat[:, None, :] - _PALETTE_RGB[None]) ** 2).sum(-1).argmin(1)
    return np.bincount(nearest, minlength=len(_PALETTE_NAMES)) / len(nearest)


def dominant_colours_agree(preview: bytes, image: bytes) -> tuple[bool, str]:
    """Whether the preview's two commonest palette colours (background, shape) are the image's, shares close.

    The final image is first averaged down to the preview's size. Tolerances: measured on the
    shipped factors, the histograms differ by at most 0.19 (L1); shuffled factors give 0.8 to 2.
    """
    small = Image.open(io.BytesIO(preview)).convert("RGB")
    final = Image.open(io.BytesIO(image)).convert("RGB").resize(small.size, Image.BOX)
    ours, theirs = palette_histogram(np.asarray(small)), palette_histogram(np.asarray(final))
    top = [tuple(_PALETTE_NAMES[i] for i in np.argsort(-h)[:2]) for h in (ours, theirs)]
    distance = float(np.abs(ours - theirs).sum())
    return top[0] == top[1] and distance < 0.5, f"preview {top[0]} vs image {top[1]}, histogram L1 {distance:.2f}"
