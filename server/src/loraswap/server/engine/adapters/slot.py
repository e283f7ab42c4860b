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

Stacks: a sum of LoRAs is one LoRA whose factors are theirs concatenated along
the rank, `sum_i B_i A_i = [B_1 B_2 ...] [A_1; A_2; ...]`. So several adapters
whose ranks add up to at most max rank on every layer go into the slot side by
side: each member's factors are copied into the next free rank range of each
of its layers (its strength multiplied into its own lora_B columns), and the
gate opens the summed rank. Members are placed in name order, so the same
members in any order are one slot state with one image; a one-member stack is
exactly a single adapter. A stack's plan is cached like any other layout; it
copies layer by layer, so that the members' neighbouring lora_B ranges of a
layer are written while its rows are in cache.

Rank buckets (rank_buckets.py): the graphs compute with only the first `bucket` ranks of each
layer's factors (`RankGatedLinear` and `RankBucketedLinear` read views of the same max-rank
tensors, so swaps still copy into fixed addresses), the smallest bucket at or above the resident
stack's rank on its fullest layer; with nothing resident the LoRA branch is skipped (PEFT's
per-layer `_disable_adapters`). The bucket is a Python int on every slot module, which dynamo
specialises on: each bucket, and the base model, is one graph, compiled during warm-up
(`computing_at`), all layers switching together. Bucketing is exact up to float summation order:
the ranks it leaves out are gated to zero in the full-width product too.

Fused swaps (adapters/fused.py, with --fuse auto|always): `load_stack(members, fused=True)` merges the
stack into the base weights of the layers it touches and computes at bucket 0, the base model's graph;
the LoRA slot keeps whatever it held, so going back to that stack unfused later copies nothing. An
adapter the slot cannot hold (DoRA, a trained bias, a rank above max rank; `fits_slot` False) is only
ever loaded fused.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loraswap.server.engine.adapters.canonical import CanonicalAdapter, SlotSpec, StackMember
from loraswap.server.engine.adapters.copy_stream import CopyStream
from loraswap.server.engine.adapters.device_cache import DeviceAdapterCache
from loraswap.server.engine.adapters.fused import FusedWeights
from loraswap.server.engine.errors import AdapterIncompatibleError, ErrorReason
from loraswap.server.engine.rank_buckets import bucket_for
from loraswap.server.engine.types import ModelFamily

SLOT_ADAPTER_NAME = "loraswap_slot"
# Adapter layouts (layers and ranks) whose slot views are kept; most deployments have a handful.
MAX_CACHED_PLANS = 64


def stack_order(members: Iterable[StackMember]) -> tuple[StackMember, ...]:
    """Members in the order the slot places them: by name, so the order a request gives never changes the image."""
    return tuple(sorted(members, key=lambda member: member[0].name))


def _same_members(ordered: tuple[StackMember, ...], resident: tuple[StackMember, ...]) -> bool:
    """The same adapter objects at the same strengths, both in stack_order."""
    return len(ordered) == len(resident) and all(
        adapter is other and scale == other_scale for (adapter, scale), (other, other_scale) in zip(ordered, resident)
    )


def _stack_rank_error(layer: str, rank: int, max_rank: int) -> AdapterIncompatibleError:
    return AdapterIncompatibleError(
        f"the stacked adapters' ranks add up to {rank} on layer {layer}, above the server's max rank {max_rank}; "
        f"stack fewer or lower-rank adapters, or restart the server with --max-rank {rank}",
        reason=ErrorReason.STACK_RANK_EXCEEDED,
        layer=layer,
        rank=rank,
        max_rank=max_rank,
    )


def check_stack_fits(adapters: Iterable[CanonicalAdapter], max_rank: int) -> None:
    """Raise STACK_RANK_EXCEEDED, naming the worst layer, unless the ranks add up to at most max_rank on every layer.

    Plain arithmetic on the adapters' shapes: safe on any thread, before anything is queued.
    """
    summed: dict[str, int] = {}
    for adapter in adapters:
        for name, layer in adapter.layers.items():
            summed[name] = summed.get(name, 0) + layer.rank
    if summed:
        worst = max(sorted(summed), key=summed.__getitem__)
        if summed[worst] > max_rank:
            raise _stack_rank_error(worst, summed[worst], max_rank)


