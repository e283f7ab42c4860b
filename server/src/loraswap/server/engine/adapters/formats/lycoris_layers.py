"""A kohya-style file's layers as weight changes: each layer's tensors read as one kind, checked against the
model layer it changes before anything is cached.

The kind is told by the tensors' names (LyCORIS's module `weight_list`s): `lora_up/lora_down` (+ `lora_mid`) LoRA
and LoCon, `hada_*` LoHa, `lokr_*` LoKr, `diff` (+ `diff_b`) a full difference; `alpha` and `dora_scale` go with
any of them. A layer with the tensors of two kinds is refused, never served as one of them. Every tensor must be floating point and finite, and the change must rebuild to the layer's weight
shape (checked on the meta device: no arithmetic is done here). Factors keep the file's dtype: the dense change
is formed from them, in float32, only when a fused swap merges the layer.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from loraswap.server.engine.adapters.formats.change_kinds import Full, Hadamard, Kronecker, LowRank, rank_scale
from loraswap.server.engine.adapters.formats.key_layouts import FileLayer
from loraswap.server.engine.adapters.formats.model_layers import LayerShape, ModelLayers
from loraswap.server.engine.adapters.formats.tensor_checks import alpha_value
from loraswap.server.engine.adapters.formats.weight_changes import LayerChange, dora_eps
from loraswap.server.engine.errors import AdapterFormatError, ErrorReason, shorten

META = torch.device("meta")


@dataclass(frozen=True)
class ReadLayer:
    """A file layer's change, with the component and module path it applies to."""

    component: str
    module: str
    change: LayerChange

    @property
    def plain_lora(self) -> LowRank | None:
        """The LoRA factors when the change is a plain LoRA (no Tucker core, no DoRA, no bias): the slot's form."""
        change = self.change
        plain = isinstance(change.change, LowRank) and change.change.mid is None
        return change.change if plain and change.bias is None and change.dora_scale is None else None


def _required(layer: FileLayer, names: tuple[str, ...]) -> list[torch.Tensor]:
    missing = [name for name in names if name not in layer.tensors]
    if missing:
        raise AdapterFormatError(
            f"layer {shorten(layer.name)} lacks {', '.join(missing)} beside "
            f"{', '.join(sorted(layer.tensors))}; the file is incomplete"
        )
    return [layer.tensors[name] for name in names]


def _alpha(layer: FileLayer) -> float | None:
    alpha = layer.tensors.get("alpha")
    if alpha is None:
        return None
    value = alpha_value(layer.name, alpha)
    if not math.isfinite(value):
        raise AdapterFormatError(
            f"layer {shorten(layer.name)} has alpha {value}; alpha must be a finite number",
            reason=ErrorReason.ADAPTER_NOT_FINITE,
        )
    return value


# The tensors that make each kind's weight change (LyCORIS's `weight_list`s); `alpha`, `dora_scale` and `diff_b` go
# beside any of them. A layer carrying the tensors of two kinds is refused (ADAPTER_MIXED_KINDS): which change it
# makes is ambiguous, and serving one kind would drop the other's tensors unseen.
KIND_TENSORS = {
    "LoRA": frozenset({"lora_up.weight", "lora_down.weight", "lora_mid.weight"}),
    "LoHa": frozenset({"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2"}),
    "LoKr": frozenset({"lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2"}),
    "full": frozenset({"diff"}),
}


def _kind_of(layer: FileLayer) -> str | None:
    """The one kind whose tensors the layer carries; None for none (a bias alone). Raises ADAPTER_MIXED_KINDS."""
    kinds = sorted(kind for kind, names in KIND_TENSORS.items() if names & layer.tensors.keys())
    if len(kinds) > 1:
        held = sorted(name for name in layer.tensors if any(name in KIND_TENSORS[kind] for kind in kinds))
        raise AdapterFormatError(
            f"layer {shorten(layer.name)} carries the tensors of {len(kinds)} kinds, {' and '.join(kinds)} "
            f"({shorten(', '.join(held), 160)}); a layer makes one kind of change: re-export the adapter with one "
            "kind per layer",
            reason=ErrorReason.ADAPTER_MIXED_KINDS,
            layer=layer.name,
            kinds=",".join(kinds),
        )
    return kinds[0] if kinds else None


