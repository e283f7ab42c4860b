"""The one swap-ready form every adapter is converted into, once, before it touches the model.

A canonical adapter holds, for each layer it changes, `a` (rank x in) and `b`
(out x rank) in the model's dtype with alpha/rank (and any per-layer alpha)
already multiplied into `b`. The live swap slot is max-rank wide on every
targeted layer; a canonical adapter is stored at its own rank and the slot
gates off the ranks beyond it, so a swap is only in-place copies: no key
conversion, no config, no scale bookkeeping. Both factors are checked finite
in the model's dtype, and `b` finite at every allowed strength, which is what
makes the slot's gating exact.

Reading goes through diffusers' own `lora_state_dict` converters (kohya,
A1111, ComfyUI, xlabs, ... to diffusers keys) and the same alpha rules as
`load_lora_adapter`, so an adapter means exactly what diffusers makes of it.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loraswap.server.engine.adapters.sources import AdapterFile
from loraswap.server.engine.errors import AdapterFormatError, AdapterIncompatibleError, ErrorReason
from loraswap.server.engine.families import FAMILIES
from loraswap.server.engine.request_rules import MAX_ADAPTER_SCALE
from loraswap.server.engine.types import ModelFamily

# diffusers stores the LoraConfig of each component in this safetensors metadata key.
LORA_ADAPTER_METADATA_KEY = "lora_adapter_metadata"


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

    @property
    def pin_memory(self) -> bool:
        # Pinned host memory lets the copy into the CUDA slot run asynchronously.
        return self.device.type == "cuda"


@dataclass(frozen=True)
class CanonicalLayer:
    """One layer's LoRA factors: a (rank x in) and b (out x rank), alpha baked into b."""

    a: torch.Tensor
    b: torch.Tensor

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
    # Scratch space for the swap slot (the views it copies from, built on the first swap), so that it
    # lives and dies with the adapter. Not part of the adapter's identity.
    swap_cache: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def rank(self) -> int:
        return max(layer.rank for layer in self.layers.values())

    @property
    def nbytes(self) -> int:
        return sum(
            layer.a.numel() * layer.a.element_size() + layer.b.numel() * layer.b.element_size()
            for layer in self.layers.values()
        )


def _read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict | None]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            header = handle.metadata() or {}
            state_dict = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118 (safe_open is not a dict)
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise AdapterFormatError(
            f"{path.name} is not a readable safetensors file ({exc}); re-export or re-download the adapter"
        ) from exc
    raw = header.get(LORA_ADAPTER_METADATA_KEY)
    try:
        metadata = json.loads(raw) if raw else None
    except json.JSONDecodeError as exc:
        raise AdapterFormatError(f"{path.name} has malformed '{LORA_ADAPTER_METADATA_KEY}' metadata") from exc
    if metadata is not None and not isinstance(metadata, dict):
        raise AdapterFormatError(f"{path.name} has '{LORA_ADAPTER_METADATA_KEY}' metadata that is not a JSON object")
    return state_dict, metadata


def _to_diffusers_keys(
    state_dict: dict[str, torch.Tensor], spec: SlotSpec
) -> tuple[dict[str, torch.Tensor], dict[str, float] | None]:
    """Run diffusers' format converters (kohya, A1111, xlabs, ...) for the family."""
    try:
        converted, alphas = FAMILIES[spec.family].lora_state_dict(state_dict, spec.denoiser_config)
    # diffusers' converters signal unexpected layouts with asserts and attribute errors too.
    except (ValueError, KeyError, TypeError, RuntimeError, IndexError, AttributeError, AssertionError) as exc:
        raise AdapterFormatError(
            f"the adapter's keys are in no layout diffusers can read for {spec.family.value} ({exc})"
        ) from exc
    return converted, alphas


def _split_by_component(
    state_dict: dict[str, torch.Tensor], prefix: str
) -> tuple[dict[str, torch.Tensor], list[str]]:
    own: dict[str, torch.Tensor] = {}
    dropped: dict[str, int] = {}
    for key, value in state_dict.items():
        if key.startswith(prefix + "."):
            own[key.removeprefix(prefix + ".")] = value
        else:
            component = key.split(".", 1)[0]
            dropped[component] = dropped.get(component, 0) + 1
    return own, [f"{component} ({count} tensors)" for component, count in sorted(dropped.items())]


def _layer_scalings(
    state_dict: dict[str, torch.Tensor], alphas: dict[str, float] | None, metadata: dict | None, prefix: str
) -> dict[str, float]:
    """Per-module alpha/rank exactly as diffusers' load_lora_adapter configures PEFT."""
    from diffusers.utils.peft_utils import _create_lora_config
    from peft.utils.other import get_pattern_key

    ranks = {f"^{key}": value.shape[1] for key, value in state_dict.items() if "lora_B" in key and value.ndim > 1}
    if alphas:
        alphas = {k.removeprefix(f"{prefix}."): v for k, v in alphas.items() if k.startswith(f"{prefix}.")}
    if metadata:
        metadata = {k.removeprefix(f"{prefix}."): v for k, v in metadata.items() if k.startswith(f"{prefix}.")}
    try:
        config = _create_lora_config(state_dict, alphas or None, metadata or None, ranks)
    except (TypeError, ValueError, IndexError, KeyError) as exc:
        raise AdapterFormatError(f"the adapter's LoRA configuration is not valid ({exc})") from exc
    if getattr(config, "use_dora", False):
        raise AdapterIncompatibleError("DoRA adapters cannot be swapped in place; use a plain LoRA")
    scalings = {}
    for key, value in state_dict.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key.removesuffix(".lora_A.weight")
        rank = value.shape[0]
        alpha = config.alpha_pattern.get(get_pattern_key(config.alpha_pattern.keys(), module), config.lora_alpha)
        if not math.isfinite(alpha):
            raise AdapterFormatError(
                f"layer {module} has LoRA alpha {alpha}; alpha must be a finite number",
                reason=ErrorReason.ADAPTER_NOT_FINITE,
            )
        scalings[module] = alpha / math.sqrt(rank) if config.use_rslora else alpha / rank
    return scalings


