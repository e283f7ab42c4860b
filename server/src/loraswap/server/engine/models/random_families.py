"""Full-size random-weight denoisers of the Qwen-Image, Z-Image and FLUX.2 [klein] families, nothing downloaded.

``random-qwen-image``, ``random-z-image`` and ``random-flux2-klein`` are to these families what random_full.py's
``random-flux`` is to FLUX.1: the published transformer config (copied here from each model's
``transformer/config.json``) with seeded random weights, built as random_weights.py builds them, and a depth cut
(`layers`) so that the wide blocks fit a small machine: Qwen-Image's 60 blocks (20.4 B parameters, 38 GiB in
bfloat16), Z-Image's 30 main layers (its 2 + 2 refiner layers are kept; 6.2 B), FLUX.2-klein-4B's 5 double-stream
blocks (single-stream blocks: four times as many, as at full depth; 3.9 B). FLUX.2 [dev] (32 B) has none.

The parts around the denoisers are small seeded stand-ins of the widths the denoisers read: Qwen2.5-VL's 3584
(one layer), Qwen3-4B's 2560 (two layers for Z-Image; 28 for klein, which stacks layers 9, 18 and 27 into 7680),
and VAEs with the real latent channels (16, 16, 32) and downscale factor 8. Heights and widths are multiples of
16 (the VAE's 8 times 2x2 latent patches); Z-Image refuses others, the rest round down.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from diffusers import (
    DiffusionPipeline,
    Flux2KleinPipeline,
    Flux2Transformer2DModel,
    ModelMixin,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
    ZImagePipeline,
    ZImageTransformer2DModel,
)
from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope

from loraswap.server.engine.models.family_components import (
    FLUX2_KLEIN_TEXT_LAYERS,
    TextShape,
    flux2_klein_components,
    flux2_vae,
    qwen_image_components,
    qwen_image_vae,
    z_image_components,
)
from loraswap.server.engine.models.random_weights import (
    STAND_IN_VAE_LEVELS,
    assemble_around,
    depth_cut,
    flux1_stand_in_vae,
    random_denoiser,
)

__all__ = [
    "FLUX2_KLEIN_4B_TRANSFORMER_CONFIG",
    "QWEN_IMAGE_TRANSFORMER_CONFIG",
    "RANDOM_FAMILY_MODELS",
    "Z_IMAGE_TRANSFORMER_CONFIG",
    "build_random_family_pipeline",
    "build_random_family_transformer",
]

# Qwen/Qwen-Image transformer/config.json (20,430,401,088 parameters at full depth).
QWEN_IMAGE_TRANSFORMER_CONFIG: dict[str, Any] = dict(
    patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128, num_attention_heads=24,
    joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56),
)  # fmt: skip
# Tongyi-MAI/Z-Image-Turbo transformer/config.json (6,154,908,736 parameters at full depth).
Z_IMAGE_TRANSFORMER_CONFIG: dict[str, Any] = dict(
    all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840, n_layers=30, n_refiner_layers=2, n_heads=30,
    n_kv_heads=30, norm_eps=1e-5, qk_norm=True, cap_feat_dim=2560, rope_theta=256.0, t_scale=1000.0,
    axes_dims=[32, 48, 48], axes_lens=[1536, 512, 512],
)  # fmt: skip
# black-forest-labs/FLUX.2-klein-4B transformer/config.json (3,875,544,576 parameters at full depth).
FLUX2_KLEIN_4B_TRANSFORMER_CONFIG: dict[str, Any] = dict(
    patch_size=1, in_channels=128, num_layers=5, num_single_layers=20, attention_head_dim=128, num_attention_heads=24,
    joint_attention_dim=7680, timestep_guidance_channels=256, mlp_ratio=3.0, axes_dims_rope=(32, 32, 32, 32),
    rope_theta=2000, eps=1e-6, guidance_embeds=False,
)  # fmt: skip
# Single-stream blocks per double-stream block in klein-4B (20 : 5), kept at every depth.
_KLEIN_SINGLE_PER_DOUBLE = 4


def _flux2_stand_in_vae() -> torch.nn.Module:
    """A tiny FLUX.2 VAE with the real one's shape rules: 32 latent channels, downscale factor 8."""
    return flux2_vae(latent_channels=32, **STAND_IN_VAE_LEVELS)


