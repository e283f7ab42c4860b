"""Tiny random-weight pipelines of the Qwen-Image, Z-Image and FLUX.2 families, as tiny.py's are of FLUX.1 and SDXL.

``tiny-qwen-image`` (``QwenImagePipeline``), ``tiny-z-image`` (``ZImagePipeline``), ``tiny-flux2``
(``Flux2Pipeline``, FLUX.2 [dev]: guidance embedded) and ``tiny-flux2-klein`` (``Flux2KleinPipeline``,
distilled as FLUX.2-klein-4B): the real classes throughout, at widths of 16 to 32, built offline from configs
and seeded initialisation, bit-identical on every build. Each keeps the shape rules of its real checkpoint that
a pipeline call depends on: how the latents are packed, which text encoder hidden states the pipeline reads
(so FLUX.2's text encoders are 31 and 28 layers deep), the template tokens Qwen-Image drops, the published
schedulers. Every VAE here downscales by 2, so heights and widths are multiples of 4 (16 for the real ones).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from diffusers import (
    DiffusionPipeline,
    Flux2KleinPipeline,
    Flux2Pipeline,
    Flux2Transformer2DModel,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
    ZImagePipeline,
    ZImageTransformer2DModel,
)

from loraswap.server.engine.models.components import seeded, seeded_pipeline, tiny_vae
from loraswap.server.engine.models.family_components import (
    FLUX2_DEV_TEXT_LAYERS,
    FLUX2_KLEIN_TEXT_LAYERS,
    TextShape,
    flux2_dev_components,
    flux2_klein_components,
    flux2_vae,
    qwen_image_components,
    qwen_image_vae,
    z_image_components,
)

__all__ = ["TINY_FAMILY_MODELS", "build_tiny_family_pipeline"]

_LATENT_CHANNELS = 4  # real: 16 (Qwen-Image, Z-Image), 32 (FLUX.2)
# FLUX.2 reads three text encoder layers stacked: joint_attention_dim = 3 * the text width.
_FLUX2_TEXT_WIDTH = 16


def _tiny_qwen_image_components() -> dict[str, Any]:
    text = TextShape(width=32, layers=2, heads=2, kv_heads=2, intermediate=37)
    transformer = seeded(
        lambda: QwenImageTransformer2DModel(
            patch_size=2,
            in_channels=_LATENT_CHANNELS * 4,  # the pipeline packs 2x2 latent patches
            out_channels=_LATENT_CHANNELS,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=text.width,
            guidance_embeds=False,
            axes_dims_rope=(8, 4, 4),  # sums to attention_head_dim
        )
    )
    vae = qwen_image_vae(
        base_dim=16, z_dim=_LATENT_CHANNELS, dim_mult=[1, 2], temperal_downsample=[False],
        latents_mean=[0.0] * _LATENT_CHANNELS, latents_std=[1.0] * _LATENT_CHANNELS,
    )  # fmt: skip
    return qwen_image_components(transformer, text=text, vae=vae)


def _tiny_z_image_components() -> dict[str, Any]:
    text = TextShape(width=32, layers=2, heads=2, kv_heads=1, head_dim=16, intermediate=37)
    transformer = seeded(
        lambda: ZImageTransformer2DModel(
            all_patch_size=(2,),
            all_f_patch_size=(1,),
            in_channels=_LATENT_CHANNELS,  # not packed: the transformer patchifies itself
            dim=32,
            n_layers=2,
            n_refiner_layers=1,
            n_heads=2,
            n_kv_heads=2,
            norm_eps=1e-5,
            qk_norm=True,
            cap_feat_dim=text.width,
            rope_theta=256.0,
            t_scale=1000.0,
            axes_dims=[8, 4, 4],  # sums to the head width, dim / n_heads
            # As Z-Image-Turbo's: positions along the caption-and-image axis, and latent rows and columns in patches.
            axes_lens=[1536, 512, 512],
        )
    )
    vae = tiny_vae(latent_channels=_LATENT_CHANNELS, scaling_factor=0.3611, shift_factor=0.1159)  # FLUX.1's kind
    return z_image_components(transformer, text=text, vae=vae)


def _tiny_flux2_transformer(*, guidance_embeds: bool) -> Flux2Transformer2DModel:
    return seeded(
        lambda: Flux2Transformer2DModel(
            patch_size=1,
            in_channels=_LATENT_CHANNELS * 4,  # the pipelines patchify 2x2 latent patches
            num_layers=2,
            num_single_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=3 * _FLUX2_TEXT_WIDTH,
            timestep_guidance_channels=256,
            mlp_ratio=3.0,
            axes_dims_rope=(4, 4, 4, 4),  # 4 axes (T, H, W, L) summing to attention_head_dim
            rope_theta=2000,
            guidance_embeds=guidance_embeds,
        )
    )


def _tiny_flux2_vae() -> torch.nn.Module:
    return flux2_vae(latent_channels=_LATENT_CHANNELS, block_out_channels=(8, 16), sample_size=64)


def _tiny_flux2_dev_components() -> dict[str, Any]:
    text = TextShape(width=_FLUX2_TEXT_WIDTH, layers=FLUX2_DEV_TEXT_LAYERS)
    return flux2_dev_components(_tiny_flux2_transformer(guidance_embeds=True), text=text, vae=_tiny_flux2_vae())


def _tiny_flux2_klein_components() -> dict[str, Any]:
    text = TextShape(width=_FLUX2_TEXT_WIDTH, layers=FLUX2_KLEIN_TEXT_LAYERS)
    return flux2_klein_components(_tiny_flux2_transformer(guidance_embeds=False), text=text, vae=_tiny_flux2_vae())


# name: (the pipeline class, its components)
TINY_FAMILY_MODELS: dict[str, tuple[type[DiffusionPipeline], Callable[[], dict[str, Any]]]] = {
    "tiny-qwen-image": (QwenImagePipeline, _tiny_qwen_image_components),
    "tiny-z-image": (ZImagePipeline, _tiny_z_image_components),
    "tiny-flux2": (Flux2Pipeline, _tiny_flux2_dev_components),
    "tiny-flux2-klein": (Flux2KleinPipeline, _tiny_flux2_klein_components),
}


def build_tiny_family_pipeline(name: str, torch_dtype: torch.dtype = torch.float32) -> DiffusionPipeline:
    """The tiny model `name` (a key of TINY_FAMILY_MODELS) on CPU in `torch_dtype`, bit-identical on every call.

    Built in float32 and then cast, so every dtype holds the same weights; the caller's global RNG state is
    left untouched (see tiny.py's builders).
    """
    pipeline_cls, components_fn = TINY_FAMILY_MODELS[name]
    return seeded_pipeline(name, pipeline_cls, components_fn, torch_dtype)
