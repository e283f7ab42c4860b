"""The original (non-diffusers) models' layer names that kohya-style files carry, as the diffusers model's layers.

sd-scripts trains on the original models and names their layers, not diffusers':
- SDXL, the sgm UNet: `input_blocks_N_M`, `middle_block_M`, `output_blocks_N_M`, with resnets' `in_layers_2`,
  `emb_layers_1`, `out_layers_3` and `skip_connection`, and `time_embed`, `label_emb`, `out_2` outside the blocks.
  `sgm_to_diffusers` maps them from the UNet's own config (layers per block, which blocks have attentions and
  resamplers), as diffusers' UNet builds them.
- Flux, Black Forest Labs' model (BFL): `double_blocks_N_img_attn_qkv`, `single_blocks_N_linear1`, `img_in`,
  `final_layer_adaLN_modulation_1`, ... `bfl_to_diffusers` maps them as diffusers' single-file converter loads
  BFL checkpoints. Some BFL layers are several diffusers layers stacked by rows (img_attn_qkv is to_q, to_k, to_v;
  linear1 is to_q, to_k, to_v and proj_mlp): a change of such a layer is cut by rows, each layer's its own rows
  (their widths are the model's, not FLUX.1's constants). BFL's final modulation is (shift, scale) where diffusers'
  norm_out is (scale, shift): its two halves are swapped.
- FLUX.2, BFL's model again (sd-scripts, musubi-tuner, ai-toolkit and ComfyUI name its layers): the same block
  names, but `linear1` stays whole (diffusers fuses it too, as `attn.to_qkv_mlp_proj`), `linear2` is `attn.to_out`,
  the MLPs are `ff.linear_in/out`, and the modulation is shared by all blocks of a stream
  (`double_stream_modulation_img_lin`, `single_stream_modulation_lin`). `bfl2_to_diffusers` maps them as diffusers'
  single-file converter loads FLUX.2 checkpoints.
- Z-Image, its original model (ComfyUI's names): attention fuses `qkv` (to_q, to_k, to_v by rows) and calls its
  output `out`; the embedder and the final layer are outside the per-patch-size dicts diffusers keeps them in
  (`x_embedder` is `all_x_embedder.2-1` for 2x2 patches of one frame). `z_image_to_diffusers` maps them as diffusers'
  single-file converter loads Z-Image checkpoints, the patch sizes from the model's config.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from loraswap.server.engine.types import ModelFamily


@dataclass(frozen=True)
class OriginalLayer:
    """An original layer as the diffusers model's layers: their paths ('.' written '_') in the order their rows are
    stacked in it; `swap_halves`: the one layer's two halves of rows are in the other order."""

    targets: tuple[str, ...]
    swap_halves: bool = False


# -- sgm (original SDXL UNet) names ------------------------------------------------------------------------

_SGM_OUTSIDE_BLOCKS = {
    "input_blocks_0_0": "conv_in",
    "time_embed_0": "time_embedding_linear_1",
    "time_embed_2": "time_embedding_linear_2",
    "label_emb_0_0": "add_embedding_linear_1",
    "label_emb_0_2": "add_embedding_linear_2",
    "out_0": "conv_norm_out",
    "out_2": "conv_out",
}
# A resnet's sgm sub-modules and their diffusers names.
_SGM_RESNET = {
    "in_layers_0": "norm1",
    "in_layers_2": "conv1",
    "emb_layers_1": "time_emb_proj",
    "out_layers_0": "norm2",
    "out_layers_3": "conv2",
    "skip_connection": "conv_shortcut",
}
_SGM_BLOCK = re.compile(r"(input_blocks|output_blocks)_(\d+)_(\d+)(?:_(.+))?|middle_block_(\d+)(?:_(.+))?")


def _has_attentions(block_type: str) -> bool:
    return "CrossAttn" in block_type or "Attn" in block_type


def _sgm_input_block(index: int, sub: int, config: Mapping) -> tuple[str, str] | None:
    """(diffusers prefix, what the sub-module is) of sgm input_blocks.index.sub."""
    per_block = config["layers_per_block"]
    per_block = per_block if isinstance(per_block, int) else per_block[0]
    block, layer = divmod(index - 1, per_block + 1)
    if index < 1 or block >= len(config["down_block_types"]):
        return None
    if layer == per_block:  # the downsampler after the block's layers
        return (f"down_blocks_{block}_downsamplers_0", "sampler") if sub == 0 else None
    if sub == 0:
        return f"down_blocks_{block}_resnets_{layer}", "resnet"
    if sub == 1 and _has_attentions(config["down_block_types"][block]):
        return f"down_blocks_{block}_attentions_{layer}", "attention"
    return None