def _random_qwen_image_transformer(torch_dtype: torch.dtype, layers: int | None) -> QwenImageTransformer2DModel:
    full = QWEN_IMAGE_TRANSFORMER_CONFIG["num_layers"]
    config = dict(QWEN_IMAGE_TRANSFORMER_CONFIG, num_layers=depth_cut(layers, full, "transformer blocks"))
    transformer = random_denoiser("random-qwen-image", QwenImageTransformer2DModel, config, torch_dtype)
    # QwenEmbedRope keeps its complex RoPE tables as plain attributes, not buffers (a buffer cast to the model's
    # dtype would lose their imaginary part): built on the meta device, they are left there by to_empty. Rebuilt as
    # the transformer builds it; it moves its tables to the input's device when called.
    transformer.pos_embed = QwenEmbedRope(theta=10000, axes_dim=list(config["axes_dims_rope"]), scale_rope=True)
    return transformer


def _random_z_image_transformer(torch_dtype: torch.dtype, layers: int | None) -> ZImageTransformer2DModel:
    full = Z_IMAGE_TRANSFORMER_CONFIG["n_layers"]
    config = dict(Z_IMAGE_TRANSFORMER_CONFIG, n_layers=depth_cut(layers, full, "main layers (refiners are kept)"))
    return random_denoiser("random-z-image", ZImageTransformer2DModel, config, torch_dtype)


def _random_flux2_klein_transformer(torch_dtype: torch.dtype, layers: int | None) -> Flux2Transformer2DModel:
    full = FLUX2_KLEIN_4B_TRANSFORMER_CONFIG["num_layers"]
    double = depth_cut(layers, full, "double-stream blocks")
    config = dict(
        FLUX2_KLEIN_4B_TRANSFORMER_CONFIG, num_layers=double, num_single_layers=_KLEIN_SINGLE_PER_DOUBLE * double
    )
    return random_denoiser("random-flux2-klein", Flux2Transformer2DModel, config, torch_dtype)


def _qwen_image_stand_ins(transformer: ModelMixin) -> dict[str, Any]:
    # Qwen2.5-VL-7B's width and heads (real: 28 layers); the published VAE's levels, latent channels and statistics.
    text = TextShape(width=3584, layers=1, heads=28, kv_heads=4, intermediate=64)
    vae = qwen_image_vae(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], temperal_downsample=[False, True, True])
    return qwen_image_components(transformer, text=text, vae=vae)


def _z_image_stand_ins(transformer: ModelMixin) -> dict[str, Any]:
    # Qwen3-4B's width (real: 36 layers; the pipeline reads the one before the last); FLUX.1's VAE kind.
    text = TextShape(width=2560, layers=2, head_dim=64, intermediate=64)
    return z_image_components(transformer, text=text, vae=flux1_stand_in_vae())


def _flux2_klein_stand_ins(transformer: ModelMixin) -> dict[str, Any]:
    text = TextShape(width=2560, layers=FLUX2_KLEIN_TEXT_LAYERS, head_dim=64, intermediate=32)
    return flux2_klein_components(transformer, text=text, vae=_flux2_stand_in_vae())


# name: (the pipeline class, its transformer builder (dtype, layers), the stand-ins around the transformer)
RANDOM_FAMILY_MODELS: dict[
    str,
    tuple[
        type[DiffusionPipeline],
        Callable[[torch.dtype, int | None], ModelMixin],
        Callable[[ModelMixin], dict[str, Any]],
    ],
] = {
    "random-qwen-image": (QwenImagePipeline, _random_qwen_image_transformer, _qwen_image_stand_ins),
    "random-z-image": (ZImagePipeline, _random_z_image_transformer, _z_image_stand_ins),
    "random-flux2-klein": (Flux2KleinPipeline, _random_flux2_klein_transformer, _flux2_klein_stand_ins),
}


def build_random_family_transformer(
    name: str, torch_dtype: torch.dtype = torch.bfloat16, layers: int | None = None
) -> ModelMixin:
    """The transformer of the random model `name` (a key of RANDOM_FAMILY_MODELS), `layers` deep (None: full).

    Built directly in `torch_dtype`, on the GPU if any, in eval mode, identical on every call with the same
    arguments on one device; the caller's RNG state is untouched.

    Raises:
        ValueError: for `layers` outside 1 to the model's full depth, before any weight exists.
    """
    _, transformer_fn, _ = RANDOM_FAMILY_MODELS[name]
    return transformer_fn(torch_dtype, layers)


def build_random_family_pipeline(
    name: str, torch_dtype: torch.dtype = torch.bfloat16, layers: int | None = None
) -> DiffusionPipeline:
    """The random model `name`: its pipeline around :func:`build_random_family_transformer`, every component in
    `torch_dtype` (on CPU; the transformer on the GPU if any), identical on every call.

    Raises:
        ValueError: for `layers` out of range (see :func:`build_random_family_transformer`).
    """
    pipeline_cls, transformer_fn, stand_ins = RANDOM_FAMILY_MODELS[name]
    return assemble_around(name, pipeline_cls, transformer_fn(torch_dtype, layers), stand_ins, torch_dtype)
