"""The diffusers/PEFT-layout reader: a file in any layout diffusers' converters read, read as diffusers means it.

Its keys go through diffusers' own `lora_state_dict` converters (A1111, ComfyUI, xlabs, ComfyUI-prefixed Flux, ...
to diffusers keys; for the newer families after the normalisations their converters miss, diffusers_keys.py), are
split by component (the denoiser and the family's text encoders) and get the same alpha rules as
`load_lora_adapter` (lora_config.py). The denoiser's slot layers become canonical layers by the admission rules
(admission.py), with their DoRA magnitudes and lora_B biases when the server fuses; every other layer becomes a LoRA
change, checked like any file layer (lycoris_layers.py). A file whose LyCORIS kinds are in a layout only this reader
could try is told the kohya-style names they are read in (kohya_layout.py).
"""

from __future__ import annotations

import dataclasses

import torch

from loraswap.server.engine.adapters.formats.admission import (
    BIAS_SUFFIX,
    MAGNITUDE_SUFFIX,
    ReadAdapter,
    SlotSpec,
    check_layers,
    slot_layer,
)
from loraswap.server.engine.adapters.formats.canonical_adapter import CanonicalLayer
from loraswap.server.engine.adapters.formats.diffusers_keys import normalised_keys, refuse_nothing_converted
from loraswap.server.engine.adapters.formats.key_layouts import FileLayer, holds_lycoris_kinds
from loraswap.server.engine.adapters.formats.lora_config import layer_scalings
from loraswap.server.engine.adapters.formats.lycoris_layers import read_layers
from loraswap.server.engine.adapters.formats.tensor_checks import check_dtype, check_tensors, refuse_non_finite
from loraswap.server.engine.adapters.formats.weight_changes import LayerChange
from loraswap.server.engine.errors import AdapterFormatError, AdapterIncompatibleError, ErrorReason, shorten
from loraswap.server.engine.families import FAMILIES

# What diffusers' converters end in for a file whose layout they do not read.
LAYOUT_REASONS = frozenset({ErrorReason.ADAPTER_MALFORMED, ErrorReason.ADAPTER_NO_DENOISER_LAYERS,
                            ErrorReason.ADAPTER_UNSUPPORTED_TENSORS})  # fmt: skip


def read_other_layout(raw: dict[str, torch.Tensor], metadata: dict | None, spec: SlotSpec) -> ReadAdapter:
    """_read_diffusers_layout, saying so when the file's LyCORIS kinds are in a layout only diffusers could read."""
    try:
        return _read_diffusers_layout(raw, metadata, spec)
    except AdapterFormatError as error:
        if holds_lycoris_kinds(raw) and error.reason in LAYOUT_REASONS:
            raise AdapterFormatError(
                f"{error.message}. The file holds LyCORIS kinds (LoHa, LoKr, full, Tucker or DoRA tensors) in a "
                f"layout this server does not read them in: it reads them in kohya-style names "
                f"(`<prefix>_<module path with '_' for '.'>.<tensor>`) with the prefixes "
                f"{', '.join(prefix + '_' for prefix in sorted(FAMILIES[spec.family].kohya_prefixes))}; a ComfyUI "
                "file's `diffusion_model.` names are `lora_unet_` ones with '_' for '.'",
                reason=ErrorReason.ADAPTER_MALFORMED,
            ) from error
        raise


def _read_diffusers_layout(raw: dict[str, torch.Tensor], metadata: dict | None, spec: SlotSpec) -> ReadAdapter:
    """A file in any layout diffusers' converters read, as diffusers means it."""
    converted, alphas = _to_diffusers_keys(raw, spec)
    by_component, unknown = _split_by_component(converted, spec.denoiser, FAMILIES[spec.family].text_encoders)
    if unknown and not by_component:
        raise AdapterFormatError(
            f"the adapter has layers for {', '.join(unknown)} only, and none for the {spec.denoiser}; it is not a "
            f"LoRA for this {spec.family.value} model",
            reason=ErrorReason.ADAPTER_NO_DENOISER_LAYERS,
        )
    if unknown:
        raise AdapterFormatError(
            f"the adapter has layers for {', '.join(unknown)}, which is no component adapters change in a "
            f"{spec.family.value} pipeline",
            reason=ErrorReason.ADAPTER_UNSUPPORTED_TENSORS,
        )
    read = ReadAdapter(layers={}, changes={})
    for component, own in by_component.items():
        if "lora_A" not in next(iter(own)):
            from diffusers.utils import convert_unet_state_dict_to_peft

            own = convert_unet_state_dict_to_peft(own)
        _check_factor_pairs(own, component)
        if component == spec.denoiser:
            check_layers(own, spec)
            scalings = layer_scalings(own, alphas, metadata, component, dora=spec.fuse)
            read.layers = _canonical_layers(own, scalings, spec)
        else:
            _check_text_encoder_tensors(own, component)
            check_tensors(own)
            scalings = layer_scalings(own, alphas, metadata, component)
        read.changes |= _low_rank_changes(own, scalings, component, spec)
    return read


