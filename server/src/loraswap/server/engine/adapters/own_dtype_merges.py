"""Merges on the CPU written straight into a layer's weight in its own dtype (bfloat16 or float32), W0 read once.

The CPU's bfloat16 and float32 products (torch.mm, torch.addmm: oneDNN, AMX where the CPU has it) accumulate in
float32 and round once into their output, and its pointwise kernels compute bfloat16 in float32; so a layer that
one kind of change alone alters needs no float32 block (fused.py's general path), and costs about what one product
costs:
- plain LoRAs at one alpha (the slot's factors, LoRA / LoCon changes): weight = W0 + alpha * B A, one addmm;
- one LoHa without Tucker cores: each block of rows forms its two products w1a w1b and w2a w2b in the weight's
  dtype, then weight = W0 + alpha * first ⊙ second (one addcmul);
- one LoKr: w1 and w2 formed whole in the weight's dtype (the sides are small), then weight = W0 + alpha * w1 ⊗ w2
  as one broadcast addcmul over the weight viewed as (w1 rows, w2 rows, w1 columns, w2 columns).
LoHa's and a decomposed LoKr side's products are rounded to the factors' dtype, as the LyCORIS reference forms
them in the file's dtype; the merge then rounds once. The same change always writes the same bits.

Each merge first bounds |W0 + alpha ΔW| from the factors' largest values: below the dtype's largest value nothing
can overflow and the weight needs no finiteness pass; otherwise every block is checked while it is in cache.
"""

from __future__ import annotations

import torch

from loraswap.server.engine.adapters.weight_changes import Hadamard, Kronecker, LayerChange

# Weight dtypes these merges write (float16 products could overflow where the reference's float32 would not).
OWN_DTYPES = (torch.bfloat16, torch.float32)
# A LoHa's merge goes a block of rows at a time, each of its two products in a scratch of this many elements (on
# SDXL's shapes 4 MiB of bfloat16 per product is the fastest: smaller blocks pay per-call overhead, larger ones
# leave the cache).
LOHA_BLOCK_ELEMENTS = 1 << 21


def all_finite(tensor: torch.Tensor) -> torch.Tensor:
    """Whether every value is finite, as a device tensor: its float32 sum is (an inf or a NaN makes any sum inf or
    NaN), at a tenth of torch.isfinite's cost on the CPU. Finite values whose sum overflows float32 (a weight
    near 1e38) count as not finite: a merge that makes them is refused too."""
    return torch.isfinite(tensor.sum(dtype=torch.float32))


def _largest(tensor: torch.Tensor) -> float:
    return float(tensor.abs().amax())


def may_overflow(w0_largest: float, change_largest: float, alpha: float, dtype: torch.dtype) -> bool:
    """Whether |W0 + alpha ΔW| <= max|W0| + |alpha| max|ΔW| may reach the dtype's largest value."""
    return not w0_largest + abs(alpha) * change_largest < torch.finfo(dtype).max


