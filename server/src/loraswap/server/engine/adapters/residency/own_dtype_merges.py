"""Merges written straight into a layer's weight in its own dtype (bfloat16 or float32), W0 read once.

bfloat16 and float32 products (torch.mm, torch.addmm: oneDNN, AMX where the CPU has it; cuBLAS on a GPU) accumulate
in float32 and round once into their output, and pointwise kernels compute bfloat16 in float32; so a layer that
one kind of change alone alters needs no float32 block (layer_writer.py's general path), and costs about what one
product costs:
- plain LoRAs at one alpha (the slot's factors, LoRA / LoCon changes): weight = W0 + alpha * B A, one addmm;
- one LoHa without Tucker cores: each block of rows forms its two products w1a w1b and w2a w2b in the weight's
  dtype, then weight = W0 + alpha * first ⊙ second (one addcmul);
- one LoKr: w1 and w2 formed whole in the weight's dtype (the sides are small), then weight = W0 + alpha * w1 ⊗ w2
  as one broadcast addcmul over the weight viewed as (w1 rows, w2 rows, w1 columns, w2 columns).
LoHa's and a decomposed LoKr side's products are rounded to the factors' dtype, as the LyCORIS reference forms
them in the file's dtype; the merge then rounds once. The same change always writes the same bits.

The caller bounds |W0 + alpha ΔW| from figures taken once (W0's largest value at start-up, the change's largest
|ΔW| where the adapter loaded: change_effects.py): below the dtype's largest value nothing can overflow, the weight
needs no finiteness pass and nothing waits for the device; otherwise every block is checked while it is in cache.
The same functions run on a CUDA device (cuBLAS's bfloat16 products accumulate in float32 and round once too).
"""

from __future__ import annotations

import torch

from loraswap.server.engine.adapters.formats import Hadamard, Kronecker, LayerChange

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


def write_lora(
    weight: torch.Tensor,
    w0: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    alpha: float,
    check: bool,
    block_elements: int | None = None,
) -> torch.Tensor | None:
    """weight = W0 + alpha * B A as one torch.addmm into the weight (bfloat16 operands accumulate in float32 and round
    once, on the CPU and in cuBLAS alike): the exact merge with no float32 scratch, what floor_fuse times. `check`
    (the caller's bound of the result reaches the dtype's largest value): the result's finiteness is returned, as
    a device tensor, `block_elements` at a time while each block is in cache (None: the whole layer); else None,
    and nothing waits for or reads the device."""
    weight, w0 = weight.view(w0.shape[0], -1), w0.view(w0.shape[0], -1)  # a conv's window flattened
    if not check:
        torch.addmm(w0, b, a, alpha=alpha, out=weight)
        return None
    block_rows = max(1, (block_elements or w0.numel()) // w0.shape[1])
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
    weight: torch.Tensor, w0: torch.Tensor, change: LayerChange, alpha: float, check: bool, scratch: torch.Tensor
) -> torch.Tensor | None:
    """weight = W0 + alpha * ΔW for a change own_dtype_change accepts, its tensors on the weight's device (alpha: the
    strength; the kind's own alpha / rank is applied here); `scratch`: at least 2 * LOHA_BLOCK_ELEMENTS of the
    weight's dtype. `check`: return whether the result is finite (a device tensor), else None with nothing read."""
    kind = change.change
    if isinstance(kind, Hadamard):
        return _write_hadamard(weight, w0, kind, alpha * kind.scale, check, scratch)
    return _write_kronecker(weight, w0, kind, alpha * kind.scale, check)


def _write_hadamard(
    weight: torch.Tensor, w0: torch.Tensor, loha: Hadamard, alpha: float, check: bool, scratch: torch.Tensor
) -> torch.Tensor | None:
    weight, w0 = weight.view(w0.shape[0], -1), w0.view(w0.shape[0], -1)
    w1b, w2b = loha.w1b.reshape(loha.rank, -1), loha.w2b.reshape(loha.rank, -1)
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
        if check:
            finite.append(all_finite(written))
    return torch.stack(finite).all() if finite else None


def _write_kronecker(
    weight: torch.Tensor, w0: torch.Tensor, lokr: Kronecker, alpha: float, check: bool
) -> torch.Tensor | None:
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
    return all_finite(weight) if check else None
