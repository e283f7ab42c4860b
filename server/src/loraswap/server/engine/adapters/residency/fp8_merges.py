"""Fused merges into float8 weights: W = quantize_fp8(W0 + s B A), written into the tensors the graphs hold.

`--quantize fp8` stores each base linear weight as torchao's `Float8Tensor` (Float8DynamicActivationFloat8WeightConfig,
per-tensor scales): a wrapper of the model's dtype (bfloat16 on CUDA) around two plain tensors, `qdata`
(float8_e4m3fn, the weight's shape) and `scale` (float32, shape (1, 1)), with W ≈ qdata * scale. torchao makes them
from the bfloat16 weight h (`Float8Tensor.from_hp`, quant_primitives `_choose_scale_float8` and
`_quantize_affine_float8`):
    scale = (max|h| / 448, in h's dtype) as float32        448: float8_e4m3fn's largest value
    qdata = float8(clamp(float32(h) / scale, -448, 448))

A fused merge writes what torchao would make of the fused weight in the model's dtype (the bfloat16 the unquantized
fused path writes: W0 + s B A accumulated in float32, rounded once):
- from the pristine bfloat16 copy, never from a float8 state, so the same stack always writes the same bits, and
  an empty change writes back exactly what start-up's quantization made;
- into the same `qdata` and `scale` tensors, so compiled graphs (and CUDA graphs) keep their inputs and addresses:
  nothing recompiles;
- with no host sync (max|h| stays on the device) and nothing allocated of a layer's size: one reduction for max|h|,
  torchao's own `_choose_scale_float8` on that one value (the scale's rounding is theirs), and one division
  written straight into `qdata` as float8 (on CUDA cast as it is stored: h read once, qdata written once; the
  CPU's TensorIterator stages the quotient in a float32 temporary).

The clamp is left out: with a scale of at least float32's smallest normal, |h| / scale is at most 448 (1 + 2^-8)
(the scale is max|h| / 448 rounded to h's dtype), which float8_e4m3fn rounds to 448 with or without the clamp,
saturating cast or not. `scales_in_range` reads False for the scales where that does not hold: a merge that is not
finite, and a layer that is all zeros (torchao itself quantizes one to NaN: 0 / 0).

torchao is imported only by the functions that write or check float8 weights; `is_float8_weight` never imports it
(no float8 weight exists before --quantize fp8 has imported it).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence

import torch

# Where torchao 0.18 defines Float8Tensor (also exported as torchao.quantization.Float8Tensor).
_FLOAT8_TENSOR_MODULE = "torchao.quantization.quantize_.workflows.float8.float8_tensor"
# The smallest scale for which the division needs no clamp (see the module docstring).
_SMALLEST_SCALE = torch.finfo(torch.float32).tiny


def is_float8_weight(tensor: torch.Tensor) -> bool:
    """Whether a weight is a torchao Float8Tensor (what --quantize fp8 made of it). Never imports torchao."""
    module = sys.modules.get(_FLOAT8_TENSOR_MODULE)
    return module is not None and isinstance(tensor, module.Float8Tensor)


@torch.no_grad()
def write_fp8(weight: torch.Tensor, merged: torch.Tensor, rounded: torch.Tensor | None = None) -> None:
    """Make a per-tensor float8 weight hold torchao's quantization of `merged` rounded to the weight's dtype, in place.

    `merged`: W0 + the change, of the weight's shape, in the weight's dtype (`weight.dtype`: the model's, bfloat16 on
    CUDA) or in float32. A float32 one is first rounded to the weight's dtype into `rounded` (a scratch of that dtype
    with at least weight.numel() elements; None: one is allocated), as torchao quantizes a weight of that dtype.

    Afterwards `weight.qdata` and `weight.scale` (the same tensors, at the same addresses) hold, bit for bit, what
    `reference_fp8(merged, weight)` returns, whenever `scales_in_range` reads True for the weight. Nothing of the
    layer's size is allocated (given `rounded`) and nothing waits for the device.

    Raises:
        ValueError: the weight is not a per-tensor float8 weight, or `merged` has another shape or dtype.
    """
    if not is_float8_weight(weight) or weight.scale.numel() != 1:
        raise ValueError(f"write_fp8 writes per-tensor torchao float8 weights, not {type(weight).__name__}")
    if merged.shape != weight.shape or merged.dtype not in (weight.dtype, torch.float32):
        raise ValueError(
            f"a merge of shape {tuple(merged.shape)} and dtype {merged.dtype} cannot be written into a float8 weight "
            f"of shape {tuple(weight.shape)} and dtype {weight.dtype}"
        )
    high = merged
    if merged.dtype != weight.dtype:
        if rounded is None:
            rounded = torch.empty(weight.numel(), dtype=weight.dtype, device=merged.device)
        high = rounded.view(-1)[: weight.numel()].view(weight.shape)
        high.copy_(merged)
    # max|h| is exact in h's dtype; inf-norm reductions propagate NaN (SharedReduceOps' AbsMaxOps).
    largest = torch.linalg.vector_norm(high, float("inf")).view(1, 1)
    scale = _torchao().choose_scale(largest, block_size=[1, 1], float8_dtype=weight.qdata.dtype)
    weight.scale.copy_(scale)
    # float32(h) / scale (bfloat16 over float32 computes in float32), cast to float8 as it is stored.
    torch.div(high, weight.scale, out=weight.qdata)


def scales_in_range(weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per float8 weight, whether its scale is finite and at least float32's smallest normal (a bool device tensor
    of len(weights), read when the caller chooses: one check for a whole merge, no sync here). False means the merge
    written was not finite (or the layer is all zeros, which float8 per-tensor scales cannot hold)."""
    scales = torch.cat([weight.scale.reshape(1) for weight in weights])
    return (scales >= _SMALLEST_SCALE) & (scales <= torch.finfo(torch.float32).max)


def reference_fp8(merged: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(qdata, scale): torchao's own quantization (Float8Tensor.from_hp, per tensor) of `merged` rounded to the dtype
    of the float8 weight `like`, freshly allocated: what write_fp8 must write, for tests and checks."""
    ao = _torchao()
    reference = ao.Float8Tensor.from_hp(
        merged.to(like.dtype), float8_dtype=like.qdata.dtype, granularity=ao.PerTensor()
    )
    return reference.qdata, reference.scale


class _TorchaoFloat8:
    """The torchao pieces used here, imported once, on first use."""

    def __init__(self) -> None:
        from torchao.quantization.granularity import PerTensor
        from torchao.quantization.quant_primitives import _choose_scale_float8
        from torchao.quantization.quantize_.workflows.float8.float8_tensor import Float8Tensor

        self.choose_scale = _choose_scale_float8
        self.Float8Tensor = Float8Tensor
        self.PerTensor = PerTensor


@functools.cache
def _torchao() -> _TorchaoFloat8:
    # Called only with a float8 weight in hand or to make a reference: torchao is imported by then (--quantize fp8).
    return _TorchaoFloat8()