class RankGatedLinear(torch.nn.Linear):
    """A bias-free lora_A computing its first `rank_bucket` ranks, switched on and off by the `rank_gate` buffer."""

    def __init__(self, lora_a: torch.nn.Linear) -> None:
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = lora_a.in_features, lora_a.out_features
        self.weight = lora_a.weight  # the very parameter PEFT created: nothing is copied
        self.register_parameter("bias", None)
        gate = torch.zeros(lora_a.out_features, dtype=torch.bool, device=lora_a.weight.device)
        self.register_buffer("rank_gate", gate, persistent=False)
        self.rank_bucket = lora_a.out_features  # a plain int: dynamo specialises each graph on it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bucket = self.rank_bucket
        if bucket == self.out_features:
            return torch.where(self.rank_gate, F.linear(x, self.weight), 0.0)
        return torch.where(self.rank_gate[:bucket], F.linear(x, self.weight[:bucket]), 0.0)


class RankBucketedLinear(torch.nn.Linear):
    """A bias-free lora_B reading only its first `rank_bucket` ranks: those its RankGatedLinear computes."""

    def __init__(self, lora_b: torch.nn.Linear) -> None:
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = lora_b.in_features, lora_b.out_features
        self.weight = lora_b.weight  # the very parameter PEFT created: nothing is copied
        self.register_parameter("bias", None)
        self.rank_bucket = lora_b.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bucket = self.rank_bucket
        # A view of the first columns: strided rows that matmul reads in place, never a copy of the weight.
        return F.linear(x, self.weight if bucket == self.in_features else self.weight[:, :bucket])


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
    """Where a stack of one layout goes in the slot: built once per layout, reused by every swap to it."""

    targets: list[torch.Tensor]  # slot views, in the order of the members' copy sources
    scaled: list[list[torch.Tensor]]  # per member: its lora_B views in the model's dtype, which its strength multiplies
    ranks: dict[str, int]  # every slot layer's rank once the stack is resident
    bucket: int  # the rank bucket the graphs compute at while the stack is resident
    # Where each target's source is in the members' sources one after the other (None: in that order).
    order: tuple[int, ...] | None = None
    # Copy sources (after `order`) a member offers as 16-byte elements that must be copied element-wise
    # here, because its rank range in the slot does not start on a 16-byte boundary.
    narrowed: tuple[int, ...] = ()