def write_lora(
    weight: torch.Tensor,
    w0: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    alpha: float,
    w0_largest: float,
    block_elements: int,
) -> torch.Tensor:
    """weight = W0 + alpha * B A as one torch.addmm into the weight: the exact merge with no float32 scratch, what
    floor_fuse times; where it may overflow, `block_elements` at a time, each block checked while in cache. Returns
    whether the result is finite (a device tensor)."""
    weight, w0 = weight.view(w0.shape[0], -1), w0.view(w0.shape[0], -1)  # a conv's window flattened
    # |B A| <= rank max|B| max|A|.
    if not may_overflow(w0_largest, a.shape[0] * _largest(b) * _largest(a), alpha, w0.dtype):
        torch.addmm(w0, b, a, alpha=alpha, out=weight)
        return torch.ones((), dtype=torch.bool)
    block_rows = max(1, block_elements // w0.shape[1])
    finite = []
    for start in range(0, w0.shape[0], block_rows):
        stop = min(w0.shape[0], start + block_rows)
        written = weight[start:stop]
        torch.addmm(w0[start:stop], b[start:stop], a, alpha=alpha, out=written)
        finite.append(all_finite(written))
    return torch.stack(finite).all()


def own_dtype_change(change: LayerChange, dtype: torch.dtype) -> bool:
    """Whether write_change merges this change: a LoHa without Tucker cores or a LoKr, with no weight
    decomposition, its factors in the weight's dtype."""
    kind = change.change
    if change.dora_scale is not None or dtype not in OWN_DTYPES:
        return False
    if isinstance(kind, Hadamard):
        # Both products of one rank, a factors (out, rank): the shapes the per-block products take.
        own = kind.t1 is None and kind.w1a.dim() == kind.w2a.dim() == 2 and kind.w1b.shape[0] == kind.w2b.shape[0]
    elif isinstance(kind, Kronecker):
        # w1 a matrix (whole, or a product of matrices): the shape the broadcast view takes.
        own = kind.w1.dim() == 2 if kind.w1 is not None else kind.w1a.dim() == kind.w1b.dim() == 2
    else:
        own = False
    return own and all(tensor.dtype == dtype for tensor in kind.tensors)


def write_change(
    weight: torch.Tensor, w0: torch.Tensor, change: LayerChange, alpha: float, w0_largest: float, scratch: torch.Tensor
) -> torch.Tensor:
    """weight = W0 + alpha * ΔW for a change own_dtype_change accepts (alpha: the strength; the kind's own alpha /
    rank is applied here); `scratch`: at least 2 * LOHA_BLOCK_ELEMENTS of the weight's dtype. Returns whether the
    result is finite (a device tensor)."""
    kind = change.change
    if isinstance(kind, Hadamard):
        return _write_hadamard(weight, w0, kind, alpha * kind.scale, w0_largest, scratch)
    return _write_kronecker(weight, w0, kind, alpha * kind.scale, w0_largest)


def _write_hadamard(
    weight: torch.Tensor, w0: torch.Tensor, loha: Hadamard, alpha: float, w0_largest: float, scratch: torch.Tensor
) -> torch.Tensor:
    weight, w0 = weight.view(w0.shape[0], -1), w0.view(w0.shape[0], -1)
    w1b, w2b = loha.w1b.reshape(loha.rank, -1), loha.w2b.reshape(loha.rank, -1)
    # |first| <= rank max|w1a| max|w1b|, likewise second: each product must fit the dtype too, not only theirs.
    first_largest = loha.rank * _largest(loha.w1a) * _largest(w1b)
    second_largest = loha.rank * _largest(loha.w2a) * _largest(w2b)
    largest_value = torch.finfo(w0.dtype).max
    checked = not (first_largest < largest_value and second_largest < largest_value) or may_overflow(
        w0_largest, first_largest * second_largest, alpha, w0.dtype
    )
    columns = w0.shape[1]
    block_rows = max(1, LOHA_BLOCK_ELEMENTS // columns)
    finite = []
    for start in range(0, w0.shape[0], block_rows):
        stop = min(w0.shape[0], start + block_rows)
        elements = (stop - start) * columns
        first = scratch[:elements].view(stop - start, columns)
        second = scratch[LOHA_BLOCK_ELEMENTS : LOHA_BLOCK_ELEMENTS + elements].view(stop - start, columns)
        torch.mm(loha.w1a[start:stop], w1b, out=first)
        torch.mm(loha.w2a[start:stop], w2b, out=second)
        written = weight[start:stop]
        torch.addcmul(w0[start:stop], first, second, value=alpha, out=written)
        if checked:
            finite.append(all_finite(written))
    return torch.stack(finite).all() if finite else torch.ones((), dtype=torch.bool)


def _write_kronecker(
    weight: torch.Tensor, w0: torch.Tensor, lokr: Kronecker, alpha: float, w0_largest: float
) -> torch.Tensor:
    w1 = lokr.w1 if lokr.w1 is not None else lokr.w1a @ lokr.w1b
    if lokr.w2 is not None:
        w2 = lokr.w2
    elif lokr.t2 is not None:
        # Two contractions: formed in float32 and rounded once (einsum's low-precision chain rounds in between).
        w2 = torch.einsum("i j ..., i p, j r -> p r ...", *(t.float() for t in (lokr.t2, lokr.w2a, lokr.w2b)))
        w2 = w2.to(w0.dtype)
    else:
        w2 = lokr.w2a @ lokr.w2b
    w2 = w2.reshape(w2.shape[0], -1)  # (b, d * window): a conv's window stays w2's, inside each of w1's columns
    (a, c), (b, d_window) = w1.shape, w2.shape
    weight_blocks, w0_blocks = weight.view(a, b, c, d_window), w0.view(a, b, c, d_window)
    torch.addcmul(w0_blocks, w1.view(a, 1, c, 1), w2.view(1, b, 1, d_window), value=alpha, out=weight_blocks)
    if may_overflow(w0_largest, _largest(w1) * _largest(w2), alpha, w0.dtype):
        return all_finite(weight)
    return torch.ones((), dtype=torch.bool)
