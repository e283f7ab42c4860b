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
weights, adapters/fused.py) when the server fuses (`SlotSpec.fuse`): DoRA
adapters (their per-row `magnitude`), LoRAs that train lora_B's bias (`bias`,
alpha/rank baked in like `b`) and ranks above the slot's max rank. They are
marked `fits_slot=False`; under --fuse never they are refused as before.

Reading goes through diffusers' own `lora_state_dict` converters (kohya,
A1111, ComfyUI, xlabs, ... to diffusers keys) and the same alpha rules as
`load_lora_adapter`, so an adapter means exactly what diffusers makes of it.
The file itself is read by safetensors_file.py and its LoraConfig checked by
lora_config.py, both as untrusted input.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from loraswap.server.engine.adapters.base_model import BaseModelPolicy
from loraswap.server.engine.adapters.lora_config import layer_scalings
from loraswap.server.engine.adapters.safetensors_file import read_adapter_file
from loraswap.server.engine.adapters.sources import AdapterFile
from loraswap.server.engine.errors import AdapterFormatError, AdapterIncompatibleError, ErrorReason, shorten
from loraswap.server.engine.families import FAMILIES
from loraswap.server.engine.scale_limits import MAX_ADAPTER_SCALE
from loraswap.server.engine.types import ModelFamily


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
    # The server fuses adapters (--fuse auto|always, weights not quantized): those the slot cannot hold are
    # accepted to be served fused.
    fuse: bool = False
    biased_layers: frozenset[str] = frozenset()  # slot layers whose base layer has a bias (lora_B.bias fuses there)

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
    layers: dict[str, CanonicalLayer]
    warnings: tuple[str, ...]
    load_ms: float
    # False for an adapter only a fused swap can apply (DoRA, a trained bias, a rank above the slot's).
    fits_slot: bool = True
    # Scratch space for the swap slot (the views it copies from, built on the first swap), so that it
    # lives and dies with the adapter. Not part of the adapter's identity.
    swap_cache: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def rank(self) -> int:
        return max(layer.rank for layer in self.layers.values())

    @property
    def nbytes(self) -> int:
        return sum(
            tensor.numel() * tensor.element_size()
            for layer in self.layers.values()
            for tensor in (layer.a, layer.b, layer.magnitude, layer.bias)
            if tensor is not None
        )


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
            f"the adapter's keys are in no layout diffusers can read for {spec.family.value} ({shorten(exc)})"
        ) from exc
    return converted, alphas


def _split_by_component(state_dict: dict[str, torch.Tensor], prefix: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    own: dict[str, torch.Tensor] = {}
    dropped: dict[str, int] = {}
    for key, value in state_dict.items():
        if key.startswith(prefix + "."):
            own[key.removeprefix(prefix + ".")] = value
        else:
            component = key.split(".", 1)[0]
            dropped[component] = dropped.get(component, 0) + 1
    return own, [f"{component} ({count} tensors)" for component, count in sorted(dropped.items())]


def _check_factor_pairs(state_dict: dict[str, torch.Tensor]) -> None:
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
        raise AdapterFormatError("the adapter holds no LoRA factor pairs (lora_A/lora_B) for the denoiser")


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
    if not torch.isfinite(a.sum()) and not torch.isfinite(a).all():
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
    """Whether `key` is a tensor a fused swap applies (a DoRA magnitude, a lora_B bias where the layer has one)."""
    if not spec.fuse:
        return False
    if key.endswith((MAGNITUDE_SUFFIX, MAGNITUDE_SUFFIX + ".weight")):
        return True
    return key.endswith(BIAS_SUFFIX) and key.removesuffix(BIAS_SUFFIX) in spec.biased_layers


def _module_of(key: str) -> str:
    for suffix in (MAGNITUDE_SUFFIX + ".weight", MAGNITUDE_SUFFIX, BIAS_SUFFIX):
        if key.endswith(suffix):
            return key.removesuffix(suffix)
    return key


def _check_layers(state_dict: dict[str, torch.Tensor], spec: SlotSpec) -> None:
    """Plain LoRA factors of slot layers only (and, when the server fuses, DoRA magnitudes and lora_B biases),
    checked before alpha patterns are matched against module names."""
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
            "LoRA biases, DoRA magnitudes and trained base weights cannot be swapped in place",
            reason=ErrorReason.ADAPTER_UNSUPPORTED_TENSORS,
        )
    modules = {key.removesuffix(".lora_A.weight") for key in state_dict if key.endswith(".lora_A.weight")}
    orphans = sorted(key for key in state_dict if _fused_only_tensor(key, spec) and _module_of(key) not in modules)
    if orphans:
        raise AdapterFormatError(
            f"tensor {shorten(orphans[0])} belongs to a layer without LoRA factors; the file is incomplete"
        )
    outside = sorted(module for module in modules if module not in spec.layer_shapes)
    if outside:
        raise AdapterIncompatibleError(
            f"the adapter changes {len(outside)} layer(s) the server's swap slot does not cover "
            f"(e.g. {shorten(', '.join(shorten(module, 80) for module in outside[:3]))}); restart the server with "
            "--target-modules covering them, or use an adapter for this model",
            reason=ErrorReason.ADAPTER_LAYER_NOT_TARGETED,
            layers=len(outside),
        )
    _check_tensors(state_dict)  # the converters' output too: a rank-0 factor must not reach alpha / rank


