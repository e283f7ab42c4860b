"""The resident swap slot: max-rank LoRA weights on every targeted layer, rewritten in place.

The slot is a PEFT LoRA adapter loaded once at start-up (zero-effect, max rank, alpha == rank so
PEFT's own scaling is 1) before the denoiser is compiled. Afterwards nothing about it changes but the
values of its tensors: no config, no scaling, no shapes, so compiled graphs never see a difference.
Its lora_A / lora_B are the rank-gated modules of slot_modules.py.

`HotswapSlot` writes: it executes a `StackCopy` (planned by swap_plan.py: the copies, one
`torch._foreach_*` call each, then the gates of the layers whose rank changed) into the same tensors
every time, so CUDA graphs captured from the slot stay valid; and it sets the rank bucket every slot
module computes at. What is resident, and which bucket, is decided by residency.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraswap.server.engine.adapters.residency.copy_stream import CopyStream
from loraswap.server.engine.adapters.residency.slot_modules import RankBucketedLinear, RankGatedLinear
from loraswap.server.engine.adapters.residency.swap_plan import SlotLayer, StackCopy

SLOT_ADAPTER_NAME = "loraswap_slot"


@dataclass
class LiveLayer:
    """One slot layer: its factors' data, its gate and modules, and the ranks its gate opens now."""

    a: torch.Tensor  # (max_rank, in) parameter data of lora_A
    b: torch.Tensor  # (out, max_rank) parameter data of lora_B
    gate: torch.Tensor  # (max_rank,) bool: which ranks reach lora_B
    modules: tuple[torch.nn.Module, RankGatedLinear, RankBucketedLinear]  # PEFT's LoRA layer, its lora_A, lora_B
    resident_rank: int = 0  # ranks [0, resident_rank) are open, the rest closed; -1: unknown

    @property
    def base_layer(self) -> torch.nn.Module:
        """The linear layer the LoRA wraps: the weight a fused swap writes."""
        return self.modules[0].base_layer


