"""A layer's weight change: one kind's ΔW (change_kinds.py) and what goes beside it, and how a merge applies it.

`LayerChange` adds to ΔW `bias` (`diff_b`, or a trained bias), and `dora_scale`, the per-row (or per-column)
magnitude of a weight-decomposed (DoRA) adapter. At strength s a layer then holds
- W0 + s · ΔW (and b0 + s · bias), or
- with `dora_scale` m, as LyCORIS's forward computes it (modules/*.py `_rebuild_forward`): W = W0 + ΔW,
  W' = W · (s · (m / (‖W‖ + ε) − 1) + 1), the norm over each output row (or each input column, when m is shaped
  (1, in, ...)).
A fused swap (adapters/residency/layer_writer.py) merges it with `add_to`, or row block by row block with `add_rows`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from loraswap.server.engine.adapters.formats.change_kinds import Rows, WeightChange, change_rows, f32, take_rows


def held_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes these tensors hold, each storage counted once (the rows of a stacked layer share theirs)."""
    storages = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


@dataclass(frozen=True)
class LayerChange:
    """One layer's change: ΔW's factors (None: the bias alone changes), a bias change, a DoRA magnitude."""

    change: WeightChange | None
    bias: torch.Tensor | None = None
    dora_scale: torch.Tensor | None = None
    # ε of the weight decomposition's norm: LyCORIS takes that of the magnitude's stored dtype.
    dora_eps: float = 0.0

    @property
    def kind(self) -> str:
        if self.change is None:
            return "bias"
        return f"{self.change.kind}+dora" if self.dora_scale is not None else self.change.kind

    @property
    def rank(self) -> int:
        return self.change.rank if self.change is not None else 0

    @property
    def product_rank(self) -> int:
        return self.change.product_rank if self.change is not None else 0

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        own = self.change.tensors if self.change is not None else ()
        return own + tuple(tensor for tensor in (self.bias, self.dora_scale) if tensor is not None)

    @property
    def nbytes(self) -> int:
        return held_bytes(self.tensors)

    def per_row_dora(self) -> bool:
        """Whether the weight decomposition's norms are over output rows (LyCORIS wd_on_output, the default)."""
        scale = self.dora_scale
        return scale is not None and (scale.dim() == 1 or scale.shape[1] == 1)

    def rows(self, rows: Rows, stacked_shape: tuple[int, ...]) -> LayerChange:
        """The change of these rows of a stacked layer this change is of. Raises ValueError for a weight
        decomposition normalised over input columns: its norms span every layer of the stack."""
        dora_scale = self.dora_scale
        if dora_scale is not None:
            if not self.per_row_dora():
                raise ValueError("a weight decomposition normalised over input columns spans every stacked layer")
            dora_scale = take_rows(dora_scale, rows)
        return LayerChange(
            change_rows(self.change, rows, stacked_shape) if self.change is not None else None,
            take_rows(self.bias, rows) if self.bias is not None else None,
            dora_scale,
            self.dora_eps,
        )

    def dense_delta(self, device: torch.device, shape: tuple[int, ...]) -> torch.Tensor:
        """ΔW at strength 1, float32, in the weight's `shape`: the rebuild viewed in the layer's shape, as LyCORIS
        views it (a conv's 1x1 factors on a linear layer, or the reverse). On the meta device this only checks
        shapes, which is how a file's layer is validated before any merge (ValueError or RuntimeError)."""
        delta = self.change.dense(device, shape)
        if delta.shape[0] != shape[0] or delta.numel() != math.prod(shape):
            raise ValueError(f"the change is {tuple(delta.shape)}, the layer's weight {shape}")
        return delta.reshape(shape)

    @property
    def row_period(self) -> int | None:
        """The row blocks a merge may form this change's ΔW in (add_rows): any multiple of this many rows; None
        when only the whole layer at once can (a change cut from a stacked one, a DoRA normalised per column)."""
        if self.change is None:
            return 1
        if self.dora_scale is not None and not self.per_row_dora():
            return None
        return self.change.row_period

    def add_rows(
        self, block: torch.Tensor, w0_rows: torch.Tensor, strength: float, rows: tuple[int, int], shape: tuple[int, ...]
    ) -> None:
        """block (float32: `rows` of the weight, of `shape`, flattened to (rows, in * k)) += this change's rows at
        `strength`, as add_to adds them; w0_rows: the same rows of the pristine weight (float32). Rows do not mix
        in any kind's ΔW nor in a per-row weight decomposition."""
        if self.change is None:
            return
        start, stop = rows
        delta = self.change.dense_rows(block.device, start, stop, shape)
        if self.dora_scale is None:
            block.add_(delta, alpha=strength)
            return
        weight = delta.add_(w0_rows)
        magnitude = f32(self.dora_scale[start:stop], block.device).reshape(stop - start, 1)
        block.add_(weight.mul_(self._dora_factor(magnitude, weight.norm(dim=1, keepdim=True), strength))).sub_(w0_rows)

    def _dora_factor(self, magnitude: torch.Tensor, norm: torch.Tensor, strength: float) -> torch.Tensor:
        """What W = W0 + ΔW is multiplied by at `strength`: s · (m / (‖W‖ + ε) − 1) + 1."""
        factor = magnitude / (norm + self.dora_eps)
        return factor if strength == 1 else strength * (factor - 1) + 1

    def add_to(self, merged: torch.Tensor, w0: torch.Tensor, strength: float) -> None:
        """merged (float32, the weight's shape) += this layer's change at `strength`; w0 is the pristine weight."""
        if self.change is None:
            return
        delta = self.dense_delta(merged.device, tuple(merged.shape))
        if self.dora_scale is None:
            merged.add_(delta, alpha=strength)
            return
        weight = delta.add_(w0)  # W = W0 + ΔW, at strength 1
        magnitude = f32(self.dora_scale, merged.device)
        if self.per_row_dora():
            norm = weight.reshape(weight.shape[0], -1).norm(dim=1)
            norm = norm.reshape(weight.shape[0], *[1] * (weight.dim() - 1))
        else:
            norm = weight.transpose(0, 1).reshape(weight.shape[1], -1).norm(dim=1)
            norm = norm.reshape(weight.shape[1], *[1] * (weight.dim() - 1)).transpose(0, 1)
        merged.add_(weight.mul_(self._dora_factor(magnitude.reshape(norm.shape), norm, strength))).sub_(w0)


def dora_eps(stored: torch.Tensor) -> float:
    """LyCORIS's ε for a weight decomposition whose magnitude was stored as `stored`."""
    return float(torch.finfo(stored.dtype).eps) if stored.is_floating_point() else float(torch.finfo().eps)
