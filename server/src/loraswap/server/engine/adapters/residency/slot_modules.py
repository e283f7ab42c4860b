"""The swap slot's LoRA factor modules: lora_A behind a per-rank gate, and both computing at a rank bucket.

Each slot layer's lora_A is a `RankGatedLinear`: its output passes through a boolean gate with one
entry per rank, so the ranks beyond the resident adapter's contribute exactly zero whatever the
weights there hold. Why the gate is exact: `torch.where` yields 0 for a closed rank even if the stale
projection overflowed, and lora_B then multiplies those zeros by stale values that are finite, because
every value ever written into lora_B is (formats/tensor_checks.py checks each adapter's lora_B times the largest
allowed strength against the model dtype's range).

Rank buckets (rank_buckets.py): both factors compute with only their first `rank_bucket` ranks, views
of the same max-rank tensors, so swaps still copy into fixed addresses. The bucket is a plain int,
which dynamo specialises each graph on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class _SlotFactor(torch.nn.Linear):
    """A bias-free linear layer over the very weight PEFT created for a slot factor (nothing is copied)."""

    def __init__(self, factor: torch.nn.Linear) -> None:
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = factor.in_features, factor.out_features
        self.weight = factor.weight
        self.register_parameter("bias", None)


class RankGatedLinear(_SlotFactor):
    """A bias-free lora_A computing its first `rank_bucket` ranks, switched on and off by the `rank_gate` buffer."""

    def __init__(self, lora_a: torch.nn.Linear) -> None:
        super().__init__(lora_a)
        gate = torch.zeros(lora_a.out_features, dtype=torch.bool, device=lora_a.weight.device)
        self.register_buffer("rank_gate", gate, persistent=False)
        self.rank_bucket = lora_a.out_features  # a plain int: dynamo specialises each graph on it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bucket = self.rank_bucket
        if bucket == self.out_features:
            return torch.where(self.rank_gate, F.linear(x, self.weight), 0.0)
        return torch.where(self.rank_gate[:bucket], F.linear(x, self.weight[:bucket]), 0.0)


class RankBucketedLinear(_SlotFactor):
    """A bias-free lora_B reading only its first `rank_bucket` ranks: those its RankGatedLinear computes."""

    def __init__(self, lora_b: torch.nn.Linear) -> None:
        super().__init__(lora_b)
        self.rank_bucket = lora_b.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bucket = self.rank_bucket
        # A view of the first columns: strided rows that matmul reads in place, never a copy of the weight.
        return F.linear(x, self.weight if bucket == self.in_features else self.weight[:, :bucket])