def _sgm_output_block(index: int, sub: int, config: Mapping) -> tuple[str, str] | None:
    """(diffusers prefix, what the sub-module is) of sgm output_blocks.index.sub: [resnet, attention?, upsampler?]."""
    per_block = config["layers_per_block"]
    per_block = (per_block if isinstance(per_block, int) else per_block[0]) + 1
    block, layer = divmod(index, per_block)
    block_types = config["up_block_types"]
    if block >= len(block_types):
        return None
    parts = ["resnet"]
    if _has_attentions(block_types[block]):
        parts.append("attention")
    if layer == per_block - 1 and block < len(block_types) - 1:
        parts.append("sampler")
    if sub >= len(parts):
        return None
    kind = parts[sub]
    if kind == "resnet":
        return f"up_blocks_{block}_resnets_{layer}", kind
    if kind == "attention":
        return f"up_blocks_{block}_attentions_{layer}", kind
    return f"up_blocks_{block}_upsamplers_0", kind


def sgm_to_diffusers(flat: str, config: Mapping) -> str | None:
    """The diffusers module path, '.' written '_', of an sgm-named UNet layer; None when it is not one."""
    if flat in _SGM_OUTSIDE_BLOCKS:
        return _SGM_OUTSIDE_BLOCKS[flat]
    match = _SGM_BLOCK.fullmatch(flat)
    if match is None:
        return None
    if match.group(5) is not None:  # middle_block.M: resnet, attention, resnet
        sub, rest = int(match.group(5)), match.group(6) or ""
        place = {0: ("mid_block_resnets_0", "resnet"), 1: ("mid_block_attentions_0", "attention"),
                 2: ("mid_block_resnets_1", "resnet")}.get(sub)  # fmt: skip
    else:
        index, sub, rest = int(match.group(2)), int(match.group(3)), match.group(4) or ""
        blocks = _sgm_input_block if match.group(1) == "input_blocks" else _sgm_output_block
        place = blocks(index, sub, config)
    if place is None or not rest:
        return None
    prefix, kind = place
    if kind == "resnet":
        rest = _SGM_RESNET.get(rest, rest)
    elif kind == "sampler":
        rest = {"op": "conv", "conv": "conv"}.get(rest, rest)
    return f"{prefix}_{rest}"


def sgm_layer(flat: str, config: Mapping) -> OriginalLayer | None:
    """sgm_to_diffusers as an OriginalLayer."""
    mapped = sgm_to_diffusers(flat, config)
    return OriginalLayer((mapped,)) if mapped is not None else None


# -- BFL (original Flux) names ----------------------------------------------------------------------------

# Inside double_blocks.N -> inside transformer_blocks.N, rows stacked in this order: attention, the same in both
# Flux generations.
_BFL_ATTENTION = {
    "img_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "txt_attn_qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    "img_attn_proj": ("attn.to_out.0",),
    "txt_attn_proj": ("attn.to_add_out",),
}
_BFL_DOUBLE = {
    **_BFL_ATTENTION,
    "img_mlp_0": ("ff.net.0.proj",),
    "img_mlp_2": ("ff.net.2",),
    "txt_mlp_0": ("ff_context.net.0.proj",),
    "txt_mlp_2": ("ff_context.net.2",),
    "img_mod_lin": ("norm1.linear",),
    "txt_mod_lin": ("norm1_context.linear",),
}
# Inside single_blocks.N -> inside single_transformer_blocks.N.
_BFL_SINGLE = {
    "linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"),
    "linear2": ("proj_out",),
    "modulation_lin": ("norm.linear",),
}
_BFL_OUTSIDE = {
    "img_in": "x_embedder",
    "txt_in": "context_embedder",
    "time_in_in_layer": "time_text_embed.timestep_embedder.linear_1",
    "time_in_out_layer": "time_text_embed.timestep_embedder.linear_2",
    "vector_in_in_layer": "time_text_embed.text_embedder.linear_1",
    "vector_in_out_layer": "time_text_embed.text_embedder.linear_2",
    "guidance_in_in_layer": "time_text_embed.guidance_embedder.linear_1",
    "guidance_in_out_layer": "time_text_embed.guidance_embedder.linear_2",
    "final_layer_linear": "proj_out",
}
# FLUX.2: no per-block modulation, SwiGLU MLPs, linear1 fused in diffusers too.
_BFL2_DOUBLE = {
    **_BFL_ATTENTION,
    "img_mlp_0": ("ff.linear_in",),
    "img_mlp_2": ("ff.linear_out",),
    "txt_mlp_0": ("ff_context.linear_in",),
    "txt_mlp_2": ("ff_context.linear_out",),
}
_BFL2_SINGLE = {
    "linear1": ("attn.to_qkv_mlp_proj",),
    "linear2": ("attn.to_out",),
}
_BFL2_OUTSIDE = {
    "img_in": "x_embedder",
    "txt_in": "context_embedder",
    "time_in_in_layer": "time_guidance_embed.timestep_embedder.linear_1",
    "time_in_out_layer": "time_guidance_embed.timestep_embedder.linear_2",
    "guidance_in_in_layer": "time_guidance_embed.guidance_embedder.linear_1",
    "guidance_in_out_layer": "time_guidance_embed.guidance_embedder.linear_2",
    "double_stream_modulation_img_lin": "double_stream_modulation_img.linear",
    "double_stream_modulation_txt_lin": "double_stream_modulation_txt.linear",
    "single_stream_modulation_lin": "single_stream_modulation.linear",
    "final_layer_linear": "proj_out",
}
_BFL_SWAPPED = {"final_layer_adaLN_modulation_1": "norm_out.linear"}  # (shift, scale) -> (scale, shift)
_BFL_BLOCK = re.compile(r"(double_blocks|single_blocks)_(\d+)_(.+)")


