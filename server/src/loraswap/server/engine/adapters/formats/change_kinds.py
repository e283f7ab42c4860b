"""The kinds of weight change adapters make, one record per kind, each formed exactly as its reference defines it.

An adapter file stores a layer's change as factors; the dense change ΔW (the layer's weight shape) is formed from
them only when a fused swap merges the layer (adapters/residency/layer_writer.py), in float32 (on the CPU, a LoHa or
LoKr that alone changes a layer straight in the weight's dtype: own_dtype_merges.py), and thrown away after: the
cache keeps the factors, about the file's size. The references are the LyCORIS package's functional `diff_weight`
(lycoris-lora 4.1.3: functional/locon.py, loha.py, lokr.py) and its network's forward for the strength and weight
decomposition (modules/*.py `_rebuild_forward`), never its `merge_to`, which scales LoHa and LoKr by alpha/rank
twice:

- `LowRank` (LoRA, LoCon on linear and conv layers; `lora_mid`, a Tucker core): ΔW = γ · up · down, or with a
  core ΔW = γ · (mid ×₁ up ×₂ down); γ = alpha / rank.
- `Hadamard` (LoHa): ΔW = γ · (w1a · w1b) ⊙ (w2a · w2b), each product a Tucker chain with `hada_t1/t2`.
- `Kronecker` (LoKr): ΔW = γ · w1 ⊗ w2, each side stored whole or as a product (`w2` also with a core
  `lokr_t2`); γ = alpha / rank, the rank of the side that is a product (w1's first), and 1 when both sides are
  whole: a whole factor ignores alpha, so a placeholder alpha beside two whole factors scales nothing.
- `Full` (`diff`): ΔW itself.
- `RowsOf`: some rows of another change's ΔW, for a layer a file stores stacked with others by rows (BFL Flux's
  qkv); `change_rows` cuts the factors themselves where a kind's rows are a factor's rows (LoRA's up, LoHa's a
  factors, a full difference), so only LoKr forms the stack's ΔW to cut it.

Alpha follows kohya and LyCORIS: absent or 0 means alpha = rank (γ = 1).

What goes beside ΔW on a layer (a bias change, a DoRA magnitude) and how a merge applies it at a strength is
`LayerChange`'s (weight_changes.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


def rank_scale(alpha: float | None, rank: int) -> float:
    """alpha / rank, where an absent or zero alpha means alpha = rank (kohya, LyCORIS)."""
    return 1.0 if alpha is None or alpha == 0 else alpha / rank


def f32(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device` in float32 (the dtype every ΔW is formed in)."""
    return tensor.to(device=device, non_blocking=True).to(torch.float32)


