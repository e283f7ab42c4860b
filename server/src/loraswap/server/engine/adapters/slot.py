"""The resident swap slot: max-rank LoRA weights on every targeted layer, rewritten in place.

The slot is a PEFT LoRA adapter loaded once at start-up (zero-effect, max
rank, alpha == rank so PEFT's own scaling is 1) before the denoiser is
compiled. Afterwards nothing about it changes but the values of its tensors:
no config, no scaling, no shapes, so compiled graphs never see a difference.

Each slot layer's lora_A is a `RankGatedLinear`: its output passes through a
boolean gate with one entry per rank, so the ranks beyond the resident
adapter's contribute exactly zero whatever the weights there hold. An adapter
change therefore copies each layer's canonical factors into the first `rank`
rows of lora_A and columns of lora_B, multiplies the strength into that part
of lora_B, and rewrites the gates of the layers whose rank changed. It never
clears what a previous adapter left beyond the new rank, so changing to a
lower-rank adapter, to one that covers fewer layers, or to the base model
costs no more than copying the incoming adapter's own bytes.

Why the gate is exact: `torch.where` yields 0 for a closed rank even if the
stale projection overflowed, and lora_B then multiplies those zeros by stale
values that are finite, because every value ever written into lora_B is
(canonical.py checks each adapter's lora_B times the largest allowed strength
against the model dtype's range).

How a swap stays close to the cost of a copy: the slot views an adapter of a
given layout (its layers and ranks) is copied into are built once and kept
(`_SwapPlan`); each adapter keeps its own list of source tensors; the copies,
the strength multiply and the gate writes are one `torch._foreach_*` call
each; and lora_B rows of 16 bytes or a multiple of 16 are copied as 16-byte
elements (`_as_16_byte_elements`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loraswap.server.engine.adapters.canonical import CanonicalAdapter, SlotSpec
from loraswap.server.engine.types import ModelFamily

SLOT_ADAPTER_NAME = "loraswap_slot"
# Adapter layouts (layers and ranks) whose slot views are kept; most deployments have a handful.
MAX_CACHED_PLANS = 64


class RankGatedLinear(torch.nn.Linear):
    """A bias-free lora_A whose output ranks are switched on and off by the boolean `rank_gate` buffer."""

    def __init__(self, lora_a: torch.nn.Linear) -> None:
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = lora_a.in_features, lora_a.out_features
        self.weight = lora_a.weight  # the very parameter PEFT created: nothing is copied
        self.register_parameter("bias", None)
        gate = torch.zeros(lora_a.out_features, dtype=torch.bool, device=lora_a.weight.device)
        self.register_buffer("rank_gate", gate, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(self.rank_gate, F.linear(x, self.weight), 0.0)


def _as_16_byte_elements(tensor: torch.Tensor) -> torch.Tensor:
    """The same bytes seen as complex128, 16 bytes an element (the caller checks the layout allows it).

    Copying a rank-8 bfloat16 lora_B into a rank-64 slot writes 16 bytes into every 128-byte row.
    Seen as one 16-byte element per row, that is a single strided 1-D loop instead of one short
    inner loop per row: about 1.7x faster on SDXL's layer shapes. A copy between complex128 views
    moves bytes; no arithmetic touches them.
    """
    return tensor.view(torch.complex128)


@dataclass
class _SwapPlan:
    """Where an adapter of one layout goes in the slot: built once per layout, reused by every swap to it."""

    targets: list[torch.Tensor]  # slot views, in the order of the adapter's copy sources
    scaled: list[torch.Tensor]  # the lora_B views in the model's dtype, which the strength multiplies
    ranks: dict[str, int]  # every slot layer's rank once the adapter is resident


@dataclass
class _LiveLayer:
    a: torch.Tensor  # (max_rank, in) parameter data of lora_A
    b: torch.Tensor  # (out, max_rank) parameter data of lora_B
    gate: torch.Tensor  # (max_rank,) bool: which ranks reach lora_B
    resident_rank: int = 0  # ranks [0, resident_rank) are open, the rest closed; -1: unknown


class HotswapSlot:
    """In-place writer of canonical adapters into the live LoRA weights. Worker thread only."""

    @classmethod
    def install(
        cls,
        denoiser: torch.nn.Module,
        layer_names: list[str],
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> HotswapSlot:
        """Enable hotswap at max rank and load a zero-effect, gated placeholder on every layer; before any compile."""
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
            lora_a = denoiser.get_submodule(name).lora_A
            lora_a[SLOT_ADAPTER_NAME] = RankGatedLinear(lora_a[SLOT_ADAPTER_NAME])
        return cls(denoiser, layer_names, max_rank)

    def __init__(self, denoiser: torch.nn.Module, layer_names: list[str], max_rank: int) -> None:
        self.max_rank = max_rank
        self._denoiser = denoiser
        self._layers: dict[str, _LiveLayer] = {}
        device = None
        for name in layer_names:
            module = denoiser.get_submodule(name)
            lora_a = module.lora_A[SLOT_ADAPTER_NAME]
            b = module.lora_B[SLOT_ADAPTER_NAME].weight
            if not isinstance(lora_a, RankGatedLinear):
                raise TypeError(f"slot layer {name} has no rank gate; install the slot with HotswapSlot.install")
            if lora_a.weight.shape[0] != max_rank or b.shape[1] != max_rank:
                raise RuntimeError(f"slot layer {name} has rank {lora_a.weight.shape[0]}, expected {max_rank}")
            self._layers[name] = _LiveLayer(a=lora_a.weight.data, b=b.data, gate=lora_a.rank_gate)
            device = b.device
        # Row r opens ranks [0, r): the gate of a layer at rank r is a copy of it.
        self._gate_rows = torch.arange(max_rank, device=device) < torch.arange(max_rank + 1, device=device)[:, None]
        self._plans: dict[tuple, _SwapPlan] = {}
        first = next(iter(self._layers.values()), None)
        # 16-byte views of lora_B need 16-byte-aligned slot rows and start.
        self._dtype = first.b.dtype if first is not None else None
        self._wide_rows = first is not None and (
            (max_rank * first.b.element_size()) % 16 == 0
            and all(live.b.data_ptr() % 16 == 0 for live in self._layers.values())
        )
        self.resident: CanonicalAdapter | None = None
        self.resident_scale = 1.0
        self._consistent = True  # False after a load failed part-way: then nothing is resident for sure
        self._resident_ranks: dict[str, int] | None = None  # the ranks dict of the last load (identity compared)
        self._no_adapter_ranks = {name: 0 for name in self._layers}

    @property
    def layer_names(self) -> list[str]:
        return list(self._layers)

    def spec(self, family: ModelFamily, dtype: torch.dtype, device: torch.device, *, strict: bool = False) -> SlotSpec:
        """What an adapter must fit to be loaded into this slot."""
        shapes = {}
        for name in self._layers:
            layer = self._denoiser.get_submodule(name).base_layer
            shapes[name] = (layer.in_features, layer.out_features)
        return SlotSpec(
            family=family,
            layer_shapes=shapes,
            max_rank=self.max_rank,
            dtype=dtype,
            device=device,
            denoiser_config=self._denoiser.config,  # diffusers' FrozenDict: its converters read attributes
            strict=strict,
        )

    def is_resident(self, adapter: CanonicalAdapter | None, scale: float) -> bool:
        """True when the slot already holds exactly this adapter object at this strength."""
        if not self._consistent:
            return False
        if adapter is None:
            return self.resident is None
        return self.resident is adapter and self.resident_scale == scale

    @torch.no_grad()
    def load(self, adapter: CanonicalAdapter | None, scale: float = 1.0) -> float:
        """Make `adapter` (None: the base model) resident at `scale`; returns milliseconds spent."""
        if self.is_resident(adapter, scale):
            return 0.0
        started = time.perf_counter()
        targets, sources, scaled, ranks = [], [], [], self._no_adapter_ranks
        if adapter is not None:
            key, sources = self._copy_sources(adapter)
            plan = self._plan(key)
            targets, scaled, ranks = plan.targets, plan.scaled, plan.ranks
        gates, gate_rows = [], []
        if ranks is not self._resident_ranks:
            for name, live in self._layers.items():
                if ranks[name] != live.resident_rank:
                    gates.append(live.gate)
                    gate_rows.append(self._gate_rows[ranks[name]])
        try:
            # One call each instead of a Python-level copy per tensor (1,120 on SDXL's default slot).
            if targets:
                torch._foreach_copy_(targets, sources, non_blocking=True)
                if scale != 1.0:
                    torch._foreach_mul_(scaled, self._scale_operand(scale, scaled[0].device))
            if gates:
                torch._foreach_copy_(gates, gate_rows)
            first = next(iter(self._layers.values()), None)
            if first is not None and first.a.is_cuda:
                torch.cuda.current_stream(first.a.device).synchronize()
        except BaseException:
            # Weights and gates are now in an unknown state: the next load rewrites every gate.
            for live in self._layers.values():
                live.resident_rank = -1
            self.resident, self.resident_scale, self._consistent = None, 1.0, False
            self._resident_ranks = None
            raise
        if gates:
            for name, rank in ranks.items():
                self._layers[name].resident_rank = rank
        self._resident_ranks = ranks
        self.resident = adapter
        self.resident_scale = scale if adapter is not None else 1.0
        self._consistent = True
        return (time.perf_counter() - started) * 1000.0

    def _copy_sources(self, adapter: CanonicalAdapter) -> tuple[tuple, list[torch.Tensor]]:
        """The adapter's tensors in copy order, and the key of the plan they go with (cached on the adapter)."""
        # Everything the sources depend on besides the adapter (not the slot's identity: ids are reused).
        cache_key = ("slot", self.max_rank, self._dtype, self._wide_rows)
        cached = adapter.swap_cache.get(cache_key)
        if cached is None:
            layout, sources = [], []
            for name, layer in adapter.layers.items():
                rank = layer.rank
                wide = (
                    self._wide_rows
                    and layer.b.dtype == self._dtype  # a byte view must never stand in for a dtype conversion
                    and (rank * layer.b.element_size()) % 16 == 0
                    and layer.b.is_contiguous()
                    and layer.b.data_ptr() % 16 == 0
                )
                sources += (layer.a, _as_16_byte_elements(layer.b) if wide else layer.b)
                layout.append((name, rank, wide))
            cached = adapter.swap_cache[cache_key] = (tuple(layout), sources)
        return cached

    @staticmethod
    def _scale_operand(scale: float, device: torch.device) -> float | torch.Tensor:
        """What _foreach_mul_ takes so that each product equals `b * scale` rounded once.

        On CPU, _foreach_mul_ with a Python float rounds the scale to the model's dtype first
        (unlike mul_), so it gets a float32 tensor scalar. On CUDA the float is kept: its kernel
        already multiplies in float32, and a tensor there would cost a blocking host-to-device
        copy and, with a dtype unlike the model's, one kernel per tensor.
        """
        return torch.tensor(scale) if device.type == "cpu" else scale

    def _plan(self, key: tuple) -> _SwapPlan:
        plan = self._plans.get(key)
        if plan is None:
            targets, scaled = [], []
            ranks = dict(self._no_adapter_ranks)
            for name, rank, wide in key:
                live = self._layers[name]
                b_view = live.b[:, :rank]
                targets += (live.a[:rank], _as_16_byte_elements(b_view) if wide else b_view)
                scaled.append(b_view)
                ranks[name] = rank
            if len(self._plans) >= MAX_CACHED_PLANS:
                self._plans.pop(next(iter(self._plans)))
            plan = self._plans[key] = _SwapPlan(targets=targets, scaled=scaled, ranks=ranks)
        return plan

    def gates_match_resident(self) -> bool:
        """Invariant check (tests): each layer's gate opens exactly its resident ranks, and every weight is finite."""
        return all(
            torch.equal(live.gate, self._gate_rows[live.resident_rank])
            and bool(torch.isfinite(live.a).all())
            and bool(torch.isfinite(live.b).all())
            for live in self._layers.values()
        )
