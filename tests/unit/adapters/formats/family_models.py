"""The transformers of the families issue 42 adds, built on the meta device (nothing allocated), for the layout tests.

FULL: the published models' transformer configs (each model's transformer/config.json); TINY: a few-layer model of
each at widths no published model has (so a mapping that used a published width instead of the model's own would
show), small enough that a test forms every dense ΔW.
"""

from __future__ import annotations

import functools

import torch

from loraswap.server.engine.adapters.formats import ModelLayers, SlotSpec
from loraswap.server.engine.families import FAMILIES
from loraswap.server.engine.pipeline.target_layers import resolve_target_layers
from loraswap.server.engine.types import ModelFamily

FLUX2_DEV = dict(
    patch_size=1, in_channels=128, num_layers=8, num_single_layers=48, attention_head_dim=128, num_attention_heads=48,
    joint_attention_dim=15360, timestep_guidance_channels=256, mlp_ratio=3.0, axes_dims_rope=(32, 32, 32, 32),
    rope_theta=2000, eps=1e-6, guidance_embeds=True,
)  # fmt: skip
FULL: dict[str, tuple[ModelFamily, dict]] = {
    "qwen-image": (ModelFamily.QWEN_IMAGE, dict(
        patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128, num_attention_heads=24,
        joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56))),
    "z-image": (ModelFamily.Z_IMAGE, dict(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840, n_layers=30, n_refiner_layers=2,
        n_heads=30, n_kv_heads=30, norm_eps=1e-5, qk_norm=True, cap_feat_dim=2560, rope_theta=256.0, t_scale=1000.0,
        axes_dims=[32, 48, 48], axes_lens=[1536, 512, 512])),
    "flux2-dev": (ModelFamily.FLUX2, FLUX2_DEV),
    "flux2-klein-4b": (ModelFamily.FLUX2, dict(FLUX2_DEV, num_layers=5, num_single_layers=20, num_attention_heads=24,
                                               joint_attention_dim=7680, guidance_embeds=False)),
    "flux2-klein-9b": (ModelFamily.FLUX2, dict(FLUX2_DEV, num_layers=8, num_single_layers=24, num_attention_heads=32,
                                               joint_attention_dim=12288, guidance_embeds=False)),
}  # fmt: skip
TINY: dict[str, tuple[ModelFamily, dict]] = {
    "qwen-image": (ModelFamily.QWEN_IMAGE, dict(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=3,
        joint_attention_dim=20, guidance_embeds=False, axes_dims_rope=(4, 2, 2))),
    "z-image": (ModelFamily.Z_IMAGE, dict(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=24, n_layers=2, n_refiner_layers=1, n_heads=3,
        n_kv_heads=3, qk_norm=True, cap_feat_dim=20, rope_theta=256, t_scale=1000, axes_dims=[4, 2, 2],
        axes_lens=[256, 64, 64])),
    "flux2": (ModelFamily.FLUX2, dict(
        patch_size=1, in_channels=12, num_layers=2, num_single_layers=2, attention_head_dim=8, num_attention_heads=3,
        joint_attention_dim=36, timestep_guidance_channels=16, mlp_ratio=2.5, axes_dims_rope=(2, 2, 2, 2),
        rope_theta=2000, guidance_embeds=True)),
}  # fmt: skip
TRANSFORMER_CLASSES = {
    ModelFamily.QWEN_IMAGE: "QwenImageTransformer2DModel",
    ModelFamily.Z_IMAGE: "ZImageTransformer2DModel",
    ModelFamily.FLUX2: "Flux2Transformer2DModel",
}


def meta_transformer(family: ModelFamily, config: dict) -> torch.nn.Module:
    """The family's diffusers transformer at `config`, on the meta device."""
    import diffusers

    with torch.device("meta"):
        return getattr(diffusers, TRANSFORMER_CLASSES[family])(**config)


@functools.cache
def model(name: str, *, tiny: bool = False) -> tuple[ModelFamily, torch.nn.Module, ModelLayers]:
    """(family, meta transformer, its ModelLayers) of a FULL (or, `tiny`, TINY) model."""
    family, config = (TINY if tiny else FULL)[name]
    transformer = meta_transformer(family, config)
    return family, transformer, ModelLayers.of({"transformer": transformer})


def slot_spec(name: str, *, tiny: bool = False, fuse: bool = True, max_rank: int = 16) -> SlotSpec:
    """What a runtime of this model with the family's default target modules would accept (float32 on the CPU)."""
    family, transformer, layers = model(name, tiny=tiny)
    targets = resolve_target_layers(transformer, FAMILIES[family].default_target_modules)
    modules = dict(transformer.named_modules())
    return SlotSpec(
        family=family,
        layer_shapes={name: (modules[name].in_features, modules[name].out_features) for name in targets},
        max_rank=max_rank,
        dtype=torch.float32,
        device=torch.device("cpu"),
        denoiser_config=transformer.config,
        fuse=fuse,
        biased_layers=frozenset(name for name in targets if modules[name].bias is not None),
        model_layers=layers,
    )


def linear_layers(layers: ModelLayers) -> dict[str, tuple[int, ...]]:
    """Every linear layer of the transformer: module path -> weight shape."""
    return {module: shape.weight for module, shape in layers.shapes["transformer"].items() if len(shape.weight) == 2}