def _flat(*paths: str) -> tuple[str, ...]:
    return tuple(path.replace(".", "_") for path in paths)


def _bfl_layer(
    flat: str, outside: Mapping[str, str], double: Mapping[str, tuple[str, ...]], single: Mapping[str, tuple[str, ...]]
) -> OriginalLayer | None:
    """A BFL-named layer by one Flux generation's tables; None when it is not one."""
    if flat in outside:
        return OriginalLayer(_flat(outside[flat]))
    if flat in _BFL_SWAPPED:
        return OriginalLayer(_flat(_BFL_SWAPPED[flat]), swap_halves=True)
    match = _BFL_BLOCK.fullmatch(flat)
    if match is None:
        return None
    kind, index, rest = match.groups()
    table, block = (double, "transformer_blocks") if kind == "double_blocks" else (single, "single_transformer_blocks")
    targets = table.get(rest)
    return OriginalLayer(_flat(*(f"{block}.{index}.{target}" for target in targets))) if targets else None


def bfl_to_diffusers(flat: str) -> OriginalLayer | None:
    """The diffusers layers of a BFL-named Flux layer ('.' written '_'); None when it is not one."""
    return _bfl_layer(flat, _BFL_OUTSIDE, _BFL_DOUBLE, _BFL_SINGLE)


def bfl2_to_diffusers(flat: str) -> OriginalLayer | None:
    """The diffusers layers of a BFL-named FLUX.2 layer ('.' written '_'); None when it is not one."""
    return _bfl_layer(flat, _BFL2_OUTSIDE, _BFL2_DOUBLE, _BFL2_SINGLE)


# -- Z-Image's original names ----------------------------------------------------------------------------------

_Z_IMAGE_ATTENTION = re.compile(r"(layers|noise_refiner|context_refiner)_(\d+)_attention_(qkv|out)")
_Z_IMAGE_OUTSIDE = {  # -> inside the per-patch-size dicts, named by the model's patch sizes
    "x_embedder": "all_x_embedder.{patch}",
    "final_layer_linear": "all_final_layer.{patch}.linear",
    "final_layer_adaLN_modulation_1": "all_final_layer.{patch}.adaLN_modulation.1",
}


def z_image_to_diffusers(flat: str, config: Mapping) -> OriginalLayer | None:
    """The diffusers layers of a Z-Image layer in its original names ('.' written '_'); None when it is not one."""
    if flat in _Z_IMAGE_OUTSIDE:
        # diffusers keys its per-patch-size layers "<patch>-<frame patch>"; the original model has the first pair's.
        patch = f"{config['all_patch_size'][0]}-{config['all_f_patch_size'][0]}"
        return OriginalLayer(_flat(_Z_IMAGE_OUTSIDE[flat].format(patch=patch)))
    match = _Z_IMAGE_ATTENTION.fullmatch(flat)
    if match is None:
        return None
    block, index, name = match.groups()
    projections = ("to_q", "to_k", "to_v") if name == "qkv" else ("to_out.0",)
    return OriginalLayer(_flat(*(f"{block}.{index}.attention.{projection}" for projection in projections)))


def original_layer(family: ModelFamily, flat: str, denoiser_config: Mapping) -> OriginalLayer | None:
    """The diffusers layers of a layer of the original model `family`'s files name, written kohya's way ('.' as
    '_'): sgm for SDXL, BFL for Flux and FLUX.2, Z-Image's own; None when `flat` names none (or the family has no
    such names: Qwen-Image's are diffusers')."""
    if family == ModelFamily.SDXL:
        return sgm_layer(flat, denoiser_config)
    if family == ModelFamily.FLUX:
        return bfl_to_diffusers(flat)
    if family == ModelFamily.FLUX2:
        return bfl2_to_diffusers(flat)
    if family == ModelFamily.Z_IMAGE:
        return z_image_to_diffusers(flat, denoiser_config)
    return None
