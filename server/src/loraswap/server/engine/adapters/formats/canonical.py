"""The one swap-ready form every adapter is converted into, once, before it touches the model.

A canonical adapter holds, for each layer it changes, `a` (rank x in) and `b`
(out x rank) in the model's dtype with alpha/rank (and any per-layer alpha)
already multiplied into `b`. The live swap slot is max-rank wide on every
targeted layer; a canonical adapter is stored at its own rank and the slot
gates off the ranks beyond it, so a swap is only in-place copies: no key
conversion, no config, no scale bookkeeping. Both factors are checked finite
in the model's dtype, and `b` finite at every allowed strength, which is what
makes the slot's gating exact.

Some adapters cannot live in the slot but can be fused (merged into the base
weights, adapters/residency/fused.py) when the server fuses (`SlotSpec.fuse`): DoRA
adapters (their per-row `magnitude`), LoRAs that train lora_B's bias (`bias`,
alpha/rank baked in like `b`) and ranks above the slot's max rank. Every other
change is a `LayerChange` (weight_changes.py) in `changes`, keyed by component
and module: LyCORIS kinds (LoHa, LoKr, LoCon with Tucker cores, full
differences, DoRA), denoiser layers the slot does not cover (convs,
`time_emb_proj`, embeddings) and text-encoder layers. Denoiser changes are only
ever fused; text-encoder changes are merged into the text encoders whichever
way the denoiser's part is applied. Adapters only a fused swap can apply are
marked `fits_slot=False`; under --fuse never they are refused as before.

Reading: kohya-style files (sd-scripts and LyCORIS names with the family's
`kohya_prefixes`) are resolved against the model's own module paths
(key_layouts.py) and read kind by kind (lycoris_layers.py); every other layout
goes through diffusers' own `lora_state_dict` converters (A1111, ComfyUI,
xlabs, ComfyUI-prefixed Flux, ... to diffusers keys) and the same alpha rules as
`load_lora_adapter`, so such an adapter means exactly what diffusers makes of it.
The file itself is read by safetensors_file.py and its LoraConfig checked by
lora_config.py, both as untrusted input.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from loraswap.server.engine.adapters.formats.change_effects import (
    formed_on_the_way,
    layer_effect,
    refuse_out_of_range,
    slot_effect,
)
from loraswap.server.engine.adapters.formats.change_kinds import LowRank
from loraswap.server.engine.adapters.formats.key_layouts import (
    FileLayer,
    file_layers,
    holds_lycoris_kinds,
    kohya_style_keys,
    refuse_unsupported_kinds,
)
from loraswap.server.engine.adapters.formats.lora_config import layer_scalings
from loraswap.server.engine.adapters.formats.lycoris_layers import ReadLayer, read_layers
from loraswap.server.engine.adapters.formats.model_layers import ModelLayers
from loraswap.server.engine.adapters.formats.original_names import original_layer
from loraswap.server.engine.adapters.formats.weight_changes import LayerChange, held_bytes
from loraswap.server.engine.adapters.sources import AdapterFile, BaseModelPolicy, read_adapter_file
from loraswap.server.engine.errors import AdapterFormatError, AdapterIncompatibleError, ErrorReason, shorten
from loraswap.server.engine.families import FAMILIES
from loraswap.server.engine.scale_limits import MAX_ADAPTER_SCALE
from loraswap.server.engine.types import ModelFamily

# CanonicalAdapter.content_key digests this many values from each end of every tensor.
CONTENT_KEY_VALUES = 64


def _change_numbers(change: LayerChange) -> str:
    """The numbers of a layer's change that are not tensors: its kind, scale, rows (a stacked layer's), DoRA ε."""
    kind = change.change
    inner = getattr(kind, "of", kind)
    return f"{change.kind}|{getattr(inner, 'scale', None)!r}|{getattr(kind, 'rows', None)!r}|{change.dora_eps!r}"


@dataclass(frozen=True)
class SlotSpec:
    """What the resident swap slot accepts: its layers' shapes, max rank, dtype and device."""

    family: ModelFamily
    layer_shapes: dict[str, tuple[int, int]]  # module name -> (in_features, out_features)
    max_rank: int
    dtype: torch.dtype
    device: torch.device
    denoiser_config: Mapping  # the denoiser's diffusers config (attribute access needed by converters)
    strict: bool = False
    # The server fuses adapters (--fuse auto|always, weights not int8 weight-only): those the slot cannot hold are
    # accepted to be served fused.
    fuse: bool = False
    biased_layers: frozenset[str] = frozenset()  # slot layers whose base layer has a bias (lora_B.bias fuses there)
    # Every layer of the denoiser and the text encoders a merge can reach (what file layers resolve against).
    model_layers: ModelLayers = field(default_factory=lambda: ModelLayers({}))
    # --text-encoder-layers: "apply" (merged into the text encoders) or "ignore" (dropped with a warning).
    text_encoder_layers: str = "apply"

    @property
    def denoiser(self) -> str:
        """The pipeline attribute of the denoiser: the component of the slot's layers."""
        return FAMILIES[self.family].denoiser_attribute

    @property
    def pin_memory(self) -> bool:
        # Pinned host memory lets the copy into the CUDA slot run asynchronously.
        return self.device.type == "cuda"


