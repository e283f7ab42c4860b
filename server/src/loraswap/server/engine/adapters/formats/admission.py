"""Admission: what the server's swap slot can hold, what only a fused swap can apply, and what is refused.

Both layout readers (kohya_layout.py, diffusers_layout.py) put what they read through these rules, and
load_canonical (canonical.py) puts the whole of it (a `ReadAdapter`) through `admit` and `fits_slot`. A plain LoRA
of a slot layer, of at most the slot's max rank, goes into the slot as a `CanonicalLayer` (`slot_layer`: checked,
in the model's dtype, alpha/rank baked into b). When the server fuses (`SlotSpec.fuse`), DoRA magnitudes, trained
lora_B biases, ranks above the slot's and changes of layers the slot does not cover are admitted too and the
adapter does not fit the slot (`fits_slot`); when it does not fuse, they are refused with the restart that would
serve them. Text-encoder layers are kept or dropped per --text-encoder-layers (refused under --strict-adapters),
and refused under apply where nothing merges them (`admit_text_encoder_layers`: a family diffusers loads no
text-encoder LoRA for, whose files' text-encoder parts text_encoder_parts.py sets apart).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from loraswap.server.engine.adapters.formats.canonical_adapter import CanonicalLayer
from loraswap.server.engine.adapters.formats.change_kinds import LowRank
from loraswap.server.engine.adapters.formats.lycoris_layers import ReadLayer
from loraswap.server.engine.adapters.formats.model_layers import ModelLayers
from loraswap.server.engine.adapters.formats.tensor_checks import check_a, check_b, check_dtype, check_tensors
from loraswap.server.engine.adapters.formats.weight_changes import LayerChange
from loraswap.server.engine.errors import AdapterFormatError, AdapterIncompatibleError, ErrorReason, shorten
from loraswap.server.engine.families import FAMILIES
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
    # The server fuses adapters (--fuse auto|always, weights not int8 weight-only): those the slot cannot hold are
    # accepted to be served fused.
    fuse: bool = False
    biased_layers: frozenset[str] = frozenset()  # slot layers whose base layer has a bias (lora_B.bias fuses there)
    # Every layer of the denoiser and the text encoders a merge can reach (what file layers resolve against).
    model_layers: ModelLayers = field(default_factory=lambda: ModelLayers({}))
    # --text-encoder-layers as configured: "apply" (merged into the text encoders) or "ignore" (dropped with a warning).
    text_encoder_layers: str = "apply"
    # Whether this server can merge text-encoder layers: it has a writer for them (--text-encoder-layers apply, and a
    # pipeline with text encoders diffusers loads LoRA into). Under apply, layers nothing merges are refused.
    merges_text_encoders: bool = False

    @property
    def denoiser(self) -> str:
        """The pipeline attribute of the denoiser: the component of the slot's layers."""
        return FAMILIES[self.family].denoiser_attribute

    @property
    def pin_memory(self) -> bool:
        # Pinned host memory lets the copy into the CUDA slot run asynchronously.
        return self.device.type == "cuda"


@dataclass
class ReadAdapter:
    """What a file's layout reader made of it, before the server's settings decide what is kept."""

    layers: dict[str, CanonicalLayer]
    changes: dict[tuple[str, str], LayerChange]
    warnings: list[str] = field(default_factory=list)

    def joined(self, other: ReadAdapter | None) -> ReadAdapter:
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
        return ReadAdapter({**self.layers, **other.layers}, {**self.changes, **other.changes},
                            self.warnings + other.warnings)  # fmt: skip


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


def check_layers(state_dict: dict[str, torch.Tensor], spec: SlotSpec) -> None:
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
        refuse_outside_slot(sorted(module for module in modules if module not in spec.layer_shapes))
    check_tensors(state_dict)  # the converters' output too: a rank-0 factor must not reach alpha / rank


def refuse_outside_slot(outside: list[str]) -> None:
    """Refuse an adapter that changes these layers (`outside`, none: nothing to refuse), which the slot does not
    cover, saying how a restart would serve it."""
    if outside:
        raise AdapterIncompatibleError(
            f"the adapter changes {len(outside)} layer(s) the server's swap slot does not cover "
            f"(e.g. {shorten(', '.join(shorten(module, 80) for module in outside[:3]))}); restart the server with "
            "--target-modules covering them or with --fuse auto|always (fused swaps reach every layer), or use an "
            "adapter for this model",
            reason=ErrorReason.ADAPTER_LAYER_NOT_TARGETED,
            layers=len(outside),
        )


