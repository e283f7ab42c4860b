"""Tiny random-weight diffusers pipelines with the real FLUX.1 and SDXL architectures.

The builtin models let the server (and its tests) run real ``FluxPipeline`` /
``StableDiffusionXLPipeline`` code paths on any machine: everything is built
locally from configs and seeded initialisation (components.py), so nothing is
downloaded and every build yields bit-identical weights.  The images are noise,
but the pipelines exercise the same modules (attention projections, schedulers,
VAE, both text encoders, tokenizers) that real checkpoints have, which is what
LoRA loading and swapping need.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import (
    FluxPipeline,
    FluxTransformer2DModel,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)

# clip_text_config and t5_encoder_config are re-exported: training/shapes_components.py imports them from here.
from loraswap.server.engine.models.components import (
    clip_text_config,
    flux_components,
    sdxl_components,
    seeded,
    seeded_pipeline,
    t5_encoder_config,
    tiny_vae,
)

__all__ = [
    "build_tiny_flux_pipeline",
    "build_tiny_sdxl_pipeline",
    "clip_text_config",
    "t5_encoder_config",
]

# The width of every text encoder (CLIP's hidden size, T5's d_model): what the denoisers read as
# pooled_projection_dim and joint_attention_dim (Flux) or, both CLIPs concatenated, cross_attention_dim (SDXL).
_TEXT_WIDTH = 32


# --------------------------------------------------------------------------- components


def _tiny_flux_components() -> dict[str, Any]:
    latent_channels = 4
    transformer = seeded(
        lambda: FluxTransformer2DModel(
            patch_size=1,
            in_channels=latent_channels * 4,  # FLUX packs 2x2 latent patches
            num_layers=2,
            num_single_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=_TEXT_WIDTH,  # T5 d_model
            pooled_projection_dim=_TEXT_WIDTH,  # CLIP hidden size
            guidance_embeds=True,  # like FLUX.1-dev
            axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim
        )
    )
    vae = tiny_vae(latent_channels=latent_channels, scaling_factor=1.5035, shift_factor=0.0609)
    return flux_components(transformer, clip_width=_TEXT_WIDTH, t5_width=_TEXT_WIDTH, vae=vae)


def _tiny_sdxl_components() -> dict[str, Any]:
    unet = seeded(
        lambda: UNet2DConditionModel(
            sample_size=32,  # 64 px at vae_scale_factor 2: the pipeline default
            in_channels=4,
            out_channels=4,
            block_out_channels=(16, 32),
            norm_num_groups=8,
            layers_per_block=2,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            attention_head_dim=(2, 4),
            use_linear_projection=True,
            addition_embed_type="text_time",
            addition_time_embed_dim=8,
            transformer_layers_per_block=(1, 2),
            # 6 micro-conditioning ids * 8 + text_encoder_2 projection_dim 32
            projection_class_embeddings_input_dim=80,
            # concat of both text encoders' hidden states (32 + 32)
            cross_attention_dim=2 * _TEXT_WIDTH,
        )
    )
    vae = tiny_vae(latent_channels=4, scaling_factor=0.13025, shift_factor=None)  # SDXL's scaling factor
    return sdxl_components(unet, clip_widths=(_TEXT_WIDTH, _TEXT_WIDTH), vae=vae)


# --------------------------------------------------------------------------- public API


def build_tiny_flux_pipeline(torch_dtype: torch.dtype = torch.float32) -> FluxPipeline:
    """The `tiny-flux` model: a ``FluxPipeline`` on CPU with random but bit-identical weights on every call.

    The caller's global torch RNG state is left untouched; builds are
    serialised with each other, but another thread drawing from the global
    CPU RNG during a build would still change the weights. Height/width must
    be multiples of 4 (vae_scale_factor 2 times the 2x2 latent packing).
    """
    return seeded_pipeline("tiny-flux", FluxPipeline, _tiny_flux_components, torch_dtype)


def build_tiny_sdxl_pipeline(torch_dtype: torch.dtype = torch.float32) -> StableDiffusionXLPipeline:
    """The `tiny-sdxl` model: a ``StableDiffusionXLPipeline`` built as :func:`build_tiny_flux_pipeline` is.

    Height/width must be multiples of 2 (vae_scale_factor 2).
    """
    return seeded_pipeline("tiny-sdxl", StableDiffusionXLPipeline, _tiny_sdxl_components, torch_dtype)
