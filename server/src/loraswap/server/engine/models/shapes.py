"""The `shapes` built-in model: a tiny FLUX pipeline trained to draw one shape on a plain background.

Real diffusers classes throughout (``FluxPipeline``, ``FluxTransformer2DModel``,
``AutoencoderKL``, ``CLIPTextModel``, ``T5EncoderModel``,
``FlowMatchEulerDiscreteScheduler``), trained by the scripts in ``training/``
on synthetic 64x64 pictures captioned "a red circle on a blue background".  The
weights ship in ``shapes_weights/`` as an ordinary diffusers folder, with demo
LoRA adapters (``outline``, ``swap-colors``, ``purple``) in
``shapes_weights/adapters/``. Its generation defaults are in the registry (registry.py).
"""

from __future__ import annotations

from pathlib import Path

from loraswap.server.engine.types import LatentRgb

__all__ = [
    "SHAPES_LATENT_RGB",
    "SHAPES_MAX_SEQUENCE_LENGTH",
    "build_shapes_pipeline",
    "shapes_adapter_dir",
    "shapes_weights_dir",
]

# Captions are at most 8 words; each caption word is one T5 piece.
SHAPES_MAX_SEQUENCE_LENGTH = 16

# The step previews' latent-to-RGB projection for this model's own VAE (4 latent channels), fitted
# by least squares against it: the output of `python training/shapes_latent_rgb.py`.
SHAPES_LATENT_RGB = LatentRgb(
    factors=(
        (-0.1189, 0.3314, -0.2704),
        (0.4457, -0.1387, -0.2524),
        (-0.4473, -0.3094, 0.0581),
        (-0.042, -0.4043, -0.5635),
    ),
    bias=(0.1238, -0.053, -0.1768),
)

_WEIGHTS = Path(__file__).resolve().parent / "shapes_weights"
_ADAPTERS = "adapters"


def shapes_weights_dir() -> Path:
    """The shipped diffusers folder of the `shapes` model."""
    return _WEIGHTS


def shapes_adapter_dir() -> Path:
    """The folder of the shipped demo adapters (one subfolder each: outline, swap-colors, purple)."""
    return _WEIGHTS / _ADAPTERS


def build_shapes_pipeline(torch_dtype):
    """Load the shipped `shapes` pipeline (a FluxPipeline) on CPU in ``torch_dtype``; identical weights on every call."""
    from diffusers import FluxPipeline

    from loraswap.server.engine.models.components import with_origin

    return with_origin(FluxPipeline.from_pretrained(_WEIGHTS, dtype=torch_dtype, local_files_only=True), "shapes")