def _to_diffusers_keys(
    state_dict: dict[str, torch.Tensor], spec: SlotSpec
) -> tuple[dict[str, torch.Tensor], dict[str, float] | None]:
    """Run diffusers' format converters (kohya, A1111, xlabs, ...) for the family, on the keys diffusers_keys.py
    normalises for the newer families."""
    modules = spec.model_layers.shapes.get(spec.denoiser, {})
    state_dict, file_alphas = normalised_keys(state_dict, spec.family, spec.denoiser, modules)
    given = dict(state_dict)  # a converter may consume what it is given
    try:
        converted, alphas = FAMILIES[spec.family].lora_state_dict(state_dict, spec.denoiser_config)
    # The converters are pure functions of untrusted tensors and signal layouts they do not know in every way
    # (asserts, attribute errors, divisions by zero): any failure means the same, no layout they read.
    except Exception as exc:
        raise AdapterFormatError(
            f"the adapter's keys are in no layout diffusers can read for {spec.family.value} ({converter_said(exc)})"
        ) from exc
    refuse_nothing_converted(given, converted, spec.family)
    return converted, alphas if file_alphas is None else {**file_alphas, **(alphas or {})}


def converter_said(exc: Exception) -> str:
    """What a converter's failure tells a caller: diffusers' own words (its ValueErrors name the keys it could not
    place) or the key it missed; never the text of a torch operation that gave up on a tensor's shape."""
    if isinstance(exc, KeyError) and exc.args:
        return f"it looked for a tensor named {shorten(exc.args[0], 120)!r}"
    if type(exc) is ValueError:
        return shorten(exc)
    return f"its conversion failed on the file's tensors ({type(exc).__name__})"


def _split_by_component(
    state_dict: dict[str, torch.Tensor], denoiser: str, text_encoders: tuple[str, ...]
) -> tuple[dict[str, dict[str, torch.Tensor]], list[str]]:
    """The state dict's keys per component (the denoiser's first), and the components that are neither."""
    by_component: dict[str, dict[str, torch.Tensor]] = {}
    unknown: dict[str, int] = {}
    for key, value in state_dict.items():
        component, _, rest = key.partition(".")
        if component == denoiser or component in text_encoders:
            by_component.setdefault(component, {})[rest] = value
        else:
            unknown[component] = unknown.get(component, 0) + 1
    ordered = dict(sorted(by_component.items(), key=lambda item: item[0] != denoiser))
    return ordered, [f"{component} ({count} tensors)" for component, count in sorted(unknown.items())]


def _check_factor_pairs(state_dict: dict[str, torch.Tensor], component: str) -> None:
    """Every layer needs both factors; a lone lora_A or lora_B is a broken file."""
    modules_a = {key.removesuffix(".lora_A.weight") for key in state_dict if key.endswith(".lora_A.weight")}
    modules_b = {key.removesuffix(".lora_B.weight") for key in state_dict if key.endswith(".lora_B.weight")}
    unpaired = sorted(modules_a ^ modules_b)
    if unpaired:
        raise AdapterFormatError(
            f"{len(unpaired)} layer(s) have only one of lora_A/lora_B (e.g. {shorten(unpaired[0])}); "
            "the file is incomplete"
        )
    if not modules_a:
        raise AdapterFormatError(f"the adapter holds no LoRA factor pairs (lora_A/lora_B) for the {component}")


