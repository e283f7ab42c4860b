"""The `shapes` built-in model: a tiny FLUX pipeline trained to draw one shape on a plain background.

Real diffusers classes throughout (``FluxPipeline``, ``FluxTransformer2DModel``,
``AutoencoderKL``, ``CLIPTextModel``, ``T5EncoderModel``,
``FlowMatchEulerDiscreteScheduler``), trained by the scripts in ``training/``
on synthetic 64x64 pictures captioned "a red circle on a blue background".  The
weights ship in ``shapes_weights/`` as an ordinary diffusers folder, with demo
LoRA adapters (``outline``, ``swap-colors``, ``purple``) in
``shapes_weights/adapters/``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from transformers import CLIPTextModel, T5EncoderModel

from loraswap.engine.models.classifier import PALETTE, SHAPES
from loraswap.engine.models.tiny import clip_text_config, t5_encoder_config
from loraswap.engine.models.tokenizers import build_clip_tokenizer, build_t5_tokenizer

__all__ = [
    "SHAPES_DEFAULTS",
    "SHAPES_MAX_SEQUENCE_LENGTH",
    "build_shapes_pipeline",
    "export_shapes_model",
    "shapes_adapter_dir",
    "shapes_weights_dir",
    "untrained_shapes_components",
]

# Captions are at most 8 words; each caption word is one T5 piece.
SHAPES_MAX_SEQUENCE_LENGTH = 16
CAPTION_WORDS: tuple[str, ...] = (*PALETTE, *SHAPES, "a", "on", "background")

# What a plain Generate with a prompt should use; true CFG against an empty
# negative prompt is what makes colors and backgrounds follow the caption.
SHAPES_DEFAULTS: dict[str, Any] = dict(
    width=64,
    height=64,
    num_inference_steps=20,
    guidance_scale=1.0,  # no guidance embedding: this model uses true CFG instead
    max_sequence_length=SHAPES_MAX_SEQUENCE_LENGTH,
    true_cfg_scale=3.0,
)

_WEIGHTS = Path(__file__).resolve().parent / "shapes_weights"
_ADAPTERS = "adapters"


def shapes_weights_dir() -> Path:
    """The shipped diffusers folder of the `shapes` model."""
    return _WEIGHTS


def shapes_adapter_dir() -> Path:
    """The folder of the shipped demo adapters (one subfolder each: outline, swap-colors, purple)."""
    return _WEIGHTS / _ADAPTERS


def untrained_shapes_components(seed: int = 0) -> dict[str, Any]:
    """Freshly initialised text encoders, tokenizers, transformer and scheduler, as training starts from."""
    tokenizer = build_clip_tokenizer()
    tokenizer_2 = build_t5_tokenizer(CAPTION_WORDS)
    torch.manual_seed(seed)
    text_encoder = CLIPTextModel(
        clip_text_config(tokenizer, hidden_size=64, intermediate_size=128, projection_dim=64, num_hidden_layers=1)
    )
    torch.manual_seed(seed + 1)
    text_encoder_2 = T5EncoderModel(
        t5_encoder_config(tokenizer_2, d_model=64, d_kv=16, d_ff=128, num_layers=1, relative_attention_max_distance=16)
    )
    torch.manual_seed(seed + 2)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,  # 4 latent channels in 2x2 packed patches
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=32,
        num_attention_heads=4,
        joint_attention_dim=64,
        pooled_projection_dim=64,
        guidance_embeds=False,
        axes_dims_rope=(8, 12, 12),
    )
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False)
    return dict(
        scheduler=scheduler,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )


def build_shapes_pipeline(torch_dtype: torch.dtype = torch.float32) -> FluxPipeline:
    """Load the shipped `shapes` pipeline on CPU in ``torch_dtype``; identical weights on every call."""
    pipe = FluxPipeline.from_pretrained(_WEIGHTS, dtype=torch_dtype, local_files_only=True)
    pipe.register_to_config(_name_or_path="shapes")
    return pipe


def export_shapes_model(directory: str | os.PathLike[str], defaults_file: str) -> Path:
    """Write the `shapes` model to ``directory`` as a float32 diffusers folder, with its generation defaults.

    Float32, not the shipped bfloat16, so that any loader (with or without a
    ``torch_dtype``) gets the weights the engine runs.  The adapters stay out;
    :func:`shapes_adapter_dir` has them.
    """
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    build_shapes_pipeline(torch.float32).save_pretrained(path, safe_serialization=True)
    (path / defaults_file).write_text(json.dumps(SHAPES_DEFAULTS, indent=2) + "\n")
    return path
