"""A pixel classifier for the `shapes` model's pictures: which shape, in which color, on which background.

It needs no model: every pixel takes the nearest palette color, the background is
the majority color of the border, the shape color is the majority of the rest, and
the shape comes from the rows the shape spans (how the row widths grow from top
to bottom, and how much of the bounding box's corners they fill).  The same palette draws the training
images, so the classifier and the data generator can never disagree on a color.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["BASE_COLORS", "PALETTE", "SHAPES", "ShapeReading", "classify_image"]

# RGB of every color the data generator draws.  The base model draws BASE_COLORS;
# the others only appear through adapters (the VAE still learns them all).
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 160, 50),
    "blue": (30, 70, 220),
    "yellow": (245, 210, 30),
    "white": (245, 245, 245),
    "black": (15, 15, 15),
    "purple": (140, 40, 200),
}
BASE_COLORS: tuple[str, ...] = ("red", "green", "blue", "yellow", "white", "black")
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")

_NAMES = tuple(PALETTE)
_RGB = np.array([PALETTE[name] for name in _NAMES], dtype=np.float32)
# A shape whose own color covers less than this share of the rows it spans is drawn hollow.
_HOLLOW_BELOW = 0.75


@dataclass(frozen=True)
class ShapeReading:
    """What the classifier sees in one picture; fields are None when nothing shape-like is there."""

    shape: str | None
    color: str | None
    background: str
    hollow: bool
    fill: float  # share of the shape's bounding box inside its row spans

    def matches(self, shape: str, color: str, background: str | None = None, *, hollow: bool = False) -> bool:
        """True when shape, color, background (if given) and hollowness are all as expected."""
        return (
            self.shape == shape
            and self.color == color
            and (background is None or self.background == background)
            and self.hollow == hollow
        )


def _labels(image: np.ndarray) -> np.ndarray:
    pixels = image[..., :3].astype(np.float32)
    distances = ((pixels[..., None, :] - _RGB) ** 2).sum(-1)
    return distances.argmin(-1)


def _majority(labels: np.ndarray) -> int:
    return int(np.bincount(labels.ravel(), minlength=len(_NAMES)).argmax())


def classify_image(image: np.ndarray) -> ShapeReading:
    """Read shape, color, background and hollowness from an HxWx3 uint8 RGB image."""
    labels = _labels(image)
    border = np.concatenate([labels[:2].ravel(), labels[-2:].ravel(), labels[:, :2].ravel(), labels[:, -2:].ravel()])
    background = _majority(border)
    inner = labels[labels != background]
    if inner.size < 8:
        return ShapeReading(None, None, _NAMES[background], False, 0.0)
    color = _majority(inner)
    mask = labels == color
    # Rows and columns with at least two shape pixels bound the shape; lone specks do not.
    rows = np.flatnonzero(mask.sum(1) >= 2)
    cols = np.flatnonzero(mask.sum(0) >= 2)
    if rows.size < 3 or cols.size < 3:
        return ShapeReading(None, _NAMES[color], _NAMES[background], False, 0.0)
    top, bottom, left, right = rows[0], rows[-1], cols[0], cols[-1]
    box = mask[top : bottom + 1, left : right + 1]
    height, width = box.shape
    spans = np.zeros_like(box)
    widths = np.zeros(height)
    for r in range(height):
        hits = np.flatnonzero(box[r])
        if hits.size:
            spans[r, hits[0] : hits[-1] + 1] = True
            widths[r] = hits[-1] - hits[0] + 1
    fill = float(spans.sum() / (height * width))
    hollow = bool(box[spans].mean() < _HOLLOW_BELOW)
    upper = widths[int(height * 0.2) : int(height * 0.35) + 1].mean()
    lower = widths[int(height * 0.65) : int(height * 0.8) + 1].mean()
    # A square fills the corners of its bounding box, a circle leaves them (all but ~15%) empty.
    k, j = max(1, round(0.2 * height)), max(1, round(0.2 * width))
    corners = np.mean([spans[:k, :j].mean(), spans[:k, -j:].mean(), spans[-k:, :j].mean(), spans[-k:, -j:].mean()])
    if upper < 0.6 * lower:
        shape = "triangle"
    elif corners > 0.6:
        shape = "square"
    else:
        shape = "circle"
    return ShapeReading(shape, _NAMES[color], _NAMES[background], hollow, fill)