def _check_factor_pairs(state_dict: dict[str, torch.Tensor]) -> None:
    """Every layer needs both factors; a lone lora_A or lora_B is a broken file."""
    modules_a = {key.removesuffix(".lora_A.weight") for key in state_dict if key.endswith(".lora_A.weight")}
    modules_b = {key.removesuffix(".lora_B.weight") for key in state_dict if key.endswith(".lora_B.weight")}
    unpaired = sorted(modules_a ^ modules_b)
    if unpaired:
        raise AdapterFormatError(
            f"{len(unpaired)} layer(s) have only one of lora_A/lora_B (e.g. {unpaired[0]}); the file is incomplete"
        )
    if not modules_a:
        raise AdapterFormatError("the adapter holds no LoRA factor pairs (lora_A/lora_B) for the denoiser")


def _check_dtype(key: str, tensor: torch.Tensor) -> None:
    if not tensor.is_floating_point():
        raise AdapterFormatError(
            f"tensor {key} has dtype {tensor.dtype}; LoRA weights must be floating point",
            reason=ErrorReason.ADAPTER_BAD_DTYPE,
        )


def _refuse_non_finite(key: str, raw: torch.Tensor, converted: torch.Tensor) -> None:
    """Raise the error that says why `converted` (the model-dtype form of `raw`) has a non-finite value."""
    if not torch.isfinite(raw).all():
        raise AdapterFormatError(f"tensor {key} holds NaN or infinite values", reason=ErrorReason.ADAPTER_NOT_FINITE)
    raise AdapterFormatError(
        f"tensor {key} has values too large for the model's dtype {str(converted.dtype).removeprefix('torch.')} "
        "(after multiplying lora_B by alpha/rank)",
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
            f"tensor {key} has values up to {largest:.3g}; at the largest strength ({MAX_ADAPTER_SCALE}) they would "
            f"overflow the model's dtype {str(b.dtype).removeprefix('torch.')}, so values must stay within {limit:.3g}",
            reason=ErrorReason.ADAPTER_OUT_OF_RANGE,
        )


def _canonical_layers(
    state_dict: dict[str, torch.Tensor], scalings: dict[str, float], spec: SlotSpec
) -> dict[str, CanonicalLayer]:
    unexpected = sorted(
        key for key in state_dict if not key.endswith((".lora_A.weight", ".lora_B.weight"))
    )
    if unexpected:
        raise AdapterFormatError(
            f"the adapter has tensors that are not plain LoRA factors ({', '.join(unexpected[:5])}); "
            "LoRA biases, DoRA magnitudes and trained base weights cannot be swapped in place",
            reason=ErrorReason.ADAPTER_UNSUPPORTED_TENSORS,
        )
    outside = sorted(module for module in scalings if module not in spec.layer_shapes)
    if outside:
        raise AdapterIncompatibleError(
            f"the adapter changes {len(outside)} layer(s) the server's swap slot does not cover "
            f"(e.g. {', '.join(outside[:3])}); restart the server with --target-modules covering them, "
            "or use an adapter for this model",
            reason=ErrorReason.ADAPTER_LAYER_NOT_TARGETED,
            layers=len(outside),
        )
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
        if rank > spec.max_rank:
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
        a = converted_a
        if spec.pin_memory:
            a, baked_b = a.pin_memory(), baked_b.pin_memory()
        baked_b = baked_b.contiguous()
        if baked_b.data_ptr() % 16:
            # Tensors read straight from a safetensors file can start anywhere; the slot copies
            # lora_B as 16-byte elements only from 16-byte-aligned memory, which a fresh tensor is.
            baked_b = baked_b.clone()
        layers[module] = CanonicalLayer(a=a.contiguous(), b=baked_b)
    return layers


def load_canonical(adapter_file: AdapterFile, spec: SlotSpec) -> CanonicalAdapter:
    """Read, convert and validate an adapter file into its canonical form; touches no model."""
    started = time.perf_counter()
    raw, metadata = _read_safetensors(adapter_file.path)
    if not raw:
        raise AdapterFormatError(f"{adapter_file.path.name} holds no tensors")
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
    scalings = _layer_scalings(own, alphas, metadata, prefix)
    layers = _canonical_layers(own, scalings, spec)
    return CanonicalAdapter(
        name=adapter_file.name,
        source=adapter_file.source,
        layers=layers,
        warnings=tuple(warnings),
        load_ms=(time.perf_counter() - started) * 1000.0,
    )