def slot_layer(
    module: str, a: torch.Tensor, b: torch.Tensor, scaling: float, spec: SlotSpec, names: tuple[str, str]
) -> CanonicalLayer:
    """One slot layer's factors in canonical form: checked, in the model's dtype, scaling baked into b."""
    a_key, b_key = names
    check_dtype(a_key, a)
    check_dtype(b_key, b)
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
    check_a(a_key, a, converted_a)
    check_b(b_key, b, baked_b)
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


def slot_lora(layer: ReadLayer, spec: SlotSpec) -> LowRank | None:
    """The layer's LoRA factors when the slot can take them: a plain LoRA of a slot layer, stored as a matrix."""
    low_rank = layer.plain_lora
    if layer.component != spec.denoiser or layer.module not in spec.layer_shapes or low_rank is None:
        return None
    return low_rank if low_rank.down.ndim == 2 and low_rank.up.ndim == 2 else None


def fits_slot(layers: dict[str, CanonicalLayer], changes: Mapping, spec: SlotSpec) -> bool:
    """Whether the slot can hold the adapter's denoiser part: plain factors of slot layers, no rank above its max
    rank (text-encoder changes are merged whichever way the denoiser's part is applied)."""
    if any(component == spec.denoiser for component, _ in changes):
        return False
    return all(
        layer.rank <= spec.max_rank and layer.magnitude is None and layer.bias is None for layer in layers.values()
    )


def _changes_of(read: ReadAdapter, component: str) -> dict[tuple[str, str], LayerChange]:
    return {key: change for key, change in read.changes.items() if key[0] == component}


def admit(read: ReadAdapter, spec: SlotSpec) -> None:
    """Apply the server's settings to what was read: text-encoder layers kept or dropped (--text-encoder-layers,
    --strict-adapters), denoiser changes refused unless the server fuses."""
    encoders = Counter(component for component, _ in read.changes if component != spec.denoiser)
    if encoders and (warning := admit_text_encoder_layers(encoders, "layers", spec)) is not None:
        read.warnings.append(warning)
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
        refuse_outside_slot(plain)
    if not read.layers and not read.changes:
        raise AdapterFormatError(
            f"the adapter changes no layer this server applies (the {spec.denoiser}'s, or the text encoders' with "
            "--text-encoder-layers apply); it is not an adapter for this model",
            reason=ErrorReason.ADAPTER_NO_DENOISER_LAYERS,
        )


def admit_text_encoder_layers(counts: Mapping[str, int], unit: str, spec: SlotSpec) -> str | None:
    """What the server's settings make of an adapter's text-encoder layers (`counts`: how many `unit`s, "layers" or
    "tensors", of each text encoder, named as the file names it): None when they are merged (--text-encoder-layers
    apply, with a writer for them), the warning to give when they are dropped (ignore).

    Raises ADAPTER_TEXT_ENCODER_LAYERS for layers it would drop under --strict-adapters, ADAPTER_UNSUPPORTED_TENSORS
    under apply when nothing merges them (a family diffusers loads no text-encoder LoRA for), saying how to serve the
    rest of the file.
    """
    listed = ", ".join(f"{component} ({count} {unit})" for component, count in sorted(counts.items()))
    if spec.text_encoder_layers == "apply":
        if spec.merges_text_encoders:
            return None
        raise AdapterFormatError(
            f"the adapter has layers for {listed}, which is no component adapters change in a {spec.family.value} "
            f"pipeline; this server applies no text-encoder layers ({_why_none(spec)}): restart it with "
            "--text-encoder-layers ignore to drop them with a warning, or use a file without them",
            reason=ErrorReason.ADAPTER_UNSUPPORTED_TENSORS,
        )
    message = f"dropped layers for {listed}: text-encoder layers are ignored (--text-encoder-layers ignore)"
    if spec.strict:
        raise AdapterIncompatibleError(
            message.replace("are ignored", "are refused under --strict-adapters"),
            reason=ErrorReason.ADAPTER_TEXT_ENCODER_LAYERS,
        )
    return message


def _why_none(spec: SlotSpec) -> str:
    if not FAMILIES[spec.family].text_encoders:
        return f"diffusers loads no text-encoder LoRA for {spec.family.value}"
    return "its pipeline has no text encoders to merge them into"