def _canonical_layers(
    state_dict: dict[str, torch.Tensor], scalings: dict[str, float], spec: SlotSpec
) -> dict[str, CanonicalLayer]:
    layers = {}
    for module, scaling in sorted(scalings.items()):
        a_key, b_key = f"{module}.lora_A.weight", f"{module}.lora_B.weight"
        if b_key not in state_dict:
            raise AdapterFormatError(f"layer {module} has lora_A but no lora_B")
        a, b = state_dict[a_key], state_dict[b_key]
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
        magnitude = _fused_vector(state_dict, module, (MAGNITUDE_SUFFIX, MAGNITUDE_SUFFIX + ".weight"), 1.0, spec)
        bias = _fused_vector(state_dict, module, (BIAS_SUFFIX,), scaling, spec)
        if spec.pin_memory:
            # Last, so that nothing above copies the factors back into pageable memory (a fresh pinned
            # block is aligned and contiguous like its source).
            a, baked_b = a.pin_memory(), baked_b.pin_memory()
        layers[module] = CanonicalLayer(a=a, b=baked_b, magnitude=magnitude, bias=bias)
    return layers


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


def _fits_slot(layers: dict[str, CanonicalLayer], max_rank: int) -> bool:
    """Whether the slot can hold the adapter: plain factors, no rank above its max rank."""
    return all(layer.rank <= max_rank and layer.magnitude is None and layer.bias is None for layer in layers.values())


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
    _check_tensors(raw)
    converted, alphas = _to_diffusers_keys(raw, spec)
    prefix = FAMILIES[spec.family].adapter_prefix
    own, dropped = _split_by_component(converted, prefix)
    warnings = []
    if dropped:
        message = (
            f"dropped layers for {', '.join(dropped)}: only the {prefix} can be hot-swapped, "
            "text-encoder LoRA layers are ignored"
        )
        if spec.strict:
            raise AdapterIncompatibleError(
                message.replace("are ignored", "are refused under --strict-adapters"),
                reason=ErrorReason.ADAPTER_TEXT_ENCODER_LAYERS,
            )
        warnings.append(message)
    if not own:
        raise AdapterFormatError(
            f"the adapter has no layers for the {prefix}; it is not a LoRA for this {spec.family.value} model",
            reason=ErrorReason.ADAPTER_NO_DENOISER_LAYERS,
        )
    if "lora_A" not in next(iter(own)):
        from diffusers.utils import convert_unet_state_dict_to_peft

        own = convert_unet_state_dict_to_peft(own)
    _check_factor_pairs(own)
    _check_layers(own, spec)
    scalings = layer_scalings(own, alphas, metadata, prefix, dora=spec.fuse)
    layers = _canonical_layers(own, scalings, spec)
    return CanonicalAdapter(
        name=adapter_file.name,
        source=adapter_file.source,
        layers=layers,
        warnings=tuple(warnings),
        load_ms=(time.perf_counter() - started) * 1000.0,
        fits_slot=_fits_slot(layers, spec.max_rank),
    )