def _canonical_layers(
    state_dict: dict[str, torch.Tensor], scalings: dict[str, float], spec: SlotSpec
) -> dict[str, CanonicalLayer]:
    """The slot layers of a diffusers-keyed state dict, with their DoRA magnitudes and lora_B biases."""
    layers = {}
    for module, scaling in sorted(scalings.items()):
        if module not in spec.layer_shapes:
            continue
        a_key, b_key = f"{module}.lora_A.weight", f"{module}.lora_B.weight"
        if b_key not in state_dict:
            raise AdapterFormatError(f"layer {module} has lora_A but no lora_B")
        layer = slot_layer(module, state_dict[a_key], state_dict[b_key], scaling, spec, (a_key, b_key))
        magnitude = _fused_vector(state_dict, module, (MAGNITUDE_SUFFIX, MAGNITUDE_SUFFIX + ".weight"), 1.0, spec)
        bias = _fused_vector(state_dict, module, (BIAS_SUFFIX,), scaling, spec)
        if magnitude is not None or bias is not None:
            layer = dataclasses.replace(layer, magnitude=magnitude, bias=bias)
        layers[module] = layer
    return layers


def _low_rank_changes(
    state_dict: dict[str, torch.Tensor], scalings: dict[str, float], component: str, spec: SlotSpec
) -> dict[tuple[str, str], LayerChange]:
    """The layers of a diffusers-keyed state dict that are not slot layers, as LoRA changes of `component`: checked
    like any file layer (lycoris_layers.py), against the model's own layer."""
    layers, unknown = [], []
    for module in sorted(scalings):
        if component == spec.denoiser and module in spec.layer_shapes:
            continue
        resolved = spec.model_layers.resolve(component, module)
        if resolved is None:
            unknown.append(module)
            continue
        tensors = {"lora_down.weight": state_dict[f"{module}.lora_A.weight"],
                   "lora_up.weight": state_dict[f"{module}.lora_B.weight"]}  # fmt: skip
        layers.append(FileLayer(component, resolved, module, tensors))
    if unknown and component == spec.denoiser:
        # The reason a layer outside the slot has without fusing, but no restart serves these: the model lacks them.
        raise AdapterIncompatibleError(
            f"the adapter changes {len(unknown)} layer(s) that are no layer of this model's {component} "
            f"(e.g. {shorten(', '.join(shorten(name, 80) for name in unknown[:3]))}): no --target-modules or fused "
            "swap reaches them; it was made for another model, or in a layout this server does not read",
            reason=ErrorReason.ADAPTER_LAYER_NOT_TARGETED,
            layers=len(unknown),
        )
    if unknown:
        raise AdapterFormatError(
            f"{len(unknown)} layer(s) of the adapter are no layer of this model's {component} "
            f"(e.g. {shorten(', '.join(shorten(name, 100) for name in unknown[:3]))}); it was made for another model",
            reason=ErrorReason.ADAPTER_SHAPE_MISMATCH,
        )
    changes = {}
    for layer, read in zip(layers, read_layers(layers, spec.model_layers, pin_memory=spec.pin_memory)):
        low_rank = dataclasses.replace(read.change.change, scale=scalings[layer.name])
        changes[read.component, read.module] = LayerChange(low_rank)
    return changes


def _fused_vector(
    state_dict: dict[str, torch.Tensor], module: str, suffixes: tuple[str, ...], scaling: float, spec: SlotSpec
) -> torch.Tensor | None:
    """A layer's DoRA magnitude or lora_B bias (scaling baked in), checked: one value per output, finite."""
    key = next((module + suffix for suffix in suffixes if module + suffix in state_dict), None)
    if key is None:
        return None
    raw = state_dict[key]
    check_dtype(key, raw)
    _, out_features = spec.layer_shapes[module]
    if raw.numel() != out_features:
        raise AdapterFormatError(
            f"tensor {shorten(key)} has shape {tuple(raw.shape)}; expected one value per output ({out_features}) "
            "of the layer",
            reason=ErrorReason.ADAPTER_SHAPE_MISMATCH,
        )
    vector = (raw.reshape(-1).to(torch.float32) * scaling).to(spec.dtype).contiguous()
    if not torch.isfinite(vector).all():
        refuse_non_finite(key, raw, vector)
    return vector.pin_memory() if spec.pin_memory else vector


def _check_text_encoder_tensors(state_dict: dict[str, torch.Tensor], component: str) -> None:
    unexpected = sorted(key for key in state_dict if not key.endswith((".lora_A.weight", ".lora_B.weight")))
    if unexpected:
        raise AdapterFormatError(
            f"the adapter's {component} layers have tensors that are not plain LoRA factors "
            f"({shorten(', '.join(shorten(key, 80) for key in unexpected[:5]))})",
            reason=ErrorReason.ADAPTER_UNSUPPORTED_TENSORS,
        )
