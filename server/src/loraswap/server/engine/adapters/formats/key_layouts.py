"""Where the layers of a kohya-style file are: its layer names turned into the model's module paths, per component.

kohya's sd-scripts and the LyCORIS package (its kohya network and its own wrapper) name each layer
`<prefix>_<module path, '.' written '_'>` and its tensors `<layer>.<tensor>`: `lora_unet_down_blocks_1_attentions_0_
transformer_blocks_0_attn1_to_q.lora_up.weight`, `lora_te1_text_model_encoder_layers_0_self_attn_q_proj.hada_w1_a`.
The prefix names the component (the family's `kohya_prefixes`); the rest is resolved against the component's real
module paths (model_layers.py), so underscores inside names (`to_q`, `conv_shortcut`) are never guessed at.

Names of the original models sd-scripts and others train on (sgm SDXL, BFL Flux and FLUX.2, Z-Image's) are resolved
by original_names.py; an original layer that stacks several diffusers layers by rows (qkv) becomes one FileLayer
with a part per layer.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from loraswap.server.engine.adapters.formats.change_kinds import Rows
from loraswap.server.engine.adapters.formats.model_layers import LayerShape, ModelLayers
from loraswap.server.engine.adapters.formats.original_names import OriginalLayer
from loraswap.server.engine.errors import AdapterFormatError, ErrorReason, shorten

# The tensors of one layer a kind this server merges may have (change_kinds.py).
LAYER_TENSORS = frozenset({
    "lora_up.weight", "lora_down.weight", "lora_mid.weight",
    "hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2",
    "lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2",
    "diff", "diff_b", "alpha", "dora_scale",
})  # fmt: skip
# What the tensors of the LyCORIS kinds this server does not merge are called, and the kind's name.
UNSUPPORTED_KIND_TENSORS = {
    "oft_blocks": "OFT (orthogonal fine-tuning)",  # BOFT's are 4-dimensional: _unsupported_kind tells them apart
    "oft_diag": "OFT (orthogonal fine-tuning)",
    "rescale": "OFT or BOFT (orthogonal fine-tuning) rescaling",
    "on_input": "IA³",
    "weight": "IA³",
    "a1.weight": "GLoRA", "a2.weight": "GLoRA", "b1.weight": "GLoRA", "b2.weight": "GLoRA", "bm.weight": "GLoRA",
    "w_norm": "norm layers", "b_norm": "norm layers",
    "lambda_layer": "T-LoRA", "q_layer.weight": "T-LoRA", "p_layer.weight": "T-LoRA",
    "lokr_t1": "LoKr with a Tucker core on w1",
}  # fmt: skip
BOFT = "BOFT (butterfly orthogonal fine-tuning)"
# A kohya-style layer name: a module path with "_" for "." (module names keep their "-": Z-Image's "all_x_embedder.2-1")
LAYER_NAME = re.compile(r"[A-Za-z0-9_-]+")


def _unsupported_kind(name: str, tensor: torch.Tensor) -> str:
    """The label of the refused kind a tensor belongs to: LyCORIS's OFT and BOFT share the name `oft_blocks`, BOFT's
    with a leading axis of butterfly stages (m, blocks, size, size), diag-OFT's without (blocks, size, size)."""
    if name == "oft_blocks" and tensor.dim() == 4:
        return BOFT
    return UNSUPPORTED_KIND_TENSORS[name]


@dataclass(frozen=True)
class LayerPart:
    """One model layer of a file layer that stacks several: its module path and its rows of the stack."""

    module: str
    rows: Rows


@dataclass(frozen=True)
class FileLayer:
    """One layer of a kohya-style file: the component and module path it changes, and its tensors by name.

    A layer the file stores stacked (BFL Flux's qkv) has `parts`, the model layers it is cut into; its `module`
    then names them all, for messages.
    """

    component: str
    module: str
    name: str  # as the file spells it
    tensors: dict[str, torch.Tensor]
    parts: tuple[LayerPart, ...] = ()

    def stacked_shape(self, model: ModelLayers) -> LayerShape:
        """The weight shape of the stack of `parts` (their rows one after another) and whether each has a bias."""
        shapes = [model.shape(self.component, part.module) for part in self.parts]
        rows = sum(stop - start for part in self.parts for start, stop in part.rows)
        return LayerShape((rows, *shapes[0].weight[1:]), all(shape.has_bias for shape in shapes))


def _split_key(key: str) -> tuple[str, str] | None:
    layer, _, tensor = key.partition(".")
    return (layer, tensor) if tensor and LAYER_NAME.fullmatch(layer) else None


def _component_of(layer: str, prefixes: Mapping[str, str]) -> tuple[str, str] | None:
    """(component, the name after its prefix), the longest prefix first (`lora_te1_` before `lora_te_`)."""
    for prefix in sorted(prefixes, key=len, reverse=True):
        if layer.startswith(prefix + "_"):
            return prefixes[prefix], layer[len(prefix) + 1 :]
    return None


def kohya_style_keys(state_dict: Mapping[str, torch.Tensor], prefixes: Mapping[str, str]) -> set[str]:
    """The keys spelled `<prefix>_<layer>.<tensor>` with one of the family's kohya prefixes."""
    starts = tuple(prefix + "_" for prefix in prefixes)
    return {
        key
        for key in state_dict
        if key.startswith(starts) and (split := _split_key(key)) is not None and _component_of(split[0], prefixes)
    }


