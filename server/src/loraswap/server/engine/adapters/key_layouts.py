"""Where the layers of a kohya-style file are: its layer names turned into the model's module paths, per component.

kohya's sd-scripts and the LyCORIS package (its kohya network and its own wrapper) name each layer
`<prefix>_<module path, '.' written '_'>` and its tensors `<layer>.<tensor>`: `lora_unet_down_blocks_1_attentions_0_
transformer_blocks_0_attn1_to_q.lora_up.weight`, `lora_te1_text_model_encoder_layers_0_self_attn_q_proj.hada_w1_a`.
The prefix names the component (the family's `kohya_prefixes`); the rest is resolved against the component's real
module paths (model_layers.py), so underscores inside names (`to_q`, `conv_shortcut`) are never guessed at.

SDXL files from sd-scripts use the names of the original (sgm) UNet sd-scripts trains SDXL on: `input_blocks_N_M`,
`middle_block_M`, `output_blocks_N_M`, with resnets' `in_layers_2`, `emb_layers_1`, `out_layers_3` and
`skip_connection`, and `time_embed`, `label_emb`, `out_2` outside the blocks. `sgm_to_diffusers` maps them from the
UNet's own config (layers per block, which blocks have attentions and resamplers), as diffusers' UNet builds them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from loraswap.server.engine.adapters.model_layers import ModelLayers
from loraswap.server.engine.errors import AdapterFormatError, ErrorReason, shorten

# The tensors of one layer a kind this server merges may have (adapters/weight_changes.py).
LAYER_TENSORS = frozenset({
    "lora_up.weight", "lora_down.weight", "lora_mid.weight",
    "hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2",
    "lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2",
    "diff", "diff_b", "alpha", "dora_scale",
})  # fmt: skip
# What the tensors of the LyCORIS kinds this server does not merge are called, and the kind's name.
UNSUPPORTED_KIND_TENSORS = {
    "oft_blocks": "OFT / BOFT (orthogonal fine-tuning)",
    "oft_diag": "OFT (orthogonal fine-tuning)",
    "rescale": "BOFT (orthogonal fine-tuning)",
    "on_input": "IA³",
    "weight": "IA³",
    "a1.weight": "GLoRA", "a2.weight": "GLoRA", "b1.weight": "GLoRA", "b2.weight": "GLoRA", "bm.weight": "GLoRA",
    "w_norm": "norm layers", "b_norm": "norm layers",
    "lambda_layer": "T-LoRA", "q_layer.weight": "T-LoRA", "p_layer.weight": "T-LoRA",
    "lokr_t1": "LoKr with a Tucker core on w1",
}  # fmt: skip
_LAYER_NAME = re.compile(r"[A-Za-z0-9_]+")


@dataclass(frozen=True)
class FileLayer:
    """One layer of a kohya-style file: the component and module path it changes, and its tensors by name."""

    component: str
    module: str
    name: str  # as the file spells it
    tensors: dict[str, torch.Tensor]


def _split_key(key: str) -> tuple[str, str] | None:
    layer, _, tensor = key.partition(".")
    return (layer, tensor) if tensor and _LAYER_NAME.fullmatch(layer) else None


def _component_of(layer: str, prefixes: Mapping[str, str]) -> tuple[str, str] | None:
    """(component, the name after its prefix), the longest prefix first (`lora_te1_` before `lora_te_`)."""
    for prefix in sorted(prefixes, key=len, reverse=True):
        if layer.startswith(prefix + "_"):
            return prefixes[prefix], layer[len(prefix) + 1 :]
    return None


def kohya_style_keys(state_dict: Mapping[str, torch.Tensor], prefixes: Mapping[str, str]) -> set[str]:
    """The keys spelled `<prefix>_<layer>.<tensor>` with one of the family's kohya prefixes."""
    return {
        key
        for key in state_dict
        if (split := _split_key(key)) is not None and _component_of(split[0], prefixes) is not None
    }


def holds_lycoris_kinds(state_dict: Mapping[str, torch.Tensor]) -> bool:
    """Whether any layer holds tensors of a kind beyond plain LoRA (LoHa, LoKr, full, DoRA, a Tucker core, ...)."""
    plain = {"lora_up.weight", "lora_down.weight", "alpha"}
    return any((split := _split_key(key)) is not None and split[1] not in plain for key in state_dict)


def refuse_unsupported_kinds(state_dict: Mapping[str, torch.Tensor]) -> None:
    """Raise ADAPTER_KIND_UNSUPPORTED, naming the kind and a few of its keys, when a layer holds a kind this server
    does not merge; ADAPTER_UNSUPPORTED_TENSORS for tensors of no known kind."""
    unsupported: dict[str, list[str]] = {}
    unknown = []
    for key in state_dict:
        split = _split_key(key)
        tensor = split[1] if split is not None else key
        if tensor in UNSUPPORTED_KIND_TENSORS:
            unsupported.setdefault(UNSUPPORTED_KIND_TENSORS[tensor], []).append(key)
        elif tensor not in LAYER_TENSORS:
            unknown.append(key)
    if unsupported:
        kind, keys = next(iter(sorted(unsupported.items())))
        raise AdapterFormatError(
            f"the adapter is a {kind} adapter ({len(keys)} tensors such as "
            f"{shorten(', '.join(shorten(key, 80) for key in sorted(keys)[:3]))}); this server merges LoRA, LoCon, "
            "LoHa, LoKr, full (diff) and DoRA adapters, not this kind: convert it to one of those or use another",
            reason=ErrorReason.ADAPTER_KIND_UNSUPPORTED,
            kind=kind,
        )
    if unknown:
        raise AdapterFormatError(
            f"the adapter has tensors of no adapter kind this server knows "
            f"({shorten(', '.join(shorten(key, 80) for key in sorted(unknown)[:5]))})",
            reason=ErrorReason.ADAPTER_UNSUPPORTED_TENSORS,
        )


def file_layers(
    state_dict: Mapping[str, torch.Tensor],
    prefixes: Mapping[str, str],
    model: ModelLayers,
    unet_config: Mapping | None = None,
) -> list[FileLayer]:
    """The file's layers with the model's component and module path of each.

    `unet_config`: a UNet's diffusers config, for sgm-named (sd-scripts SDXL) layers. The caller has refused
    unsupported kinds first (refuse_unsupported_kinds). Raises ADAPTER_SHAPE_MISMATCH naming the first layers that
    name no layer of the model.
    """
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state_dict.items():
        layer, name = _split_key(key)
        grouped.setdefault(layer, {})[name] = tensor
    layers, unresolved = [], []
    for layer, tensors in sorted(grouped.items()):
        component, flat = _component_of(layer, prefixes)
        module = model.by_flat_name(component, flat)
        if module is None and unet_config is not None:
            mapped = sgm_to_diffusers(flat, unet_config)
            module = model.by_flat_name(component, mapped) if mapped is not None else None
        if module is None:
            unresolved.append(layer)
            continue
        layers.append(FileLayer(component, module, layer, tensors))
    if unresolved:
        raise AdapterFormatError(
            f"{len(unresolved)} layer(s) of the adapter name no layer of this model "
            f"(e.g. {shorten(', '.join(shorten(name, 100) for name in unresolved[:3]))}); "
            "it was made for another model or architecture",
            reason=ErrorReason.ADAPTER_SHAPE_MISMATCH,
        )
    return layers


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