def _tucker(core: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """core ×₁ up ×₂ down: (rank, rank, *k) with up (rank, out) and down (rank, in) -> (out, in, *k)."""
    return torch.einsum("i j ..., i p, j r -> p r ...", core, up, down)


@dataclass(frozen=True)
class LowRank:
    """LoRA / LoCon: down (rank, in, *k), up (out, rank, *1), with a Tucker `mid` (rank, rank, *k) down is
    (rank, in, *1)."""

    down: torch.Tensor
    up: torch.Tensor
    mid: torch.Tensor | None
    scale: float

    kind = "lora"

    @property
    def rank(self) -> int:
        return self.down.shape[0]

    @property
    def product_rank(self) -> int:
        """The rank of the products a merge forms, per weight element (--fuse auto's merge cost)."""
        return self.rank

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(tensor for tensor in (self.down, self.up, self.mid) if tensor is not None)

    def dense(self, device: torch.device, shape: tuple[int, ...]) -> torch.Tensor:
        """ΔW in its own shape (`shape`, the layer's, only tells a conv's window where a kind stores it flat)."""
        up = f32(self.up, device).reshape(self.up.shape[0], -1) * self.scale
        down = f32(self.down, device).reshape(self.rank, -1)
        if self.mid is None:
            return (up @ down).reshape(up.shape[0], *self.down.shape[1:])
        return _tucker(f32(self.mid, device), up.transpose(0, 1), down)

    row_period = 1

    def dense_rows(self, device: torch.device, start: int, stop: int, shape: tuple[int, ...]) -> torch.Tensor:
        """Rows [start, stop) of ΔW, flattened to (rows, in * k) (`shape`, the layer's weight: see dense)."""
        up = f32(self.up[start:stop], device).reshape(stop - start, -1) * self.scale
        if self.mid is None:
            return up @ f32(self.down, device).reshape(self.rank, -1)
        return _tucker(f32(self.mid, device), up.transpose(0, 1), f32(self.down, device).reshape(self.rank, -1)
                       ).reshape(stop - start, -1)  # fmt: skip


@dataclass(frozen=True)
class Hadamard:
    """LoHa: w1a (out, rank), w1b (rank, in * k), likewise w2; with Tucker cores t1, t2 (rank, rank, *k) the a
    factors are (rank, out) and the b factors (rank, in)."""

    w1a: torch.Tensor
    w1b: torch.Tensor
    w2a: torch.Tensor
    w2b: torch.Tensor
    t1: torch.Tensor | None
    t2: torch.Tensor | None
    scale: float

    kind = "loha"

    @property
    def rank(self) -> int:
        return self.w1b.shape[0]

    @property
    def product_rank(self) -> int:
        return 2 * self.rank  # two products, w1a w1b and w2a w2b

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for t in (self.w1a, self.w1b, self.w2a, self.w2b, self.t1, self.t2) if t is not None)

    def dense(self, device: torch.device, shape: tuple[int, ...]) -> torch.Tensor:
        w1a, w1b, w2a, w2b = (f32(t, device) for t in (self.w1a, self.w1b, self.w2a, self.w2b))
        if self.t1 is None:
            first = w1a.reshape(w1a.shape[0], -1) @ w1b.reshape(w1b.shape[0], -1)
            second = w2a.reshape(w2a.shape[0], -1) @ w2b.reshape(w2b.shape[0], -1)
        else:
            first = torch.einsum("i j ..., j r, i p -> p r ...", f32(self.t1, device), w1b, w1a)
            second = torch.einsum("i j ..., j r, i p -> p r ...", f32(self.t2, device), w2b, w2a)
        return first * second * self.scale

    row_period = 1

    def dense_rows(self, device: torch.device, start: int, stop: int, shape: tuple[int, ...]) -> torch.Tensor:
        """Rows [start, stop) of ΔW, flattened to (rows, in * k): the a factors' rows, the b factors whole."""
        if self.t1 is None:
            first = f32(self.w1a[start:stop], device) @ f32(self.w1b, device).reshape(self.rank, -1)
            second = f32(self.w2a[start:stop], device) @ f32(self.w2b, device).reshape(self.rank, -1)
        else:
            first = torch.einsum("i j ..., j r, i p -> p r ...", f32(self.t1, device), f32(self.w1b, device),
                                 f32(self.w1a[:, start:stop], device))  # fmt: skip
            second = torch.einsum("i j ..., j r, i p -> p r ...", f32(self.t2, device), f32(self.w2b, device),
                                  f32(self.w2a[:, start:stop], device))  # fmt: skip
        return first.mul_(second).reshape(stop - start, -1).mul_(self.scale)