@dataclass
class _LiveLayer:
    a: torch.Tensor  # (max_rank, in) parameter data of lora_A
    b: torch.Tensor  # (out, max_rank) parameter data of lora_B
    gate: torch.Tensor  # (max_rank,) bool: which ranks reach lora_B
    modules: tuple[torch.nn.Module, RankGatedLinear, RankBucketedLinear]  # PEFT's LoRA layer, its lora_A, lora_B
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
        self._denoiser = denoiser
        self._layers: dict[str, _LiveLayer] = {}
        device = None
        for name in layer_names:
            module = denoiser.get_submodule(name)
            lora_a = module.lora_A[SLOT_ADAPTER_NAME]
            lora_b = module.lora_B[SLOT_ADAPTER_NAME]
            if not isinstance(lora_a, RankGatedLinear) or not isinstance(lora_b, RankBucketedLinear):
                raise TypeError(f"slot layer {name} has no rank gate; install the slot with HotswapSlot.install")
            b = lora_b.weight
            if lora_a.weight.shape[0] != max_rank or b.shape[1] != max_rank:
                raise RuntimeError(f"slot layer {name} has rank {lora_a.weight.shape[0]}, expected {max_rank}")
            self._layers[name] = _LiveLayer(
                a=lora_a.weight.data, b=b.data, gate=lora_a.rank_gate, modules=(module, lora_a, lora_b)
            )
            device = b.device
        # Row r opens ranks [0, r): the gate of a layer at rank r is a copy of it.
        self._gate_rows = torch.arange(max_rank, device=device) < torch.arange(max_rank + 1, device=device)[:, None]
        self._plans: dict[tuple, _SwapPlan] = {}
        self._copies = CopyStream(device)  # CUDA: the copies run on a side stream the denoising stream waits on
        # --device-adapter-bytes (set by the runtime): device copies of hot adapters to copy from instead of the host.
        self.device_cache: DeviceAdapterCache | None = None
        # --fuse auto|always (set by the runtime): merges into the base weights from their pristine copies.
        self.fused_weights: FusedWeights | None = None
        first = next(iter(self._layers.values()), None)
        # 16-byte views of lora_B need 16-byte-aligned slot rows and start.
        self._dtype = first.b.dtype if first is not None else None
        self._wide_rows = first is not None and (
            (max_rank * first.b.element_size()) % 16 == 0
            and all(live.b.data_ptr() % 16 == 0 for live in self._layers.values())
        )
        self._members: tuple[StackMember, ...] = ()  # what the LoRA slot holds, in stack_order
        self._lora_bucket = 0  # the bucket the LoRA slot's stack computes at
        self._fused_members: tuple[StackMember, ...] | None = None  # what is fused into the base weights; None: none
        self._consistent = True  # False after a load failed part-way: then nothing is resident for sure
        self._resident_ranks: dict[str, int] | None = None  # the ranks dict of the last load (identity compared)
        self._no_adapter_ranks = {name: 0 for name in self._layers}
        self._bucket = -1  # what every slot module computes at now (0: the LoRA branch skipped); -1: not yet set
        self._needed_bucket = 0  # the resident stack's bucket (0 when fused)
        self._bucket_floor = 0  # computing_at: the least bucket to compute at whatever is resident
        self._set_bucket(0)

    @property
    def layer_names(self) -> list[str]:
        return list(self._layers)

    @property
    def graph_buckets(self) -> tuple[int, ...]:
        """Every bucket a compiled graph may compute at, the base model's 0 first: one graph each."""
        return (0, *self.rank_buckets)

    @property
    def bucket(self) -> int:
        """The rank bucket the slot computes at now; 0: the LoRA branch is skipped."""
        return self._bucket

    @contextlib.contextmanager
    def computing_at(self, bucket: int) -> Iterator[None]:
        """Compute at `bucket` while inside, whatever is resident (warm-up: compiles that bucket's graph).

        The results do not change: ranks beyond the resident ones are gated to zero. Not below the
        resident stack's own bucket.
        """
        if bucket not in self.graph_buckets or bucket < self._needed_bucket:
            raise ValueError(f"bucket {bucket} is not one of {self.graph_buckets} at or above the resident stack's")
        self._bucket_floor = bucket
        self._set_bucket(bucket)
        try:
            yield
        finally:
            self._bucket_floor = 0
            self._set_bucket(self._needed_bucket)

    def _set_bucket(self, bucket: int) -> None:
        """Make every slot module compute at `bucket` (0: PEFT skips the LoRA branch); all layers alike."""
        if bucket == self._bucket:
            return
        skip = bucket == 0
        # Straight into each module's __dict__: plain attributes, which nn.Module.__setattr__ would only look up
        # among parameters, buffers and submodules first (4 us a layer, 2 ms a bucket change on SDXL's slot).
        # Compiled graphs guard on the values themselves, so they see the change.
        for live in self._layers.values():
            layer, lora_a, lora_b = live.modules
            # PEFT's own switch (its public enable_adapters would also set requires_grad, which guards check).
            layer.__dict__["_disable_adapters"] = skip
            if not skip:
                lora_a.__dict__["rank_bucket"] = lora_b.__dict__["rank_bucket"] = bucket
        self._bucket = bucket

    def spec(
        self, family: ModelFamily, dtype: torch.dtype, device: torch.device, *, strict: bool = False
    ) -> SlotSpec:
        """What an adapter must fit to be loaded into this slot (with fused_weights set: or to be fused)."""
        base_layers = self.base_layers()
        return SlotSpec(
            family=family,
            layer_shapes={name: (layer.in_features, layer.out_features) for name, layer in base_layers.items()},
            max_rank=self.max_rank,
            dtype=dtype,
            device=device,
            denoiser_config=self._denoiser.config,  # diffusers' FrozenDict: its converters read attributes
            strict=strict,
            fuse=self.fused_weights is not None,
            biased_layers=frozenset(name for name, layer in base_layers.items() if layer.bias is not None),
        )

    def unfused_bucket(self, members: Iterable[StackMember]) -> int | None:
        """The bucket the slot would compute these adapters at unfused; None when the slot cannot hold them."""
        summed = self.summed_ranks(members)
        if summed is None:
            return None
        worst = max(summed.values(), default=0)
        return bucket_for(worst, self.rank_buckets) if worst <= self.max_rank else None

    @staticmethod
    def summed_ranks(members: Iterable[StackMember]) -> dict[str, int] | None:
        """Each layer's rank summed over the members; None when one of them only fuses (DoRA, a trained bias)."""
        summed: dict[str, int] = {}
        for adapter, _ in members:
            if any(layer.magnitude is not None or layer.bias is not None for layer in adapter.layers.values()):
                return None
            for name, layer in adapter.layers.items():
                summed[name] = summed.get(name, 0) + layer.rank
        return summed

    def base_layers(self) -> dict[str, torch.nn.Module]:
        """Each slot layer's base linear layer (the weight a fused swap writes), by name."""
        return {name: live.modules[0].base_layer for name, live in self._layers.items()}

    @property
    def _resident_members(self) -> tuple[StackMember, ...]:
        return self._fused_members if self._fused_members is not None else self._members

    @property
    def fused(self) -> bool:
        """Whether the resident adapters are fused into the base weights (False for the base model)."""
        return bool(self._fused_members)

    @property
    def resident(self) -> CanonicalAdapter | None:
        """The adapter in the slot when it holds exactly one; None for the base model and for a stack."""
        members = self._resident_members
        return members[0][0] if len(members) == 1 else None

    @property
    def resident_scale(self) -> float:
        """The strength of the one resident adapter; 1.0 otherwise."""
        members = self._resident_members
        return members[0][1] if len(members) == 1 else 1.0

    @property
    def resident_adapters(self) -> tuple[CanonicalAdapter, ...]:
        """Every adapter in the slot, fused or not, in stack_order; empty for the base model."""
        return tuple(adapter for adapter, _ in self._resident_members)

    def is_resident(self, adapter: CanonicalAdapter | None, scale: float) -> bool:
        """True when the slot already holds exactly this adapter object at this strength."""
        return self.holds(() if adapter is None else ((adapter, scale),))

    def holds(self, members: Iterable[StackMember]) -> bool:
        """True when the slot already holds exactly these adapter objects at these strengths, in any order,
        fused or not."""
        if self._fused_members is not None:
            return _same_members(stack_order(members), self._fused_members)
        return self._consistent and _same_members(stack_order(members), self._members)

    def load(self, adapter: CanonicalAdapter | None, scale: float = 1.0) -> float:
        """Make `adapter` (None: the base model) resident at `scale`; returns milliseconds spent."""
        return self.load_stack(() if adapter is None else ((adapter, scale),))

    @torch.no_grad()
    def load_stack(self, members: Iterable[StackMember], *, fused: bool = False) -> float:
        """Make these adapters resident together, each at its strength (none: the base model); returns ms spent.

        `fused`: merge them into the base weights instead (fused_weights must be set). Raises
        STACK_RANK_EXCEEDED (AdapterIncompatibleError) before anything changes when an unfused stack's
        ranks add up to more than max rank on some layer; a fused merge that overflows the model's dtype
        raises ADAPTER_OUT_OF_RANGE and leaves the unfused slot resident (see fused.py).
        """
        members = stack_order(members)
        if self.holds(members) and (not members or fused == self.fused):
            return 0.0
        if fused and members:
            return self._fuse(members)
        restore_ms = 0.0
        if self._fused_members is not None:
            restore_ms = self.fused_weights.restore()
            self._fused_members = None
            self._needed_bucket = self._lora_bucket
        if self._consistent and _same_members(members, self._members):
            self._set_bucket(max(self._needed_bucket, self._bucket_floor))
            return restore_ms
        return restore_ms + self._copy_in(members)

    def _fuse(self, members: tuple[StackMember, ...]) -> float:
        if self.fused_weights is None:
            raise RuntimeError("this slot has no pristine weights to fuse from (--fuse never)")
        self._fused_members = None  # until the merge is done: a failed one leaves W0 everywhere
        try:
            merge_ms = self.fused_weights.merge(members)
        except BaseException:
            self._needed_bucket = self._lora_bucket
            self._set_bucket(max(self._needed_bucket, self._bucket_floor))
            raise
        self._fused_members = members
        self._needed_bucket = 0
        self._set_bucket(self._bucket_floor)
        return merge_ms

    def _copy_in(self, members: tuple[StackMember, ...]) -> float:
        """The unfused swap: copy the members' factors into the LoRA slot, scale them, open their ranks."""
        started = time.perf_counter()
        targets, sources, ranks, bucket = [], [], self._no_adapter_ranks, 0
        by_scale: dict[float, list[torch.Tensor]] = {}
        if members:
            key, sources = self._stack_sources(members)
            plan = self._plan(key)
            targets, ranks, bucket = plan.targets, plan.ranks, plan.bucket
            if plan.order is not None:
                sources = [sources[index] for index in plan.order]
            if plan.narrowed:
                sources = list(sources)  # never change a list an adapter keeps
                for index in plan.narrowed:
                    sources[index] = sources[index].view(self._dtype)
            for views, (_, scale) in zip(plan.scaled, members):
                if scale != 1.0:
                    by_scale[scale] = by_scale[scale] + views if scale in by_scale else views
        gates, gate_rows = [], []
        if ranks is not self._resident_ranks:
            for name, live in self._layers.items():
                if ranks[name] != live.resident_rank:
                    gates.append(live.gate)
                    gate_rows.append(self._gate_rows[ranks[name]])
        try:
            # Into the same tensors, always: CUDA graphs captured from the slot stay valid.
            with self._copies.copying():
                # One call each instead of a Python-level copy per tensor (1,120 on SDXL's default slot).
                if targets:
                    torch._foreach_copy_(targets, sources, non_blocking=True)
                    # One multiply per distinct strength: a single adapter's is one call, as before stacks.
                    for scale, views in by_scale.items():
                        torch._foreach_mul_(views, self._scale_operand(scale, views[0].device))
                if gates:
                    torch._foreach_copy_(gates, gate_rows)
            self._set_bucket(max(bucket, self._bucket_floor))
        except BaseException:
            # Weights and gates are now in an unknown state: the next load rewrites every gate.
            for live in self._layers.values():
                live.resident_rank = -1
            self._members, self._consistent = (), False
            self._resident_ranks = None
            # Until the next load: whatever the weights hold, compute it all.
            self._needed_bucket = self._lora_bucket = self.max_rank
            self._set_bucket(self.max_rank)
            raise
        if gates:
            for name, rank in ranks.items():
                self._layers[name].resident_rank = rank
        self._resident_ranks = ranks
        self._needed_bucket = self._lora_bucket = bucket
        self._members = members
        self._consistent = True
        return (time.perf_counter() - started) * 1000.0

    def _stack_sources(self, members: tuple[StackMember, ...]) -> tuple[tuple, list[torch.Tensor]]:
        """The plan key of the members' layouts (in stack_order) and their copy sources, in order."""
        if len(members) == 1:
            layout, sources = self._copy_sources(members[0][0])
            return (layout,), self._hot(members[0][0], sources)  # the adapter's own list, not copied
        layouts, sources = [], []
        for adapter, _ in members:
            layout, adapter_sources = self._copy_sources(adapter)
            layouts.append(layout)
            sources += self._hot(adapter, adapter_sources)
        return tuple(layouts), sources

    def _hot(self, adapter: CanonicalAdapter, sources: list[torch.Tensor]) -> list[torch.Tensor]:
        """The adapter's copy sources on the device when the hot set takes it (--device-adapter-bytes), else as given."""
        return sources if self.device_cache is None else self.device_cache.sources(adapter, sources)

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
        """The slot views for a key of member layouts: each member in the next free rank range of its layers."""
        plan = self._plans.get(key)
        if plan is None:
            summed = dict(self._no_adapter_ranks)
            for layout in key:
                for name, rank, _ in layout:
                    summed[name] += rank
            worst = max(sorted(summed), key=summed.__getitem__, default=None)
            if worst is not None and summed[worst] > self.max_rank:
                raise _stack_rank_error(worst, summed[worst], self.max_rank)
            position = {name: index for index, name in enumerate(self._layers)}
            copies = []  # per layer of each member: (slot layer position, its lora_A source index, targets, narrowed)
            scaled = []
            ranks = dict(self._no_adapter_ranks)
            for layout in key:
                views = []
                for name, rank, wide in layout:
                    live = self._layers[name]
                    start, end = ranks[name], ranks[name] + rank
                    b_view = live.b[:, start:end]
                    narrow = wide and (start * live.b.element_size()) % 16 != 0  # off a 16-byte boundary
                    b_target = _as_16_byte_elements(b_view) if wide and not narrow else b_view
                    copies.append((position[name], 2 * len(copies), (live.a[start:end], b_target), narrow))
                    views.append(b_view)
                    ranks[name] = end
                scaled.append(views)
            order = None
            if len(key) > 1:
                # Layer by layer, not member by member: a layer's members write neighbouring bytes of each
                # lora_B row (a rank-8 bfloat16 range is 16 of them), so one pass fetches each cache line once.
                copies.sort(key=lambda copy: copy[0])  # stable: members keep their order within a layer
                order = tuple(index for _, source, _, _ in copies for index in (source, source + 1))
            plan = _SwapPlan(
                targets=[target for _, _, pair, _ in copies for target in pair],
                scaled=scaled,
                ranks=ranks,
                bucket=bucket_for(max(ranks.values(), default=0), self.rank_buckets),
                order=order,
                narrowed=tuple(2 * index + 1 for index, (*_, narrow) in enumerate(copies) if narrow),
            )
            if len(self._plans) >= MAX_CACHED_PLANS:
                self._plans.pop(next(iter(self._plans)))
            self._plans[key] = plan
        return plan

    def gates_match_resident(self) -> bool:
        """Invariant check (tests): each layer's gate opens exactly its resident ranks, and every weight is finite."""
        return all(
            torch.equal(live.gate, self._gate_rows[live.resident_rank])
            and bool(torch.isfinite(live.a).all())
            and bool(torch.isfinite(live.b).all())
            for live in self._layers.values()
        )