class HotswapSlot:
    """In-place writer of planned copies into the live LoRA weights, and the rank bucket they compute at.

    Worker thread only.
    """

    @classmethod
    def install(
        cls,
        denoiser: torch.nn.Module,
        layer_names: list[str],
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        rank_buckets: tuple[int, ...] | None = None,
    ) -> HotswapSlot:
        """Enable hotswap at max rank and load a zero-effect, gated placeholder on every layer; before any compile.

        `rank_buckets` (ascending, the last max_rank; see rank_buckets.resolve_rank_buckets): the ranks the
        graphs compute at; None: max_rank only (every adapter computes the full width, the base model none).
        """
        if hasattr(denoiser, "enable_lora_hotswap"):
            denoiser.enable_lora_hotswap(target_rank=max_rank)
        placeholder = {}
        for name in layer_names:
            layer = denoiser.get_submodule(name)
            # Fresh tensors for every key: diffusers may keep the very tensors it is given.
            placeholder[f"{name}.lora_A.weight"] = torch.zeros(max_rank, layer.in_features, dtype=dtype)
            placeholder[f"{name}.lora_B.weight"] = torch.zeros(layer.out_features, max_rank, dtype=dtype)
        denoiser.load_lora_adapter(placeholder, prefix=None, adapter_name=SLOT_ADAPTER_NAME)
        denoiser.to(device)
        denoiser.requires_grad_(False)
        for name in layer_names:
            module = denoiser.get_submodule(name)
            module.lora_A[SLOT_ADAPTER_NAME] = RankGatedLinear(module.lora_A[SLOT_ADAPTER_NAME])
            module.lora_B[SLOT_ADAPTER_NAME] = RankBucketedLinear(module.lora_B[SLOT_ADAPTER_NAME])
        return cls(denoiser, layer_names, max_rank, rank_buckets)

    def __init__(
        self,
        denoiser: torch.nn.Module,
        layer_names: list[str],
        max_rank: int,
        rank_buckets: tuple[int, ...] | None = None,
    ) -> None:
        rank_buckets = tuple(rank_buckets or (max_rank,))
        if list(rank_buckets) != sorted(set(rank_buckets)) or rank_buckets[0] < 1 or rank_buckets[-1] != max_rank:
            raise ValueError(f"rank buckets {rank_buckets} must ascend from 1 and end at max rank {max_rank}")
        self.max_rank = max_rank
        self.rank_buckets = rank_buckets
        self.denoiser = denoiser
        self.layers = {name: _live_layer(denoiser, name, max_rank) for name in layer_names}
        device = next((live.b.device for live in self.layers.values()), None)
        # Row r opens ranks [0, r): the gate of a layer at rank r is a copy of it.
        self.gate_rows = torch.arange(max_rank, device=device) < torch.arange(max_rank + 1, device=device)[:, None]
        self._copies = CopyStream(device)  # CUDA: the copies run on a side stream the denoising stream waits on
        self._resident_ranks: dict[str, int] | None = None  # the ranks dict of the last write (identity compared)
        self._bucket = -1  # what every slot module computes at now (0: the LoRA branch skipped); -1: not yet set
        self.set_bucket(0)

    @property
    def graph_buckets(self) -> tuple[int, ...]:
        """Every bucket a compiled graph may compute at, the base model's 0 first: one graph each."""
        return (0, *self.rank_buckets)

    @property
    def bucket(self) -> int:
        """The rank bucket the slot computes at now; 0: the LoRA branch is skipped."""
        return self._bucket

    def factor_views(self) -> dict[str, SlotLayer]:
        """Each layer's factor tensors, for the planner to make its views of."""
        return {name: SlotLayer(a=live.a, b=live.b) for name, live in self.layers.items()}

    def base_layers(self) -> dict[str, torch.nn.Module]:
        """Each slot layer's base linear layer (the weight a fused swap writes), by name."""
        return {name: live.base_layer for name, live in self.layers.items()}

    @torch.no_grad()
    def write(self, copy: StackCopy) -> None:
        """Copy, scale and open the ranks as `copy` says.

        A failure part-way leaves the weights and gates unknown: every gate is rewritten by the next write.
        """
        gates, gate_rows = [], []
        if copy.ranks is not self._resident_ranks:
            for name, live in self.layers.items():
                if copy.ranks[name] != live.resident_rank:
                    gates.append(live.gate)
                    gate_rows.append(self.gate_rows[copy.ranks[name]])
        try:
            with self._copies.copying():
                # One call each instead of a Python-level copy per tensor (1,120 on SDXL's default slot).
                if copy.targets:
                    torch._foreach_copy_(copy.targets, copy.sources, non_blocking=True)
                    for scale, views in copy.scaled.items():
                        torch._foreach_mul_(views, _scale_operand(scale, views[0].device))
                if gates:
                    torch._foreach_copy_(gates, gate_rows)
        except BaseException:
            for live in self.layers.values():
                live.resident_rank = -1
            self._resident_ranks = None
            raise
        if gates:
            for name, rank in copy.ranks.items():
                self.layers[name].resident_rank = rank
        self._resident_ranks = copy.ranks

    def set_bucket(self, bucket: int) -> None:
        """Make every slot module compute at `bucket` (0: PEFT skips the LoRA branch); all layers alike."""
        if bucket == self._bucket:
            return
        skip = bucket == 0
        # Straight into each module's __dict__: plain attributes, which nn.Module.__setattr__ would only look up
        # among parameters, buffers and submodules first (4 us a layer, 2 ms a bucket change on SDXL's slot).
        # Compiled graphs guard on the values themselves, so they see the change.
        for live in self.layers.values():
            layer, lora_a, lora_b = live.modules
            # PEFT's own switch (its public enable_adapters would also set requires_grad, which guards check).
            layer.__dict__["_disable_adapters"] = skip
            if not skip:
                lora_a.__dict__["rank_bucket"] = lora_b.__dict__["rank_bucket"] = bucket
        self._bucket = bucket


def _live_layer(denoiser: torch.nn.Module, name: str, max_rank: int) -> LiveLayer:
    module = denoiser.get_submodule(name)
    lora_a = module.lora_A[SLOT_ADAPTER_NAME]
    lora_b = module.lora_B[SLOT_ADAPTER_NAME]
    if not isinstance(lora_a, RankGatedLinear) or not isinstance(lora_b, RankBucketedLinear):
        raise TypeError(f"slot layer {name} has no rank gate; install the slot with HotswapSlot.install")
    if lora_a.weight.shape[0] != max_rank or lora_b.weight.shape[1] != max_rank:
        raise RuntimeError(f"slot layer {name} has rank {lora_a.weight.shape[0]}, expected {max_rank}")
    modules = (module, lora_a, lora_b)
    return LiveLayer(a=lora_a.weight.data, b=lora_b.weight.data, gate=lora_a.rank_gate, modules=modules)


def _scale_operand(scale: float, device: torch.device) -> float | torch.Tensor:
    """What _foreach_mul_ takes so that each product equals `b * scale` rounded once.

    On CPU, _foreach_mul_ with a Python float rounds the scale to the model's dtype first
    (unlike mul_), so it gets a float32 tensor scalar. On CUDA the float is kept: its kernel
    already multiplies in float32, and a tensor there would cost a blocking host-to-device
    copy and, with a dtype unlike the model's, one kernel per tensor.
    """
    return torch.tensor(scale) if device.type == "cpu" else scale
