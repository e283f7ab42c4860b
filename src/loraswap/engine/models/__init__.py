"""Model construction for the engine: the built-in models, by name.

``shapes`` (the default) is a tiny trained FLUX pipeline that draws simple
shapes from text, shipped with demo adapters; ``tiny-flux`` and ``tiny-sdxl``
are random-weight pipelines with the real architectures, for tests.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from diffusers import DiffusionPipeline

from loraswap.engine.models import shapes, tiny
from loraswap.engine.models.shapes import shapes_adapter_dir
from loraswap.engine.models.tiny import GENERATION_DEFAULTS_FILE, TINY_FLUX_MAX_SEQUENCE_LENGTH

__all__ = [
    "BUILTIN_MODELS",
    "GENERATION_DEFAULTS_FILE",
    "TINY_FLUX_MAX_SEQUENCE_LENGTH",
    "TINY_MODELS",
    "TINY_SIZE_MULTIPLE",
    "build_builtin_pipeline",
    "builtin_defaults",
    "export_builtin_model",
    "shapes_adapter_dir",
]

# Random-weight models (tiny.py), each rebuilt bit-identically from seeds.
TINY_MODELS: tuple[str, ...] = tiny.BUILTIN_MODELS
BUILTIN_MODELS: tuple[str, ...] = ("shapes", *TINY_MODELS)
# Height/width must be multiples of these (shapes: 4x VAE downsampling times FLUX's 2x2 packing).
TINY_SIZE_MULTIPLE: dict[str, int] = {"shapes": 8, **tiny.TINY_SIZE_MULTIPLE}


def _check_name(name: str) -> None:
    if name not in BUILTIN_MODELS:
        raise ValueError(f"unknown builtin model {name!r}; valid choices: {', '.join(BUILTIN_MODELS)}")


def build_builtin_pipeline(name: str, torch_dtype: torch.dtype = torch.float32) -> DiffusionPipeline:
    """Build a built-in pipeline on CPU in ``torch_dtype``: identical weights on every call.

    Raises:
        ValueError: if ``name`` is not one of :data:`BUILTIN_MODELS`.
    """
    _check_name(name)
    if name == "shapes":
        return shapes.build_shapes_pipeline(torch_dtype)
    return tiny.build_builtin_pipeline(name, torch_dtype)


def export_builtin_model(name: str, directory: str | os.PathLike[str]) -> Path:
    """Write a built-in model to ``directory`` as a regular diffusers folder, with its generation defaults.

    Raises:
        ValueError: if ``name`` is not one of :data:`BUILTIN_MODELS`.
    """
    _check_name(name)
    if name == "shapes":
        return shapes.export_shapes_model(directory, GENERATION_DEFAULTS_FILE)
    return tiny.export_builtin_model(name, directory)


def builtin_defaults(name: str) -> dict[str, Any]:
    """Generation defaults that fit a built-in model (a fresh dict, ready to splat into the pipeline call).

    Raises:
        ValueError: if ``name`` is not one of :data:`BUILTIN_MODELS`.
    """
    _check_name(name)
    if name == "shapes":
        return dict(shapes.SHAPES_DEFAULTS)
    return tiny.builtin_defaults(name)