# The tensor names only kinds beyond plain LoRA have (LoHa, LoKr, full, DoRA, a Tucker core), and those of the kinds
# this server refuses: what tells a LyCORIS file in any layout.
_LYCORIS_ONLY_TENSORS = tuple(
    "." + name for name in sorted((LAYER_TENSORS | UNSUPPORTED_KIND_TENSORS.keys())
                                  - {"lora_up.weight", "lora_down.weight", "alpha", "weight"})
)  # fmt: skip


def holds_lycoris_kinds(state_dict: Mapping[str, torch.Tensor]) -> bool:
    """Whether any key, in any layout, names a tensor only kinds beyond plain LoRA have (`….hada_w1_a`,
    `….lokr_w1`, `….dora_scale`, `….diff`, …)."""
    return any(key.endswith(_LYCORIS_ONLY_TENSORS) for key in state_dict)


def refuse_unsupported_kinds(state_dict: Mapping[str, torch.Tensor]) -> None:
    """Raise ADAPTER_KIND_UNSUPPORTED, naming the kind and a few of its keys, when a layer holds a kind this server
    does not merge; ADAPTER_UNSUPPORTED_TENSORS for tensors of no known kind."""
    unsupported: dict[str, list[str]] = {}
    unknown = []
    for key in state_dict:
        split = _split_key(key)
        tensor = split[1] if split is not None else key
        if tensor in UNSUPPORTED_KIND_TENSORS:
            unsupported.setdefault(_unsupported_kind(tensor, state_dict[key]), []).append(key)
        elif tensor not in LAYER_TENSORS:
            unknown.append(key)
    if len(unsupported) > 1:  # rescaling says less than the blocks it rescales
        unsupported.pop(UNSUPPORTED_KIND_TENSORS["rescale"], None)
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
    original_layer: Callable[[str], OriginalLayer | None] | None = None,
    spellings: Mapping[str, str] | None = None,
) -> list[FileLayer]:
    """The file's layers with the model's component and module path of each.

    `original_layer`: the family's mapping of the original model's layer names (original_names.py), tried for a
    name that is no module path of the model. `spellings`: how the file spells layers that were renamed to their
    kohya-style names (comfy_names.py), for messages. The caller has refused unsupported kinds first
    (refuse_unsupported_kinds). Raises ADAPTER_SHAPE_MISMATCH naming the first layers that name no layer of the
    model.
    """
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state_dict.items():
        layer, name = _split_key(key)
        grouped.setdefault(layer, {})[name] = tensor
    layers, unresolved = [], []
    for layer, tensors in sorted(grouped.items()):
        component, flat = _component_of(layer, prefixes)
        spelled = spellings.get(layer, layer) if spellings else layer
        module = model.by_flat_name(component, flat)
        if module is not None:
            layers.append(FileLayer(component, module, spelled, tensors))
            continue
        original = original_layer(flat) if original_layer is not None else None
        resolved = _original_layer(component, spelled, tensors, original, model) if original is not None else None
        if resolved is None:
            unresolved.append(spelled)
        else:
            layers.append(resolved)
    if unresolved:
        raise AdapterFormatError(
            f"{len(unresolved)} layer(s) of the adapter name no layer of this model "
            f"(e.g. {shorten(', '.join(shorten(name, 100) for name in unresolved[:3]))}); "
            "it was made for another model or architecture",
            reason=ErrorReason.ADAPTER_SHAPE_MISMATCH,
        )
    return layers


def refuse_layers_twice(layers: list[FileLayer]) -> None:
    """Refuse (ADAPTER_MALFORMED) file layers that change the same model layer: under two names (a fused original
    layer and one of its parts, or one layer in two spellings), one would be dropped unseen."""
    seen: dict[tuple[str, str], str] = {}
    for layer in layers:
        for module in [part.module for part in layer.parts] or [layer.module]:
            other = seen.setdefault((layer.component, module), layer.name)
            if other != layer.name:
                raise AdapterFormatError(
                    f"layer {shorten(module)} is in the file twice, as {shorten(other)} and {shorten(layer.name)}; "
                    "keep one",
                )


def _original_layer(
    component: str, name: str, tensors: dict[str, torch.Tensor], original: OriginalLayer, model: ModelLayers
) -> FileLayer | None:
    """The FileLayer of an original-named layer: whole when it is one model layer, else cut into parts by rows."""
    modules = [model.by_flat_name(component, target) for target in original.targets]
    if any(module is None for module in modules):
        return None
    if len(modules) == 1 and not original.swap_halves:
        return FileLayer(component, modules[0], name, tensors)
    if original.swap_halves:
        rows = model.shape(component, modules[0]).out_features
        parts = (LayerPart(modules[0], ((rows // 2, rows), (0, rows // 2))),)
    else:
        parts, start = [], 0
        for module in modules:
            stop = start + model.shape(component, module).out_features
            parts.append(LayerPart(module, ((start, stop),)))
            start = stop
    return FileLayer(component, ", ".join(modules), name, tensors, tuple(parts))
