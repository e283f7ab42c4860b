"""Full-size random-weight denoisers: the real SDXL UNet and FLUX.1-dev transformer, nothing downloaded.

Swap costs depend on layer shapes, not on what the weights say, so a denoiser
built from the published config with random weights measures adapter swaps on
any machine exactly as the real checkpoint would. The configs are bundled
here as dicts (copied from ``stabilityai/stable-diffusion-xl-base-1.0``
``unet/config.json`` and ``black-forest-labs/FLUX.1-dev``
``transformer/config.json``).

Construction (meta device, cast, ``to_empty``, seeded fill: the full SDXL UNet's 2.6 B parameters never
exist in float32) is random_weights.py's.

The pipelines around the denoisers are *not* full size: text encoders, VAE
and tokenizers are tiny random ones whose output widths match what the full
denoiser reads (CLIP 768 + 1280 for SDXL's 2048-wide cross-attention, T5
4096 and CLIP 768 for Flux), and the VAE keeps the real downscale factor of 8
and latent channels (4 for SDXL, 16 for Flux). Only the denoiser's cost and
shapes are real.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import (
    FluxPipeline,
    FluxTransformer2DModel,
    ModelMixin,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)

from loraswap.server.engine.models.components import flux_components, sdxl_components
from loraswap.server.engine.models.random_weights import (
    assemble_around,
    depth_cut,
    flux1_stand_in_vae,
    random_denoiser,
    sdxl_stand_in_vae,
)

__all__ = [
    "FLUX_FULL_DEPTH",
    "build_random_flux_pipeline",
    "build_random_flux_transformer",
    "build_random_sdxl_pipeline",
    "build_random_sdxl_unet",
    "flux_depth",
]

# stabilityai/stable-diffusion-xl-base-1.0, unet/config.json (2,567,463,684 parameters).
SDXL_UNET_CONFIG: dict[str, Any] = {
    "act_fn": "silu",
    "addition_embed_type": "text_time",
    "addition_embed_type_num_heads": 64,
    "addition_time_embed_dim": 256,
    "attention_head_dim": [5, 10, 20],
    "block_out_channels": [320, 640, 1280],
    "center_input_sample": False,
    "class_embed_type": None,
    "class_embeddings_concat": False,
    "conv_in_kernel": 3,
    "conv_out_kernel": 3,
    "cross_attention_dim": 2048,
    "cross_attention_norm": None,
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    "downsample_padding": 1,
    "dual_cross_attention": False,
    "encoder_hid_dim": None,
    "encoder_hid_dim_type": None,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "in_channels": 4,
    "layers_per_block": 2,
    "mid_block_only_cross_attention": None,
    "mid_block_scale_factor": 1,
    "mid_block_type": "UNetMidBlock2DCrossAttn",
    "norm_eps": 1e-05,
    "norm_num_groups": 32,
    "num_attention_heads": None,
    "num_class_embeds": None,
    "only_cross_attention": False,
    "out_channels": 4,
    "projection_class_embeddings_input_dim": 2816,
    "resnet_out_scale_factor": 1.0,
    "resnet_skip_time_act": False,
    "resnet_time_scale_shift": "default",
    "sample_size": 128,
    "time_cond_proj_dim": None,
    "time_embedding_act_fn": None,
    "time_embedding_dim": None,
    "time_embedding_type": "positional",
    "timestep_post_act": None,
    "transformer_layers_per_block": [1, 2, 10],
    "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
    "upcast_attention": None,
    "use_linear_projection": True,
}

# black-forest-labs/FLUX.1-dev, transformer/config.json (11,901,408,320 parameters at full depth).
FLUX_TRANSFORMER_CONFIG: dict[str, Any] = {
    "attention_head_dim": 128,
    "axes_dims_rope": [16, 56, 56],
    "guidance_embeds": True,
    "in_channels": 64,
    "joint_attention_dim": 4096,
    "num_attention_heads": 24,
    "num_layers": 19,
    "num_single_layers": 38,
    "out_channels": None,
    "patch_size": 1,
    "pooled_projection_dim": 768,
}
# (double-stream blocks, single-stream blocks) of FLUX.1 at full depth.
FLUX_FULL_DEPTH = (19, 38)


def flux_depth(layers: int | None) -> tuple[int, int]:
    """(double-stream, single-stream) blocks for `layers` double-stream blocks; the 1:2 ratio of FLUX.1 is kept.

    Raises:
        ValueError: for `layers` outside 1 to 19 (None is full depth).
    """
    if layers is None:
        return FLUX_FULL_DEPTH
    double = depth_cut(layers, FLUX_FULL_DEPTH[0], "double-stream blocks")
    return double, min(2 * double, FLUX_FULL_DEPTH[1])


def build_random_sdxl_unet(torch_dtype: torch.dtype = torch.bfloat16) -> UNet2DConditionModel:
    """SDXL base 1.0's full UNet with seeded random weights, built directly in `torch_dtype` (on the GPU if any).

    bfloat16 keeps it at 5.1 GB. In eval mode, identical on every call; the caller's RNG state is untouched.
    """
    return random_denoiser("random-sdxl", UNet2DConditionModel, dict(SDXL_UNET_CONFIG), torch_dtype)


def build_random_flux_transformer(
    torch_dtype: torch.dtype = torch.bfloat16, layers: int | None = None
) -> FluxTransformer2DModel:
    """FLUX.1-dev's transformer with seeded random weights, built directly in `torch_dtype` (on the GPU if any).

    Args:
        torch_dtype: dtype of every weight.
        layers: double-stream blocks to keep (single-stream blocks: twice that, at most 38);
            None builds full depth (19 + 38 blocks, about 24 GB in bfloat16).

    Returns:
        The transformer in eval mode, identical on every call with the same arguments.
        The caller's RNG state is untouched.

    Raises:
        ValueError: for `layers` out of range (see :func:`flux_depth`).
    """
    config = dict(FLUX_TRANSFORMER_CONFIG)
    config["num_layers"], config["num_single_layers"] = flux_depth(layers)
    return random_denoiser("random-flux", FluxTransformer2DModel, config, torch_dtype)


def _sdxl_components(unet: ModelMixin) -> dict[str, Any]:
    # Widths the full UNet reads: hidden states 768 + 1280 = cross_attention_dim 2048;
    # pooled 1280 + 6 * 256 time ids = projection_class_embeddings_input_dim 2816.
    return sdxl_components(unet, clip_widths=(768, 1280), vae=sdxl_stand_in_vae())


def _flux_components(transformer: ModelMixin) -> dict[str, Any]:
    # pooled_projection_dim 768; joint_attention_dim 4096.
    return flux_components(transformer, clip_width=768, t5_width=4096, vae=flux1_stand_in_vae())


def build_random_sdxl_pipeline(torch_dtype: torch.dtype = torch.bfloat16) -> StableDiffusionXLPipeline:
    """The `random-sdxl` model: a ``StableDiffusionXLPipeline`` around :func:`build_random_sdxl_unet`.

    Text encoders and VAE are tiny random stand-ins (see the module docstring);
    every component is in `torch_dtype`, on CPU (the denoiser on the GPU when there is one), identical on every call.
    Height/width must be multiples of 8 (the VAE downscales by 8; the UNet pads odd latent sizes itself).
    """
    unet = build_random_sdxl_unet(torch_dtype)
    return assemble_around("random-sdxl", StableDiffusionXLPipeline, unet, _sdxl_components, torch_dtype)


def build_random_flux_pipeline(torch_dtype: torch.dtype = torch.bfloat16, layers: int | None = None) -> FluxPipeline:
    """The `random-flux` model: a ``FluxPipeline`` around :func:`build_random_flux_transformer`.

    Built as :func:`build_random_sdxl_pipeline` is. Height/width must be multiples of 16
    (the VAE downscales by 8 and Flux packs 2x2 latent patches).

    Raises:
        ValueError: for `layers` out of range (see :func:`flux_depth`).
    """
    transformer = build_random_flux_transformer(torch_dtype, layers)
    return assemble_around("random-flux", FluxPipeline, transformer, _flux_components, torch_dtype)