def _one_form(layer: FileLayer, whole: str, product: tuple[str, ...]) -> None:
    """A LoKr side is stored whole or as a product (with a core), never both: neither is dropped unseen."""
    present = [name for name in product if name in layer.tensors]
    if whole in layer.tensors and present:
        raise AdapterFormatError(
            f"layer {shorten(layer.name)} stores one LoKr side both whole ({whole}) and as a product "
            f"({', '.join(present)}); keep one form",
        )


def _weight_change(layer: FileLayer) -> LowRank | Hadamard | Kronecker | Full | None:
    tensors = layer.tensors
    kind = _kind_of(layer)
    alpha = _alpha(layer)
    if kind == "LoRA":
        down, up = _required(layer, ("lora_down.weight", "lora_up.weight"))
        return LowRank(down, up, tensors.get("lora_mid.weight"), rank_scale(alpha, down.shape[0]))
    if kind == "LoHa":
        w1a, w1b, w2a, w2b = _required(layer, ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"))
        if ("hada_t1" in tensors) != ("hada_t2" in tensors):
            _required(layer, ("hada_t1", "hada_t2"))
        return Hadamard(
            w1a, w1b, w2a, w2b, tensors.get("hada_t1"), tensors.get("hada_t2"), rank_scale(alpha, w1b.shape[0])
        )
    if kind == "LoKr":
        _one_form(layer, "lokr_w1", ("lokr_w1_a", "lokr_w1_b"))
        _one_form(layer, "lokr_w2", ("lokr_w2_a", "lokr_w2_b", "lokr_t2"))
        if "lokr_w1" not in tensors:
            _required(layer, ("lokr_w1_a", "lokr_w1_b"))
        if "lokr_w2" not in tensors:
            _required(layer, ("lokr_w2_a", "lokr_w2_b"))
        change = Kronecker(
            *(tensors.get(name) for name in ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b")),
            t2=tensors.get("lokr_t2"),
            scale=1.0,
        )
        # alpha / rank of the side stored as a product; two whole sides ignore alpha (a placeholder scales nothing).
        return dataclasses.replace(change, scale=rank_scale(alpha, change.rank) if change.rank else 1.0)
    if kind == "full":
        return Full(tensors["diff"])
    return None


def _check_values(layer: FileLayer) -> None:
    for name, tensor in layer.tensors.items():
        if not tensor.is_floating_point():
            raise AdapterFormatError(
                f"tensor {shorten(layer.name)}.{name} has dtype {tensor.dtype}; adapter weights must be floating point",
                reason=ErrorReason.ADAPTER_BAD_DTYPE,
            )
        if name != "alpha" and tensor.ndim == 0:
            raise AdapterFormatError(
                f"tensor {shorten(layer.name)}.{name} is a 0-dimensional scalar; only alpha may be one",
                reason=ErrorReason.ADAPTER_SHAPE_MISMATCH,
            )
        if not torch.isfinite(tensor.sum(dtype=torch.float32)) and not torch.isfinite(tensor).all():
            raise AdapterFormatError(
                f"tensor {shorten(layer.name)}.{name} holds NaN or infinite values",
                reason=ErrorReason.ADAPTER_NOT_FINITE,
            )


def _shape_error(layer: FileLayer, shape: LayerShape, detail: str) -> AdapterFormatError:
    return AdapterFormatError(
        f"layer {shorten(layer.name)} ({layer.component}.{shorten(layer.module, 120)}, weight {shape.weight}) "
        f"{detail}; this adapter was made for a different model",
        reason=ErrorReason.ADAPTER_SHAPE_MISMATCH,
    )


def _vector(layer: FileLayer, name: str, length: int, shape: LayerShape) -> torch.Tensor | None:
    tensor = layer.tensors.get(name)
    if tensor is not None and tensor.numel() != length:
        raise _shape_error(layer, shape, f"has {name} of shape {tuple(tensor.shape)}, not one value per output")
    return tensor.reshape(-1) if tensor is not None else None


def _dora_scale(layer: FileLayer, shape: LayerShape) -> torch.Tensor | None:
    """The magnitude, shaped (out, 1, ...) (norms over output rows) or (1, in, ...) (over input columns)."""
    magnitude = layer.tensors.get("dora_scale")
    if magnitude is None:
        return None
    ones = [1] * (len(shape.weight) - 1)
    if magnitude.numel() == shape.weight[0] and magnitude.shape[0] == shape.weight[0]:
        return magnitude.reshape(shape.weight[0], *ones)
    if magnitude.numel() == shape.weight[1] and magnitude.shape[0] == 1:
        return magnitude.reshape(1, shape.weight[1], *ones[1:])
    raise _shape_error(layer, shape, f"has dora_scale of shape {tuple(magnitude.shape)}, one per output or input")


def read_layer(layer: FileLayer, shape: LayerShape, *, pin_memory: bool = False) -> ReadLayer:
    """The layer's change, checked against the model layer's `shape`. Raises AdapterFormatError."""
    _check_values(layer)
    change = _weight_change(layer)
    bias = _vector(layer, "diff_b", shape.out_features, shape)
    if change is None and bias is None:
        raise AdapterFormatError(
            f"layer {shorten(layer.name)} has only {', '.join(sorted(layer.tensors))}: no weight change",
        )
    if bias is not None and not shape.has_bias:
        raise _shape_error(layer, shape, "changes a bias the layer does not have")
    dora_scale = _dora_scale(layer, shape)
    if dora_scale is not None and change is None:
        raise AdapterFormatError(f"layer {shorten(layer.name)} has dora_scale but no weight change")
    read = LayerChange(change, bias, dora_scale, dora_eps(dora_scale) if dora_scale is not None else 0.0)
    if change is not None:
        try:
            read.dense_delta(META, shape.weight)
        except (RuntimeError, ValueError, IndexError) as exc:
            # In our words: the factors' shapes, not the text of whichever torch operation gave up on them.
            shapes = ", ".join(f"{name} {tuple(tensor.shape)}" for name, tensor in sorted(layer.tensors.items())
                               if name not in ("alpha", "dora_scale", "diff_b"))  # fmt: skip
            raise _shape_error(
                layer, shape, f"has factors of shapes that do not rebuild its weight ({shorten(shapes, 300)})"
            ) from exc
    if pin_memory:
        read = _pinned(read)
    return ReadLayer(layer.component, layer.module, read)


def _pinned(change: LayerChange) -> LayerChange:
    """The same change over pinned copies of its tensors, so merges on a CUDA device copy them asynchronously."""

    def pin(tensor):
        return tensor.contiguous().pin_memory() if isinstance(tensor, torch.Tensor) else tensor

    inner = change.change
    if inner is not None:
        inner = dataclasses.replace(inner, **{f.name: pin(getattr(inner, f.name)) for f in dataclasses.fields(inner)})
    return LayerChange(inner, pin(change.bias), pin(change.dora_scale), change.dora_eps)


def read_layers(layers: list[FileLayer], model: ModelLayers, *, pin_memory: bool = False) -> list[ReadLayer]:
    """Every file layer read (file_layers resolved each to a layer of `model`); a stacked one read whole against
    its stack's shape, then cut into its parts' rows."""
    read = []
    for layer in layers:
        if not layer.parts:
            read.append(read_layer(layer, model.shape(layer.component, layer.module), pin_memory=pin_memory))
            continue
        stacked = layer.stacked_shape(model)
        whole = read_layer(layer, stacked, pin_memory=pin_memory).change
        for part in layer.parts:
            try:
                change = whole.rows(part.rows, stacked.weight)
            except ValueError as exc:
                raise AdapterFormatError(
                    f"layer {shorten(layer.name)} stacks {layer.module} and has a weight decomposition (dora_scale) "
                    f"normalised over its input columns: {exc}, so it cannot be cut into them",
                    reason=ErrorReason.ADAPTER_KIND_UNSUPPORTED,
                    kind="DoRA normalised over input columns, on a stacked layer",
                ) from exc
            read.append(ReadLayer(layer.component, part.module, change))
    return read