@dataclass(frozen=True)
class Kronecker:
    """LoKr: w1 (a, c) whole or w1a (a, rank) @ w1b (rank, c); w2 (b, d, *k) whole, w2a (b, rank) @ w2b (rank,
    d * k), or with a Tucker core t2 (rank, rank, *k), w2a (rank, b) and w2b (rank, d). ΔW is (a * b, c * d, *k)."""

    w1: torch.Tensor | None
    w1a: torch.Tensor | None
    w1b: torch.Tensor | None
    w2: torch.Tensor | None
    w2a: torch.Tensor | None
    w2b: torch.Tensor | None
    t2: torch.Tensor | None
    scale: float

    kind = "lokr"
    product_rank = 0  # w1 ⊗ w2 is one multiply per element; the sides' own products are small

    @property
    def rank(self) -> int:
        """The rank of the side stored as a product; 0 when both sides are whole."""
        if self.w1a is not None:
            return self.w1a.shape[1]
        if self.w2a is not None:
            return self.w2b.shape[0]
        return 0

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        parts = (self.w1, self.w1a, self.w1b, self.w2, self.w2a, self.w2b, self.t2)
        return tuple(tensor for tensor in parts if tensor is not None)

    def dense(self, device: torch.device, shape: tuple[int, ...]) -> torch.Tensor:
        w1 = f32(self.w1, device) if self.w1 is not None else f32(self.w1a, device) @ f32(self.w1b, device)
        if self.w2 is not None:
            w2 = f32(self.w2, device)
        elif self.t2 is not None:
            w2 = _tucker(f32(self.t2, device), f32(self.w2a, device), f32(self.w2b, device))
        else:
            w2 = f32(self.w2a, device) @ f32(self.w2b, device)
        if w2.dim() == 2 and len(shape) > 2:
            # A conv's w2b is stored flattened as (rank, d * k): the window comes back out of its second axis.
            w2 = w2.reshape(w2.shape[0], -1, *shape[2:])
        for _ in range(w2.dim() - w1.dim()):
            w1 = w1.unsqueeze(-1)
        return torch.kron(w1, w2.contiguous()) * self.scale

    @property
    def row_period(self) -> int:
        """The rows of w2: ΔW's rows come in blocks of that many, w1's row by w1's row."""
        if self.w2 is not None:
            return self.w2.shape[0]
        return self.w2a.shape[1] if self.t2 is not None else self.w2a.shape[0]

    def dense_rows(self, device: torch.device, start: int, stop: int, shape: tuple[int, ...]) -> torch.Tensor:
        """Rows [start, stop) of ΔW (multiples of row_period; `shape`: the layer's weight), flattened to (rows,
        in * k): w1's rows start / period to stop / period, Kronecker with the whole w2."""
        period = self.row_period
        w1 = f32(self.w1, device) if self.w1 is not None else f32(self.w1a, device) @ f32(self.w1b, device)
        part = Kronecker(w1[start // period : stop // period], None, None, self.w2, self.w2a, self.w2b, self.t2,
                         self.scale)  # fmt: skip
        return part.dense(device, shape).reshape(stop - start, -1)


@dataclass(frozen=True)
class Full:
    """A whole weight difference (`diff`), in the layer's weight shape."""

    diff: torch.Tensor

    kind = "full"
    rank = 0
    product_rank = 0
    scale = 1.0

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.diff,)

    def dense(self, device: torch.device, shape: tuple[int, ...]) -> torch.Tensor:
        return f32(self.diff, device)

    row_period = 1

    def dense_rows(self, device: torch.device, start: int, stop: int, shape: tuple[int, ...]) -> torch.Tensor:
        return f32(self.diff[start:stop], device).reshape(stop - start, -1)


Rows = tuple[tuple[int, int], ...]  # [start, stop) ranges, taken in order


def take_rows(tensor: torch.Tensor, rows: Rows, dim: int = 0) -> torch.Tensor:
    """These rows of `tensor` along `dim`: a view when they are one range."""
    parts = [tensor.narrow(dim, start, stop - start) for start, stop in rows]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


@dataclass(frozen=True)
class RowsOf:
    """Rows of another change's ΔW, the change of a layer stored stacked with others (`stacked_shape`)."""

    of: LowRank | Hadamard | Kronecker | Full
    rows: Rows
    stacked_shape: tuple[int, ...]

    @property
    def kind(self) -> str:
        return self.of.kind

    @property
    def rank(self) -> int:
        return self.of.rank

    @property
    def product_rank(self) -> int:
        return self.of.product_rank

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.of.tensors

    def dense(self, device: torch.device, shape: tuple[int, ...]) -> torch.Tensor:
        return take_rows(self.of.dense(device, self.stacked_shape).reshape(self.stacked_shape), self.rows)

    row_period = None  # formed whole, then cut: merged whole


WeightChange = LowRank | Hadamard | Kronecker | Full | RowsOf


def change_rows(change: WeightChange, rows: Rows, stacked_shape: tuple[int, ...]) -> WeightChange:
    """The change of these rows of a stacked layer's `change`: its own factors cut where a kind allows."""
    if isinstance(change, LowRank):  # up is (out, rank, ...) with or without a core
        return dataclasses.replace(change, up=take_rows(change.up, rows))
    if isinstance(change, Hadamard):  # the a factors hold the rows: (out, rank), or (rank, out) beside a core
        dim = 0 if change.t1 is None else 1
        return dataclasses.replace(change, w1a=take_rows(change.w1a, rows, dim), w2a=take_rows(change.w2a, rows, dim))
    if isinstance(change, Full):
        return Full(take_rows(change.diff, rows))
    return RowsOf(change, rows, stacked_shape)
