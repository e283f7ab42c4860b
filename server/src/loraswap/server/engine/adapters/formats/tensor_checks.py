"""The checks an adapter's tensors pass before use: not degenerate, floating point, finite in the model's dtype.

An adapter file is untrusted input. A 0-dimensional or empty factor is refused before any converter divides by a
rank or indexes a shape; a slot layer's factors (and a fused layer's DoRA magnitude or lora_B bias) are checked once
converted to the model's dtype, lora_B finite at every allowed strength, which the swap slot relies on
(adapters/residency/slot.py); a refusal says whether the file holds NaN or infinities or values too large for the
model's dtype.
"""

from __future__ import annotations

import math

import torch

from loraswap.server.engine.errors import AdapterFormatError, ErrorReason, shorten
from loraswap.server.engine.scale_limits import MAX_ADAPTER_SCALE


def check_tensors(state_dict: dict[str, torch.Tensor]) -> None:
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


def alpha_value(layer: str, alpha: torch.Tensor) -> float:
    """The one number a layer's alpha tensor holds (`layer`: as the file names it, for the message). Raises
    ADAPTER_SHAPE_MISMATCH for an alpha of more than one value."""
    if alpha.numel() != 1:
        raise AdapterFormatError(
            f"layer {shorten(layer)} has an alpha of shape {tuple(alpha.shape)}; alpha is one number",
            reason=ErrorReason.ADAPTER_SHAPE_MISMATCH,
        )
    return float(alpha.reshape(()).to(torch.float64))


def check_dtype(key: str, tensor: torch.Tensor) -> None:
    """Refuse a tensor that is not floating point."""
    if not tensor.is_floating_point():
        raise AdapterFormatError(
            f"tensor {shorten(key)} has dtype {tensor.dtype}; LoRA weights must be floating point",
            reason=ErrorReason.ADAPTER_BAD_DTYPE,
        )


def refuse_non_finite(key: str, raw: torch.Tensor, converted: torch.Tensor) -> None:
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


def check_a(key: str, raw: torch.Tensor, a: torch.Tensor) -> None:
    """lora_A (`a`, the model-dtype form of `raw`) must be finite."""
    # One reduction instead of an element-wise pass: any NaN or inf makes the sum non-finite.
    # A finite tensor whose sum overflows only costs the exact check below.
    if not math.isfinite(float(a.sum())) and not torch.isfinite(a).all():
        refuse_non_finite(key, raw, a)


def check_b(key: str, raw: torch.Tensor, b: torch.Tensor) -> None:
    """lora_B must stay finite at every allowed strength: the slot relies on that (see slot.py)."""
    low, high = torch.aminmax(b)  # one pass; NaN propagates, inf shows up in low or high
    largest = max(-float(low), float(high))
    if not math.isfinite(largest):
        refuse_non_finite(key, raw, b)
    limit = torch.finfo(b.dtype).max / MAX_ADAPTER_SCALE
    if largest > limit:
        raise AdapterFormatError(
            f"tensor {shorten(key)} has values up to {largest:.3g}; at the largest strength ({MAX_ADAPTER_SCALE}) "
            f"they would overflow the model's dtype {str(b.dtype).removeprefix('torch.')}, so values must stay within {limit:.3g}",
            reason=ErrorReason.ADAPTER_OUT_OF_RANGE,
        )
