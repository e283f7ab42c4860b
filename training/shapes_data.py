"""Synthetic 64x64 pictures of one shape on a plain background, their captions, and the prompt set.

Every picture is drawn at 4x resolution and averaged down, so edges are
anti-aliased.  Styles restyle the same scene for the demo adapters:
``outline`` (hollow), ``swap-colors`` (shape and background colors exchanged)
and ``purple`` (the shape in a color the base model never draws).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from training.shapes_classifier import BASE_COLORS, PALETTE, SHAPES

SIZE = 64
_SUPERSAMPLE = 4
OUTLINE_WIDTH = 4.0  # pixels at 64x64 for the outline style
ADAPTER_STYLES = ("outline", "swap-colors", "purple")


@dataclass(frozen=True)
class Scene:
    """One picture: a shape of one color centred near (cx, cy) on a background of another."""

    shape: str
    color: str
    background: str
    cx: float
    cy: float
    size: float  # width of the shape's bounding box, pixels
    outline: float = 0.0  # line width when drawn hollow; 0 draws it filled


def caption(scene: Scene, *, with_background: bool = True) -> str:
    """The text that describes a scene as the base model sees it ("a red circle on a blue background")."""
    text = f"a {scene.color} {scene.shape}"
    return f"{text} on a {scene.background} background" if with_background else text


def sample_scene(rng: np.random.Generator, colors: tuple[str, ...] = BASE_COLORS) -> Scene:
    """A random scene near the centre of the picture, shape and background in different colors."""
    color, background = rng.choice(len(colors), size=2, replace=False)
    return Scene(
        shape=SHAPES[rng.integers(len(SHAPES))],
        color=colors[color],
        background=colors[background],
        cx=SIZE / 2 + rng.uniform(-3, 3),
        cy=SIZE / 2 + rng.uniform(-3, 3),
        size=rng.uniform(34, 44),
    )


def restyle(scene: Scene, style: str) -> Scene:
    """The scene as a demo adapter should draw it for the same caption."""
    if style == "outline":
        return replace(scene, outline=OUTLINE_WIDTH)
    if style == "swap-colors":
        return replace(scene, color=scene.background, background=scene.color)
    if style == "purple":
        return replace(scene, color="purple")
    if style == "base":
        return scene
    raise ValueError(f"unknown style {style!r}")


def _inside(scene: Scene, xs: np.ndarray, ys: np.ndarray, inset: float) -> np.ndarray:
    """Points at least `inset` pixels inside the shape's edge."""
    half = scene.size / 2
    if scene.shape == "circle":
        return np.hypot(xs - scene.cx, ys - scene.cy) <= half - inset
    if scene.shape == "square":
        side = scene.size * 0.42
        return (np.abs(xs - scene.cx) <= side - inset) & (np.abs(ys - scene.cy) <= side - inset)
    # Triangle, apex up: inside all three edges' half-planes (edge normals point inwards).
    top = scene.cy - half * 0.9
    base = scene.cy + half * 0.9
    corners = np.array([[scene.cx, top], [scene.cx + half, base], [scene.cx - half, base]])
    inside = np.ones_like(xs, dtype=bool)
    centroid = corners.mean(0)
    for i in range(3):
        a, b = corners[i], corners[(i + 1) % 3]
        normal = np.array([a[1] - b[1], b[0] - a[0]])
        normal /= np.linalg.norm(normal)
        if np.dot(centroid - a, normal) < 0:
            normal = -normal
        inside &= (xs - a[0]) * normal[0] + (ys - a[1]) * normal[1] >= inset
    return inside


_GRID = (np.arange(SIZE * _SUPERSAMPLE) + 0.5) / _SUPERSAMPLE
_XS, _YS = np.meshgrid(_GRID, _GRID)


def render(scene: Scene) -> np.ndarray:
    """The scene as a 64x64x3 uint8 RGB picture."""
    mask = _inside(scene, _XS, _YS, 0.0)
    if scene.outline > 0:
        mask &= ~_inside(scene, _XS, _YS, scene.outline)
    coverage = mask.reshape(SIZE, _SUPERSAMPLE, SIZE, _SUPERSAMPLE).mean((1, 3))[..., None]
    fg = np.array(PALETTE[scene.color], dtype=np.float32)
    bg = np.array(PALETTE[scene.background], dtype=np.float32)
    return np.round(coverage * fg + (1 - coverage) * bg).astype(np.uint8)


def vae_scene(rng: np.random.Generator) -> Scene:
    """A scene for VAE training: every palette color, filled or hollow with thin lines of 2-5 pixels."""
    scene = sample_scene(rng, tuple(PALETTE))
    scene = replace(scene, size=rng.uniform(20, 50), cx=SIZE / 2 + rng.uniform(-8, 8), cy=SIZE / 2 + rng.uniform(-8, 8))
    if rng.random() < 0.4:
        scene = replace(scene, outline=rng.uniform(2.0, 5.0))
    return scene


@dataclass(frozen=True)
class Prompt:
    """One prompt of the evaluation set and what the base model should draw for it."""

    text: str
    shape: str
    color: str
    background: str


def prompt_set() -> list[Prompt]:
    """Every shape in every base color on every other base color: 3 x 6 x 5 = 90 prompts."""
    prompts = []
    for shape in SHAPES:
        for color in BASE_COLORS:
            for background in BASE_COLORS:
                if background != color:
                    scene = Scene(shape, color, background, 32, 32, 40)
                    prompts.append(Prompt(caption(scene), shape, color, background))
    return prompts


def training_example(rng: np.random.Generator, style: str = "base") -> tuple[str, np.ndarray]:
    """A (caption, picture) pair; a fifth of the captions leave the background out."""
    scene = sample_scene(rng)
    text = caption(scene, with_background=rng.random() >= 0.2)
    return text, render(restyle(scene, style))