@dataclass(frozen=True)
class CanonicalLayer:
    """One layer's LoRA factors: a (rank x in) and b (out x rank), alpha baked into b.

    Fused only: `magnitude` (out,), a DoRA adapter's per-row magnitude; `bias` (out,), a trained lora_B bias
    with alpha baked in.
    """

    a: torch.Tensor
    b: torch.Tensor
    magnitude: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class CanonicalAdapter:
    """An adapter in swap-ready form."""

    name: str
    source: str
    layers: dict[str, CanonicalLayer]  # the denoiser's plain LoRA (and PEFT DoRA, bias) layers on slot layers
    warnings: tuple[str, ...]
    load_ms: float
    # False for an adapter only a fused swap can apply (DoRA, a trained bias, a rank above the slot's, any change
    # of the denoiser in `changes`).
    fits_slot: bool = True
    # (component, module) -> every other change: other kinds, other denoiser layers, text-encoder layers.
    changes: Mapping[tuple[str, str], LayerChange] = field(default_factory=dict)
    # (component, module) -> how far the adapter moves that layer at strength 1, its largest |ΔW| (change_effects.py):
    # what admitted it, and what a request's strengths and a merge's overflow bound are checked against.
    effects: Mapping[tuple[str, str], float] = field(default_factory=dict)
    # A URL adapter's fetch (AdapterFile's): its milliseconds before load_ms, and the body bytes that came.
    download_ms: float = 0.0
    download_bytes: int = 0
    # Scratch space for the swap slot (the views it copies from, built on the first swap), so that it
    # lives and dies with the adapter. Not part of the adapter's identity.
    swap_cache: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def rank(self) -> int:
        """The highest rank of any layer (0 for changes of no rank: full differences, whole LoKr factors)."""
        ranks = [layer.rank for layer in self.layers.values()] + [change.rank for change in self.changes.values()]
        return max(ranks, default=0)

    @property
    def nbytes(self) -> int:
        """The bytes the adapter holds (the parts of a stacked layer share their tensors: counted once)."""
        return held_bytes(
            [tensor for layer in self.layers.values() for tensor in (layer.a, layer.b, layer.magnitude, layer.bias)
             if tensor is not None]
            + [tensor for change in self.changes.values() for tensor in change.tensors]
        )  # fmt: skip

    @property
    def kinds(self) -> tuple[str, ...]:
        """The kinds of change the adapter makes (lora, dora, lora+dora, loha, lokr, full, bias, ...), sorted."""
        kinds = {"dora" if layer.magnitude is not None else "lora" for layer in self.layers.values()}
        return tuple(sorted(kinds | {change.kind for change in self.changes.values()}))

    @functools.cached_property
    def content_key(self) -> str:
        """A digest of the adapter's layers: their names, shapes and dtypes, and each tensor's first and last
        values. What a stack's members are ordered by (residency.stack_order), so the names an adapter is reached
        by never change a stack's image; computed on first use."""
        digest = hashlib.sha256()
        parts = [
            (f"slot:{name}", (layer.a, layer.b, layer.magnitude, layer.bias)) for name, layer in self.layers.items()
        ]
        # A change's plain numbers (its alpha / rank, the weight decomposition's epsilon, a stacked layer's rows)
        # are part of it as much as its tensors.
        parts += [
            (f"{key[0]}:{key[1]}:{_change_numbers(change)}", change.tensors) for key, change in self.changes.items()
        ]
        for label, tensors in sorted(parts, key=lambda part: part[0]):
            digest.update(label.encode())
            for tensor in tensors:
                if tensor is None:
                    continue
                flat = tensor.detach().reshape(-1)
                digest.update(f"{tuple(tensor.shape)}{tensor.dtype}".encode())
                for values in (flat[:CONTENT_KEY_VALUES], flat[-CONTENT_KEY_VALUES:]):
                    digest.update(values.cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()

    @functools.cached_property
    def changed_components(self) -> frozenset[str]:
        """The components `changes` changes (the slot layers' component only when it has changes beyond them)."""
        return frozenset(component for component, _ in self.changes)

    def layers_per_component(self, denoiser: str) -> dict[str, int]:
        """How many layers the adapter changes in each component (`denoiser`: the slot layers' component)."""
        counts = {denoiser: len(self.layers)} if self.layers else {}
        for component, _ in self.changes:
            counts[component] = counts.get(component, 0) + 1
        return dict(sorted(counts.items()))

    def changes_in(self, components: frozenset[str] | set[str]) -> dict[tuple[str, str], LayerChange]:
        """The changes of these components."""
        return {key: change for key, change in self.changes.items() if key[0] in components}


StackMember = tuple[CanonicalAdapter, float]  # an adapter and the strength it is applied at


def _check_tensors(state_dict: dict[str, torch.Tensor]) -> None:
    """Refuse degenerate tensors before any converter divides by a rank or indexes a shape."""
    for key, tensor in state_dict.items():
        if tensor.ndim == 0 and not key.endswith("alpha"):
            raise AdapterFormatError(
                f"tensor {shorten(key)} is a 0-dimensional scalar; LoRA factors are matrices (rank x in, out x rank) "
                "and only alpha values may be scalars",
                reason=ErrorReason.ADAPTER_SHAPE_MISMATCH,
            )
        if tensor.numel() == 0:
            raise AdapterFormatError(
                f"tensor {shorten(key)} is empty (shape {tuple(tensor.shape)}); every LoRA factor needs a rank of at "
                "least 1",
                reason=ErrorReason.ADAPTER_SHAPE_MISMATCH,
            )


def _to_diffusers_keys(
    state_dict: dict[str, torch.Tensor], spec: SlotSpec
) -> tuple[dict[str, torch.Tensor], dict[str, float] | None]:
    """Run diffusers' format converters (kohya, A1111, xlabs, ...) for the family."""
    try:
        converted, alphas = FAMILIES[spec.family].lora_state_dict(state_dict, spec.denoiser_config)
    # The converters are pure functions of untrusted tensors and signal layouts they do not know in every way
    # (asserts, attribute errors, divisions by zero): any failure means the same, no layout they read.
    except Exception as exc:
        raise AdapterFormatError(
            f"the adapter's keys are in no layout diffusers can read for {spec.family.value} ({converter_said(exc)})"
        ) from exc
    return converted, alphas


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


def _check_dtype(key: str, tensor: torch.Tensor) -> None:
    if not tensor.is_floating_point():
        raise AdapterFormatError(
            f"tensor {shorten(key)} has dtype {tensor.dtype}; LoRA weights must be floating point",
            reason=ErrorReason.ADAPTER_BAD_DTYPE,
        )


def _refuse_non_finite(key: str, raw: torch.Tensor, converted: torch.Tensor) -> None:
    """Raise the error that says why `converted` (the model-dtype form of `raw`) has a non-finite value."""
    if not torch.isfinite(raw).all():
        raise AdapterFormatError(
            f"tensor {shorten(key)} holds NaN or infinite values", reason=ErrorReason.ADAPTER_NOT_FINITE
        )
    raise AdapterFormatError(
        f"tensor {shorten(key)} has values too large for the model's dtype "
        f"{str(converted.dtype).removeprefix('torch.')} (after multiplying lora_B by alpha/rank)",
        reason=ErrorReason.ADAPTER_OUT_OF_RANGE,
    )


def _check_a(key: str, raw: torch.Tensor, a: torch.Tensor) -> None:
    # One reduction instead of an element-wise pass: any NaN or inf makes the sum non-finite.
    # A finite tensor whose sum overflows only costs the exact check below.
    if not math.isfinite(float(a.sum())) and not torch.isfinite(a).all():
        _refuse_non_finite(key, raw, a)


def _check_b(key: str, raw: torch.Tensor, b: torch.Tensor) -> None:
    """lora_B must stay finite at every allowed strength: the slot relies on that (see slot.py)."""
    low, high = torch.aminmax(b)  # one pass; NaN propagates, inf shows up in low or high
    largest = max(-float(low), float(high))
    if not math.isfinite(largest):
        _refuse_non_finite(key, raw, b)
    limit = torch.finfo(b.dtype).max / MAX_ADAPTER_SCALE
    if largest > limit:
        raise AdapterFormatError(
            f"tensor {shorten(key)} has values up to {largest:.3g}; at the largest strength ({MAX_ADAPTER_SCALE}) "
            f"they would overflow the model's dtype {str(b.dtype).removeprefix('torch.')}, so values must stay within {limit:.3g}",
            reason=ErrorReason.ADAPTER_OUT_OF_RANGE,
        )


# What a layer's DoRA magnitude and trained lora_B bias are called in a diffusers-format state dict.
MAGNITUDE_SUFFIX = ".lora_magnitude_vector"
BIAS_SUFFIX = ".lora_B.bias"


def _fused_only_tensor(key: str, spec: SlotSpec) -> bool:
    """Whether `key` is a tensor a fused swap applies (a slot layer's DoRA magnitude, a lora_B bias where the slot
    layer has a bias)."""
    if not spec.fuse:
        return False
    if key.endswith((MAGNITUDE_SUFFIX, MAGNITUDE_SUFFIX + ".weight")):
        return _module_of(key) in spec.layer_shapes
    return key.endswith(BIAS_SUFFIX) and key.removesuffix(BIAS_SUFFIX) in spec.biased_layers


def _module_of(key: str) -> str:
    for suffix in (MAGNITUDE_SUFFIX + ".weight", MAGNITUDE_SUFFIX, BIAS_SUFFIX):
        if key.endswith(suffix):
            return key.removesuffix(suffix)
    return key


def _check_layers(state_dict: dict[str, torch.Tensor], spec: SlotSpec) -> None:
    """Plain LoRA factors only (and, when the server fuses, DoRA magnitudes and lora_B biases of slot layers),
    on slot layers unless the server fuses, checked before alpha patterns are matched against module names."""
    if not spec.fuse and any("lora_magnitude_vector" in key for key in state_dict):
        raise AdapterIncompatibleError("DoRA adapters cannot be swapped in place; use a plain LoRA")
    unexpected = sorted(
        key
        for key in state_dict
        if not key.endswith((".lora_A.weight", ".lora_B.weight")) and not _fused_only_tensor(key, spec)
    )
    if unexpected:
        raise AdapterFormatError(
            f"the adapter has tensors that are not plain LoRA factors "
            f"({shorten(', '.join(shorten(key, 80) for key in unexpected[:5]))}); "
            "LoRA biases and DoRA magnitudes are merged only on the swap slot's layers (and only when the server "
            "fuses), and trained base weights never",
            reason=ErrorReason.ADAPTER_UNSUPPORTED_TENSORS,
        )
    modules = {key.removesuffix(".lora_A.weight") for key in state_dict if key.endswith(".lora_A.weight")}
    orphans = sorted(key for key in state_dict if _fused_only_tensor(key, spec) and _module_of(key) not in modules)
    if orphans:
        raise AdapterFormatError(
            f"tensor {shorten(orphans[0])} belongs to a layer without LoRA factors; the file is incomplete"
        )
    if not spec.fuse:
        _refuse_outside_slot(sorted(module for module in modules if module not in spec.layer_shapes))
    _check_tensors(state_dict)  # the converters' output too: a rank-0 factor must not reach alpha / rank


def _refuse_outside_slot(outside: list[str]) -> None:
    if outside:
        raise AdapterIncompatibleError(
            f"the adapter changes {len(outside)} layer(s) the server's swap slot does not cover "
            f"(e.g. {shorten(', '.join(shorten(module, 80) for module in outside[:3]))}); restart the server with "
            "--target-modules covering them or with --fuse auto|always (fused swaps reach every layer), or use an "
            "adapter for this model",
            reason=ErrorReason.ADAPTER_LAYER_NOT_TARGETED,
            layers=len(outside),
        )


def _slot_layer(
    module: str, a: torch.Tensor, b: torch.Tensor, scaling: float, spec: SlotSpec, names: tuple[str, str]
) -> CanonicalLayer:
    """One slot layer's factors in canonical form: checked, in the model's dtype, scaling baked into b."""
    a_key, b_key = names
    _check_dtype(a_key, a)
    _check_dtype(b_key, b)
    in_features, out_features = spec.layer_shapes[module]
    rank = a.shape[0]
    if a.ndim != 2 or b.ndim != 2 or b.shape[1] != rank:
        raise AdapterFormatError(
            f"layer {module} has LoRA factors of shapes {tuple(a.shape)} and {tuple(b.shape)}; "
            "expected (rank, in) and (out, rank) for a linear layer",
            reason=ErrorReason.ADAPTER_SHAPE_MISMATCH,
        )
    if rank > spec.max_rank and not spec.fuse:
        raise AdapterIncompatibleError(
            f"layer {module} has rank {rank}, above the server's max rank {spec.max_rank}; "
            f"restart with --max-rank {rank} or use a lower-rank adapter",
            reason=ErrorReason.ADAPTER_RANK_TOO_HIGH,
            rank=rank,
            max_rank=spec.max_rank,
        )
    if a.shape[1] != in_features or b.shape[0] != out_features:
        raise AdapterFormatError(
            f"layer {module} expects LoRA factors for a {in_features}->{out_features} layer but the adapter has "
            f"{a.shape[1]}->{b.shape[0]}; this adapter was made for a different model",
            reason=ErrorReason.ADAPTER_SHAPE_MISMATCH,
        )
    if scaling == 1.0:
        baked_b = b.to(spec.dtype)
    else:  # bake in float32 so the product rounds once, to the model's dtype
        baked_b = (b.to(torch.float32) * scaling).to(spec.dtype)
    converted_a = a.to(spec.dtype)
    _check_a(a_key, a, converted_a)
    _check_b(b_key, b, baked_b)
    a = converted_a.contiguous()
    baked_b = baked_b.contiguous()
    if baked_b.data_ptr() % 16:
        # Tensors read straight from a safetensors file can start anywhere; the slot copies
        # lora_B as 16-byte elements only from 16-byte-aligned memory, which a fresh tensor is.
        baked_b = baked_b.clone()
    if spec.pin_memory:
        # Last, so that nothing above copies the factors back into pageable memory (a fresh pinned
        # block is aligned and contiguous like its source).
        a, baked_b = a.pin_memory(), baked_b.pin_memory()
    return CanonicalLayer(a=a, b=baked_b)


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
        layer = _slot_layer(module, state_dict[a_key], state_dict[b_key], scaling, spec, (a_key, b_key))
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
        _refuse_outside_slot(unknown)  # as without fusing: no layer a swap reaches
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
    _check_dtype(key, raw)
    _, out_features = spec.layer_shapes[module]
    if raw.numel() != out_features:
        raise AdapterFormatError(
            f"tensor {shorten(key)} has shape {tuple(raw.shape)}; expected one value per output ({out_features}) "
            "of the layer",
            reason=ErrorReason.ADAPTER_SHAPE_MISMATCH,
        )
    vector = (raw.reshape(-1).to(torch.float32) * scaling).to(spec.dtype).contiguous()
    if not torch.isfinite(vector).all():
        _refuse_non_finite(key, raw, vector)
    return vector.pin_memory() if spec.pin_memory else vector


def _fits_slot(layers: dict[str, CanonicalLayer], changes: Mapping, spec: SlotSpec) -> bool:
    """Whether the slot can hold the adapter's denoiser part: plain factors of slot layers, no rank above its max
    rank (text-encoder changes are merged whichever way the denoiser's part is applied)."""
    if any(component == spec.denoiser for component, _ in changes):
        return False
    return all(
        layer.rank <= spec.max_rank and layer.magnitude is None and layer.bias is None for layer in layers.values()
    )


@dataclass
class _ReadAdapter:
    """What a file's layout reader made of it, before the server's settings decide what is kept."""

    layers: dict[str, CanonicalLayer]
    changes: dict[tuple[str, str], LayerChange]
    warnings: list[str] = field(default_factory=list)

    def joined(self, other: _ReadAdapter | None) -> _ReadAdapter:
        """This and another part of the same file (None: nothing more); a layer in both is refused."""
        if other is None:
            return self
        twice = sorted(self.layers.keys() & other.layers.keys()) + sorted(
            module for _, module in self.changes.keys() & other.changes.keys()
        )
        if twice:
            raise AdapterFormatError(
                f"layer {shorten(twice[0])} is in the file twice, under two naming layouts; keep one",
            )
        return _ReadAdapter({**self.layers, **other.layers}, {**self.changes, **other.changes},
                            self.warnings + other.warnings)  # fmt: skip


def _read_diffusers_layout(raw: dict[str, torch.Tensor], metadata: dict | None, spec: SlotSpec) -> _ReadAdapter:
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
    read = _ReadAdapter(layers={}, changes={})
    for component, own in by_component.items():
        if "lora_A" not in next(iter(own)):
            from diffusers.utils import convert_unet_state_dict_to_peft

            own = convert_unet_state_dict_to_peft(own)
        _check_factor_pairs(own, component)
        if component == spec.denoiser:
            _check_layers(own, spec)
            scalings = layer_scalings(own, alphas, metadata, component, dora=spec.fuse)
            read.layers = _canonical_layers(own, scalings, spec)
        else:
            _check_text_encoder_tensors(own, component)
            _check_tensors(own)
            scalings = layer_scalings(own, alphas, metadata, component)
        read.changes |= _low_rank_changes(own, scalings, component, spec)
    return read


# What diffusers' converters end in for a file whose layout they do not read.
LAYOUT_REASONS = frozenset({ErrorReason.ADAPTER_MALFORMED, ErrorReason.ADAPTER_NO_DENOISER_LAYERS,
                            ErrorReason.ADAPTER_UNSUPPORTED_TENSORS})  # fmt: skip


def _read_other_layout(raw: dict[str, torch.Tensor], metadata: dict | None, spec: SlotSpec) -> _ReadAdapter:
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


def _check_text_encoder_tensors(state_dict: dict[str, torch.Tensor], component: str) -> None:
    unexpected = sorted(key for key in state_dict if not key.endswith((".lora_A.weight", ".lora_B.weight")))
    if unexpected:
        raise AdapterFormatError(
            f"the adapter's {component} layers have tensors that are not plain LoRA factors "
            f"({shorten(', '.join(shorten(key, 80) for key in unexpected[:5]))})",
            reason=ErrorReason.ADAPTER_UNSUPPORTED_TENSORS,
        )


def _read_kohya_layout(raw: dict[str, torch.Tensor], spec: SlotSpec) -> _ReadAdapter:
    """A kohya-style file (sd-scripts, LyCORIS), every kind, resolved against the model's own layers: plain LoRAs
    of slot layers go to the slot, the rest are changes."""
    layers = file_layers(
        raw, FAMILIES[spec.family].kohya_prefixes, spec.model_layers,
        lambda flat: original_layer(spec.family, flat, spec.denoiser_config),
    )  # fmt: skip
    read = _ReadAdapter(layers={}, changes={})
    for layer in read_layers(layers, spec.model_layers, pin_memory=spec.pin_memory):
        if (low_rank := _slot_lora(layer, spec)) is not None:
            read.layers[layer.module] = _slot_layer(
                layer.module, low_rank.down, low_rank.up, low_rank.scale, spec,
                (f"{layer.module} lora_down", f"{layer.module} lora_up"),
            )  # fmt: skip
        else:
            read.changes[layer.component, layer.module] = layer.change
    return read


def _slot_lora(layer: ReadLayer, spec: SlotSpec) -> LowRank | None:
    """The layer's LoRA factors when the slot can take them: a plain LoRA of a slot layer, stored as a matrix."""
    low_rank = layer.plain_lora
    if layer.component != spec.denoiser or layer.module not in spec.layer_shapes or low_rank is None:
        return None
    return low_rank if low_rank.down.ndim == 2 and low_rank.up.ndim == 2 else None


def _changes_of(read: _ReadAdapter, component: str) -> dict[tuple[str, str], LayerChange]:
    return {key: change for key, change in read.changes.items() if key[0] == component}


def _admit(read: _ReadAdapter, spec: SlotSpec) -> None:
    """Apply the server's settings to what was read: text-encoder layers kept or dropped (--text-encoder-layers,
    --strict-adapters), denoiser changes refused unless the server fuses."""
    encoders = {component for component, _ in read.changes if component != spec.denoiser}
    if encoders and spec.text_encoder_layers == "ignore":
        dropped = Counter(component for component, _ in read.changes if component in encoders)
        message = (
            f"dropped layers for {', '.join(f'{c} ({n} layers)' for c, n in sorted(dropped.items()))}: "
            "text-encoder layers are ignored (--text-encoder-layers ignore)"
        )
        if spec.strict:
            raise AdapterIncompatibleError(
                message.replace("are ignored", "are refused under --strict-adapters"),
                reason=ErrorReason.ADAPTER_TEXT_ENCODER_LAYERS,
            )
        read.warnings.append(message)
        read.changes = _changes_of(read, spec.denoiser)
    denoiser_changes = {module: change for (_, module), change in _changes_of(read, spec.denoiser).items()}
    if denoiser_changes and not spec.fuse:
        plain = sorted(module for module, change in denoiser_changes.items() if change.kind == "lora")
        others = sorted({change.kind for change in denoiser_changes.values()} - {"lora"})
        if others:
            raise AdapterIncompatibleError(
                f"the adapter makes {', '.join(others)} changes ({len(denoiser_changes)} layers), which only a fused "
                "swap applies; this server does not fuse (--fuse never, or --quantize int8wo): restart it with "
                "--fuse auto|always and --quantize none or fp8, or use a plain LoRA",
                kinds=",".join(others),
            )
        _refuse_outside_slot(plain)
    if not read.layers and not read.changes:
        raise AdapterFormatError(
            f"the adapter changes no layer this server applies (the {spec.denoiser}'s, or the text encoders' with "
            "--text-encoder-layers apply); it is not an adapter for this model",
            reason=ErrorReason.ADAPTER_NO_DENOISER_LAYERS,
        )


def _effects(read: _ReadAdapter, spec: SlotSpec) -> dict[tuple[str, str], float]:
    """How far the adapter moves each layer at strength 1 (change_effects.py)."""
    effects = {
        (spec.denoiser, module): slot_effect(layer.a, layer.b, layer.magnitude, layer.bias, spec.dtype)
        for module, layer in read.layers.items()
    }
    for (component, module), change in read.changes.items():
        shape = spec.model_layers.shape(component, module)
        effects[component, module] = layer_effect(change, shape.weight, spec.dtype)
    return effects


def load_canonical(
    adapter_file: AdapterFile, spec: SlotSpec, base_models: BaseModelPolicy | None = None
) -> CanonicalAdapter:
    """Read, convert and validate an adapter file into its canonical form; touches no model.

    With `base_models`, an adapter declaring another base is refused first, from its header and card alone.
    """
    started = time.perf_counter()
    if base_models is not None:
        base_models.check(adapter_file)
    raw, metadata = read_adapter_file(adapter_file)
    if not raw:
        raise AdapterFormatError(f"adapter {shorten(adapter_file.name)!r} holds no tensors")
    kohya_keys = kohya_style_keys(raw, FAMILIES[spec.family].kohya_prefixes)
    refuse_unsupported_kinds({key: raw[key] for key in kohya_keys})  # first: a kind's own tensors may be scalars
    _check_tensors(raw)
    read = _read_kohya_layout({key: raw[key] for key in kohya_keys}, spec) if kohya_keys else None
    others = {key: value for key, value in raw.items() if key not in kohya_keys}
    if others:  # another layout
        read = _read_other_layout(others, metadata, spec).joined(read)
    _admit(read, spec)
    effects = _effects(read, spec)
    on_the_way = {key: formed_on_the_way(change) for key, change in read.changes.items()}
    refuse_out_of_range(effects, spec.dtype, on_the_way)
    return CanonicalAdapter(
        name=adapter_file.name,
        source=adapter_file.source,
        layers=read.layers,
        warnings=tuple(read.warnings),
        load_ms=(time.perf_counter() - started) * 1000.0,
        fits_slot=_fits_slot(read.layers, read.changes, spec),
        changes=read.changes,
        effects=effects,
        download_ms=adapter_file.download_ms,
        download_bytes=adapter_file.download_bytes,
    )
