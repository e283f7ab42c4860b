"""How far an adapter moves each layer's weights: the largest |ΔW| it makes on each layer at strength 1.

An adapter is admitted by it where its file first becomes known (load_canonical: a Generate's cold load, Preload,
--preload), and a request's strengths are checked against it before anything touches the model; a fused merge
bounds |W0 + Σ sᵢ ΔWᵢ| with it and W0's largest value, so a merge the bound clears needs no finiteness check.

The range a change may take is √(largest value of the model's dtype): 1.8e19 in float32 and bfloat16, 256 in float16.
Past it a layer's outputs reach values whose products (attention's q·k, the next layer's sums, a norm's squares)
overflow the dtype, so every generation with the change ends non-finite: an alpha of -1e30, or factors of 1e20, no
longer pass a load only to fail each Generate. No adapter a model can serve comes near it (trained changes are of the
weights' own size, about 1).

Each figure is exact, or a bound that is used only while it refuses nothing:
- a LoRA's (the slot's factors, a LoCon change) max|B A| is bounded by rank · max|B| · max|A| while a thousand times
  that stays inside float16's range, nearer it by the smaller of max_i Σ_r |B_ir| max_j |A_rj| and its transpose,
  and formed exactly when its bound at the largest strength could reach the model's range;
- a LoHa's by the product of its two products' bounds, likewise formed exactly when need be;
- a LoKr's is exact from its sides (max|w1 ⊗ w2| = max|w1| max|w2|), a full difference's is its own largest value;
- a bias change counts its largest value; a weight decomposition (DoRA) its magnitude's largest value on top of ΔW's.
Exact figures are formed from the factors scaled down to at most 1 (ΔW is linear in each factor), so values that
overflow float32 (1e20 factors, a float64 file's 1e300) are still measured: the figure is then far past the range, or
infinite.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping

import torch

from loraswap.server.engine.adapters.formats.change_kinds import (
    Full,
    Hadamard,
    Kronecker,
    LowRank,
    RowsOf,
    WeightChange,
)
from loraswap.server.engine.adapters.formats.weight_changes import LayerChange
from loraswap.server.engine.errors import AdapterFormatError, ErrorReason, InvalidRequestError, shorten
from loraswap.server.engine.scale_limits import MAX_ADAPTER_SCALE

LayerKey = tuple[str, str]  # (component, module path)
CPU = torch.device("cpu")
# A rank-times-largest-values bound stands as the figure while this many of it (strengths and stack members) stay
# inside float16's range: far from any range, its looseness refuses nothing.
ROUGH_MARGIN = 1024
# The smallest strength a request can send that is not 0 (adapter_scale is a float32): below it none "fits".
SMALLEST_STRENGTH = float(torch.finfo(torch.float32).tiny)


def effect_limit(dtype: torch.dtype) -> float:
    """The largest |ΔW| (strength times a layer's change) a model of `dtype` serves: √ of the dtype's largest value."""
    return math.sqrt(float(torch.finfo(dtype).max))


def _largest(tensor: torch.Tensor | None) -> float:
    if tensor is None or tensor.numel() == 0:
        return 0.0
    return float(tensor.detach().abs().amax().to(torch.float64))


def _low_rank_bound(up: torch.Tensor, down: torch.Tensor) -> float:
    """A bound of max|up @ down| (up (out, r), down (r, in)): rank · max|up| · max|down| while that is far inside
    every range (one reduction per factor), else Σ_r |up_ir| |down_rj| <= Σ_r |up_ir| max_j |down_rj| and the same
    the other way round, the smaller of the two. Infinite where float32 overflows."""
    rough = up.shape[1] * _largest(up) * _largest(down)
    if rough * ROUGH_MARGIN <= effect_limit(torch.float16):
        return rough
    up, down = up.detach().abs().to(torch.float32), down.detach().abs().to(torch.float32)
    by_rows = float((up @ down.amax(dim=1)).amax()) if up.numel() else 0.0
    by_columns = float((up.amax(dim=0) @ down).amax()) if down.numel() else 0.0
    return min(by_rows, by_columns)


def _tucker_bound(core: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> float:
    """A bound of max|core ×₁ up ×₂ down| (core (r, r, *k), up (r, out), down (r, in))."""
    rows = float(up.detach().abs().to(torch.float64).amax(dim=1).sum())
    columns = float(down.detach().abs().to(torch.float64).amax(dim=1).sum())
    return _largest(core) * rows * columns


def _bound(change: WeightChange) -> float:
    """A bound of max|ΔW| at strength 1 (exact for LoKr and full differences)."""
    if isinstance(change, RowsOf):
        return _bound(change.of)
    if isinstance(change, Full):
        return _largest(change.diff)
    if isinstance(change, LowRank):
        if change.mid is not None:
            return abs(change.scale) * _tucker_bound(change.mid, change.up.reshape(change.up.shape[0], -1).T,
                                                     change.down.reshape(change.rank, -1))  # fmt: skip
        return abs(change.scale) * _low_rank_bound(
            change.up.reshape(change.up.shape[0], -1), change.down.reshape(change.rank, -1)
        )
    if isinstance(change, Hadamard):
        if change.t1 is not None:
            first = _tucker_bound(change.t1, change.w1a, change.w1b.reshape(change.rank, -1))
            second = _tucker_bound(change.t2, change.w2a, change.w2b.reshape(change.rank, -1))
        else:
            first = _low_rank_bound(change.w1a, change.w1b.reshape(change.rank, -1))
            second = _low_rank_bound(change.w2a, change.w2b.reshape(change.w2b.shape[0], -1))
        return abs(change.scale) * first * second
    return abs(change.scale) * _kronecker_side(change, 1) * _kronecker_side(change, 2)


def _kronecker_side(change: Kronecker, side: int) -> float:
    """max|w1| or max|w2| of a LoKr, exactly: a side is small, so a product or core is formed (in float64)."""
    whole, a, b = (change.w1, change.w1a, change.w1b) if side == 1 else (change.w2, change.w2a, change.w2b)
    if whole is not None:
        return _largest(whole)
    a, b = a.detach().to(torch.float64), b.detach().to(torch.float64)
    if side == 2 and change.t2 is not None:
        formed = torch.einsum("i j ..., i p, j r -> p r ...", change.t2.detach().to(torch.float64), a, b)
    else:
        formed = a @ b.reshape(b.shape[0], -1)
    return _largest(formed)


def _exact(change: WeightChange, shape: tuple[int, ...]) -> float:
    """max|ΔW| at strength 1, formed from the factors scaled down to at most 1 (ΔW is linear in each of them)."""
    tensors = {field.name: getattr(change, field.name) for field in dataclasses.fields(change)
               if isinstance(getattr(change, field.name), torch.Tensor)}  # fmt: skip
    largest = {name: _largest(tensor) for name, tensor in tensors.items()}
    if any(value == 0.0 for value in largest.values()):
        return 0.0
    if any(math.isinf(value) for value in largest.values()):
        return math.inf
    scaled = {name: (tensor.detach().to(torch.float64) / largest[name]).to(torch.float32)
              for name, tensor in tensors.items()}  # fmt: skip
    unit = dataclasses.replace(change, **scaled, scale=1.0)
    formed = _largest(unit.dense(CPU, shape))
    if formed == 0.0:  # products that cancel: no change, however large the factors
        return 0.0
    return formed * math.prod(largest.values()) * abs(change.scale)


def formed_on_the_way(change: LayerChange) -> float:
    """A bound of the values a merge forms before ΔW, unscaled: a LoHa's two products (w1a w1b, w2a w2b) and a LoKr's
    sides (w1, w2), which own_dtype_merges.py forms in the weight's dtype; 0 for kinds that form none. A product past
    the range with its partner far below it (1e30 times 1e-20) makes a small ΔW that no merge can form."""
    kind = change.change.of if isinstance(change.change, RowsOf) else change.change
    if isinstance(kind, Hadamard) and kind.t1 is None:
        return max(_low_rank_bound(kind.w1a, kind.w1b.reshape(kind.rank, -1)),
                   _low_rank_bound(kind.w2a, kind.w2b.reshape(kind.w2b.shape[0], -1)))  # fmt: skip
    if isinstance(kind, Kronecker):
        return max(_kronecker_side(kind, 1), _kronecker_side(kind, 2))
    return 0.0


def change_effect(change: WeightChange, shape: tuple[int, ...], dtype: torch.dtype) -> float:
    """max|ΔW| of one change at strength 1 (`shape`: the layer's weight, `dtype`: the model's): its bound while even
    the largest strength keeps that inside the dtype's range, else formed exactly."""
    whole = change.of if isinstance(change, RowsOf) else change
    bound = _bound(whole)
    if isinstance(whole, (Full, Kronecker)) or bound * MAX_ADAPTER_SCALE <= effect_limit(dtype):
        return bound
    return _exact(whole, change.stacked_shape if isinstance(change, RowsOf) else shape)


def layer_effect(change: LayerChange, shape: tuple[int, ...], dtype: torch.dtype) -> float:
    """How far one layer's change moves its weight (and bias) at strength 1."""
    effect = change_effect(change.change, shape, dtype) if change.change is not None else 0.0
    if change.dora_scale is not None:
        effect += _largest(change.dora_scale)
    return max(effect, _largest(change.bias))


def slot_effect(
    a: torch.Tensor, b: torch.Tensor, magnitude: torch.Tensor | None, bias: torch.Tensor | None, dtype: torch.dtype
) -> float:
    """layer_effect of a slot layer's canonical factors (alpha / rank already in b)."""
    change = LayerChange(LowRank(a, b, None, 1.0), bias, magnitude)
    return layer_effect(change, (b.shape[0], a.shape[1]), dtype)


def strongest(effects: Mapping[LayerKey, float]) -> tuple[LayerKey, float] | None:
    """The layer the change moves most, and how far; None when there is none."""
    if not effects:
        return None
    key = max(sorted(effects), key=lambda key: effects[key])
    return key, effects[key]


def largest_fitting_strength(effect: float, limit: float) -> float | None:
    """The largest |strength| at which `effect` stays within `limit`, rounded down to 3 significant digits; None
    when none a request can send fits."""
    if effect == 0.0:
        return math.inf
    strength = limit / effect
    if not strength >= SMALLEST_STRENGTH:
        return None
    digits = 2 - math.floor(math.log10(strength))
    rounded = math.floor(strength * 10**digits) / 10**digits
    return rounded if rounded > 0 else strength


def stack_effects(members: Iterable[tuple[Mapping[LayerKey, float], float]]) -> dict[LayerKey, float]:
    """Σ |sᵢ| effectᵢ on each layer a stack changes (members: each adapter's effects and its strength)."""
    summed: dict[LayerKey, float] = {}
    for effects, strength in members:
        for key, effect in effects.items():
            summed[key] = summed.get(key, 0.0) + abs(strength) * effect
    return summed


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _past_range(key: LayerKey, reached: float, dtype: torch.dtype) -> str:
    component, module = key
    return (f"layer {shorten(module, 120)} of the {component} to {reached:.3g}, past the {effect_limit(dtype):.3g} a "
            f"{_dtype_name(dtype)} model carries (beyond it the layer's outputs overflow {_dtype_name(dtype)} in the "
            "products that follow)")  # fmt: skip


def refuse_out_of_range(
    effects: Mapping[LayerKey, float], dtype: torch.dtype, on_the_way: Mapping[LayerKey, float] | None = None
) -> None:
    """Refuse, where an adapter file is loaded, one whose change at strength 1 passes the dtype's range, or whose
    merge would form values past it on the way (`on_the_way`: formed_on_the_way of each layer).

    Raises:
        AdapterFormatError: ADAPTER_OUT_OF_RANGE, naming the layer and the largest strength that would fit (metadata
            `layer`, and `max_scale` where one fits).
    """
    limit = effect_limit(dtype)
    found = strongest(effects)
    if found is not None and found[1] > limit:
        key, effect = found
        fit = largest_fitting_strength(effect, limit)
        if fit is None:
            advice = ("no strength a request can send brings it into range: the file's alpha or factor values are far "
                      "out of any trained adapter's range; re-export it")  # fmt: skip
        else:
            advice = (f"only strengths up to {fit:g} would fit, and an adapter must fit at strength 1: re-export it "
                      "with smaller alpha or factor values")  # fmt: skip
        raise AdapterFormatError(
            f"the adapter moves {_past_range(key, effect, dtype)} at strength 1; {advice}",
            reason=ErrorReason.ADAPTER_OUT_OF_RANGE,
            layer=key[1],
            **({"max_scale": f"{fit:g}"} if fit is not None else {}),
        )
    formed = strongest(on_the_way or {})
    if formed is not None and formed[1] > limit:
        (component, module), value = formed
        raise AdapterFormatError(
            f"the adapter's factors for layer {shorten(module, 120)} of the {component} multiply to {value:.3g} (a LoHa "
            f"product or a LoKr side), past the {limit:.3g} a {_dtype_name(dtype)} model carries, whatever the "
            "strength: re-export it with factor values of a trained adapter's size",
            reason=ErrorReason.ADAPTER_OUT_OF_RANGE,
            layer=module,
        )


def refuse_strengths(members: list[tuple[Mapping[LayerKey, float], float]], dtype: torch.dtype) -> None:
    """Refuse a request whose strengths move a layer past the dtype's range (members: each adapter's effects and the
    strength asked); the adapters stay cached and serve at other strengths.

    Raises:
        InvalidRequestError: ADAPTER_OUT_OF_RANGE with field adapter_scale (one adapter) or adapters (a stack), the
            layer, and the largest strength (or factor of the stack's strengths) that fits as `max_scale`.
    """
    limit = effect_limit(dtype)
    found = strongest(stack_effects(members))
    if found is None or found[1] <= limit:
        return
    key, reached = found
    if len(members) == 1:
        effects, strength = members[0]
        fit = largest_fitting_strength(effects[key], limit)
        message = (f"adapter_scale {strength:g} moves {_past_range(key, reached, dtype)}; strengths up to {fit:g} fit "
                   "(the adapter stays cached and serves at those)")  # fmt: skip
        field = "adapter_scale"
    else:
        fit = largest_fitting_strength(reached, limit)
        message = (f"the stack's strengths add up to move {_past_range(key, reached, dtype)}; the stack fits with its "
                   f"strengths multiplied by at most {fit:g} (its adapters stay cached and serve at those)")  # fmt: skip
        field = "adapters"
    raise InvalidRequestError(
        message, reason=ErrorReason.ADAPTER_OUT_OF_RANGE, field=field, layer=key[1], max_scale=f"{fit:g}"
    )
