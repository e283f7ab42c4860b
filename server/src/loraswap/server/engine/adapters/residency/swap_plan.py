"""What an unfused swap copies where in the slot: planned here, written by HotswapSlot (slot.py).

Planning is pure: it reads shapes and makes views of the slot's tensors, and never writes a value.

A canonical adapter is copied into the first `rank` rows of each of its layers' lora_A and columns of
lora_B, its strength multiplied into that part of lora_B, and the layers' rank gates opened to its
rank. Nothing beyond the new rank is cleared (the gates close it), so changing to a lower-rank
adapter, to one on fewer layers, or to the base model costs no more than the incoming adapter's bytes.

Stacks: a sum of LoRAs is one LoRA whose factors are theirs concatenated along the rank,
`sum_i B_i A_i = [B_1 B_2 ...] [A_1; A_2; ...]`, so several adapters whose ranks add up to at most
max rank on every layer go side by side: each member in the next free rank range of each of its
layers. Members are placed in name order, so the same members in any order are one
slot state with one image (residency.py orders them); a one-member stack is exactly a single adapter.

How a swap stays close to the cost of a copy: the slot views an adapter layout (its layers and ranks)
is copied into are built once and kept (`SwapPlan`, per layout); each adapter keeps its own list of
copy sources (`AdapterSources`, cached on the adapter); the copies, the strength multiplies and the
gate writes are then one `torch._foreach_*` call each; and lora_B rows of 16 bytes or a multiple of 16
are copied as 16-byte elements (`as_16_byte_elements`). A stack's plan copies layer by layer, so that
the members' neighbouring lora_B ranges of a layer are written while its rows are in cache.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from loraswap.server.engine.adapters.formats import CanonicalAdapter, StackMember
from loraswap.server.engine.adapters.residency.device_cache import DeviceAdapterCache
from loraswap.server.engine.errors import AdapterIncompatibleError, ErrorReason
from loraswap.server.engine.rank_buckets import bucket_for

# Adapter layouts (layers and ranks) whose slot views are kept; most deployments have a handful.
MAX_CACHED_PLANS = 64


# -- stacks as plain values -------------------------------------------------------------------------------


def layer_ranks(adapters: Iterable[CanonicalAdapter], start: dict[str, int] | None = None) -> dict[str, int]:
    """Each layer's rank summed over the adapters (added to `start`, which is not changed)."""
    summed = dict(start or {})
    for adapter in adapters:
        for name, layer in adapter.layers.items():
            summed[name] = summed.get(name, 0) + layer.rank
    return summed


def fullest_layer(ranks: dict[str, int]) -> tuple[str, int] | None:
    """The layer with the highest rank (the first by name among equals) and its rank; None for no layers."""
    if not ranks:
        return None
    worst = max(sorted(ranks), key=ranks.__getitem__)
    return worst, ranks[worst]


def check_stack_fits(adapters: Iterable[CanonicalAdapter], max_rank: int) -> None:
    """Raise STACK_RANK_EXCEEDED, naming the worst layer, unless the ranks add up to at most max_rank on every layer.

    Plain arithmetic on the adapters' shapes: safe on any thread, before anything is queued.
    """
    _refuse_over_max_rank(layer_ranks(adapters), max_rank)


def held_rank(adapters: Iterable[CanonicalAdapter], max_rank: int) -> int | None:
    """The summed rank on the fullest layer when the swap slot can hold these adapters together (plain LoRAs of its
    layers, no DoRA, trained bias, other kind or layer, ranks adding up to at most max_rank on every layer); None
    when it cannot. Safe on any thread."""
    adapters = list(adapters)
    if any(not adapter.fits_slot for adapter in adapters) or any(
        layer.magnitude is not None or layer.bias is not None for a in adapters for layer in a.layers.values()
    ):
        return None
    worst = fullest_layer(layer_ranks(adapters))
    rank = worst[1] if worst is not None else 0
    return rank if rank <= max_rank else None


def slot_can_hold(adapters: Iterable[CanonicalAdapter], max_rank: int) -> bool:
    """Whether the swap slot can hold these adapters together (held_rank)."""
    return held_rank(adapters, max_rank) is not None


def _refuse_over_max_rank(ranks: dict[str, int], max_rank: int) -> None:
    worst = fullest_layer(ranks)
    if worst is not None and worst[1] > max_rank:
        layer, rank = worst
        raise AdapterIncompatibleError(
            f"the stacked adapters' ranks add up to {rank} on layer {layer}, above the server's max rank {max_rank}; "
            f"stack fewer or lower-rank adapters, or restart the server with --max-rank {rank}",
            reason=ErrorReason.STACK_RANK_EXCEEDED,
            layer=layer,
            rank=rank,
            max_rank=max_rank,
        )


def as_16_byte_elements(tensor: torch.Tensor) -> torch.Tensor:
    """The same bytes seen as complex128, 16 bytes an element (the caller checks the layout allows it).

    Copying a rank-8 bfloat16 lora_B into a rank-64 slot writes 16 bytes into every 128-byte row.
    Seen as one 16-byte element per row, that is a single strided 1-D loop instead of one short
    inner loop per row: about 1.7x faster on SDXL's layer shapes. A copy between complex128 views
    moves bytes; no arithmetic touches them.
    """
    return tensor.view(torch.complex128)


# -- the records ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SlotLayer:
    """One slot layer's factor tensors, as the planner views them."""

    a: torch.Tensor  # (max_rank, in) parameter data of lora_A
    b: torch.Tensor  # (out, max_rank) parameter data of lora_B


@dataclass(frozen=True)
class LayerLayout:
    """One layer of an adapter as the slot copies it."""

    name: str
    rank: int
    wide: bool  # its lora_B may be copied as 16-byte elements


@dataclass(frozen=True)
class AdapterSources:
    """One adapter's copy sources, cached on the adapter: per layer of `layout`, its `a` then its `b`."""

    layout: tuple[LayerLayout, ...]
    tensors: list[torch.Tensor]


@dataclass(frozen=True)
class LayerCopy:
    """Where one member's layer goes: its place among the slot layers, its sources and its targets."""

    position: int  # the slot layer's index: a stack's copies run layer by layer
    a_source: int  # index of its lora_A source among the stack's sources (its lora_B's is the next)
    a_target: torch.Tensor
    b_target: torch.Tensor
    narrow: bool  # a 16-byte source whose target range does not start on a 16-byte boundary


@dataclass(frozen=True)
class SwapPlan:
    """Where a stack of one layout goes in the slot: built once per layout, reused by every swap to it."""

    copies: tuple[LayerCopy, ...]  # in the order the copies run
    targets: list[torch.Tensor]  # each copy's a_target and b_target, in that order
    scaled: tuple[list[torch.Tensor], ...]  # per member: its lora_B views (model dtype), which its strength multiplies
    ranks: dict[str, int]  # every slot layer's rank once the stack is resident
    bucket: int  # the rank bucket the graphs compute at while the stack is resident


@dataclass(frozen=True)
class StackCopy:
    """One unfused swap's work for the slot writer: copy `sources` into `targets`, multiply each strength into its
    lora_B views, and open each layer's `ranks`; then compute at `bucket`."""

    targets: list[torch.Tensor]
    sources: list[torch.Tensor]
    scaled: dict[float, list[torch.Tensor]]  # strength (other than 1) -> the lora_B views it multiplies
    ranks: dict[str, int]
    bucket: int


# -- the planner ------------------------------------------------------------------------------------------


class SwapPlanner:
    """Turns a stack into the copies that make it resident in the slot's tensors. Worker thread only."""

    def __init__(
        self,
        layers: dict[str, SlotLayer],
        max_rank: int,
        rank_buckets: tuple[int, ...],
        device_cache: DeviceAdapterCache | None = None,
    ) -> None:
        """`device_cache` (--device-adapter-bytes): device copies of hot adapters to copy from instead of the host."""
        self.layers = layers
        self.max_rank = max_rank
        self.rank_buckets = rank_buckets
        self.device_cache = device_cache
        self.no_adapter_ranks = {name: 0 for name in layers}
        self._position = {name: index for index, name in enumerate(layers)}
        self._plans: dict[tuple, SwapPlan] = {}
        first = next(iter(layers.values()), None)
        self._dtype = first.b.dtype if first is not None else None
        # 16-byte views of lora_B need 16-byte-aligned slot rows and start.
        self._wide_rows = first is not None and (
            (max_rank * first.b.element_size()) % 16 == 0
            and all(layer.b.data_ptr() % 16 == 0 for layer in layers.values())
        )

    @property
    def cached_plans(self) -> tuple[SwapPlan, ...]:
        """The plans kept now, one per layout, oldest first."""
        return tuple(self._plans.values())

    def unfused_bucket(self, members: Iterable[StackMember]) -> int | None:
        """The bucket the slot would compute these adapters at unfused; None when the slot cannot hold them (an
        adapter that only fuses, or summed ranks above max rank)."""
        rank = held_rank((adapter for adapter, _ in members), self.max_rank)
        return bucket_for(rank, self.rank_buckets) if rank is not None else None

    def copy_for(self, members: tuple[StackMember, ...]) -> StackCopy:
        """The copies that make `members` (in stack_order; none: the base model) resident.

        Raises STACK_RANK_EXCEEDED (AdapterIncompatibleError) when their ranks add up to more than max rank on a
        layer; nothing has been written then.
        """
        if not members:
            return StackCopy(targets=[], sources=[], scaled={}, ranks=self.no_adapter_ranks, bucket=0)
        member_sources = [self._sources(adapter) for adapter, _ in members]
        plan = self._plan(tuple(sources.layout for sources in member_sources))
        if len(members) == 1:
            sources = member_sources[0].tensors  # the adapter's own list, not copied
        else:
            stacked = [tensor for member in member_sources for tensor in member.tensors]
            sources = [stacked[copy.a_source + side] for copy in plan.copies for side in (0, 1)]
        if any(copy.narrow for copy in plan.copies):
            sources = list(sources)  # never change a list an adapter keeps
            for index, copy in enumerate(plan.copies):
                if copy.narrow:
                    sources[2 * index + 1] = sources[2 * index + 1].view(self._dtype)
        scaled: dict[float, list[torch.Tensor]] = {}
        for views, (_, scale) in zip(plan.scaled, members):
            if scale != 1.0:  # one multiply per distinct strength: a single adapter's is one call
                scaled[scale] = scaled[scale] + views if scale in scaled else views
        return StackCopy(targets=plan.targets, sources=sources, scaled=scaled, ranks=plan.ranks, bucket=plan.bucket)

    def _sources(self, adapter: CanonicalAdapter) -> AdapterSources:
        """The adapter's copy sources (cached on it), on the device when the hot set takes them."""
        # Everything the sources depend on besides the adapter (not the planner's identity: ids are reused).
        cache_key = ("slot", self.max_rank, self._dtype, self._wide_rows)
        cached = adapter.swap_cache.get(cache_key)
        if cached is None:
            layout, tensors = [], []
            for name, layer in adapter.layers.items():
                wide = (
                    self._wide_rows
                    and layer.b.dtype == self._dtype  # a byte view must never stand in for a dtype conversion
                    and (layer.rank * layer.b.element_size()) % 16 == 0
                    and layer.b.is_contiguous()
                    and layer.b.data_ptr() % 16 == 0
                )
                tensors += (layer.a, as_16_byte_elements(layer.b) if wide else layer.b)
                layout.append(LayerLayout(name, layer.rank, wide))
            cached = adapter.swap_cache[cache_key] = AdapterSources(tuple(layout), tensors)
        if self.device_cache is None:
            return cached
        return AdapterSources(cached.layout, self.device_cache.sources(adapter, cached.tensors))

    def device_factors(self, adapter: CanonicalAdapter) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The adapter's slot factors by layer, (a, b) in the model's dtype, from the device hot set (copied there on a
        first use, as an unfused swap copies them): what a fused merge multiplies without a host copy per layer."""
        sources = self._sources(adapter)
        return {
            layout.name: (sources.tensors[2 * index],
                          sources.tensors[2 * index + 1].view(self._dtype) if layout.wide else sources.tensors[2 * index + 1])
            for index, layout in enumerate(sources.layout)
        }  # fmt: skip

    def _plan(self, key: tuple[tuple[LayerLayout, ...], ...]) -> SwapPlan:
        """The slot views for a key of member layouts (built once per key, the oldest of MAX_CACHED_PLANS dropped)."""
        plan = self._plans.get(key)
        if plan is None:
            plan = self._build_plan(key)
            if len(self._plans) >= MAX_CACHED_PLANS:
                self._plans.pop(next(iter(self._plans)))
            self._plans[key] = plan
        return plan

    def _build_plan(self, key: tuple[tuple[LayerLayout, ...], ...]) -> SwapPlan:
        """Each member in the next free rank range of its layers; a stack's copies then sorted layer by layer."""
        ranks = dict(self.no_adapter_ranks)
        copies: list[LayerCopy] = []
        scaled = []
        for layout in key:
            views = []
            for layer in layout:
                live = self.layers[layer.name]
                start, end = ranks[layer.name], ranks[layer.name] + layer.rank
                b_view = live.b[:, start:end]
                narrow = layer.wide and (start * live.b.element_size()) % 16 != 0  # off a 16-byte boundary
                b_target = as_16_byte_elements(b_view) if layer.wide and not narrow else b_view
                position = self._position[layer.name]
                copies.append(LayerCopy(position, 2 * len(copies), live.a[start:end], b_target, narrow))
                views.append(b_view)
                ranks[layer.name] = end
            scaled.append(views)
        if len(key) > 1:
            # Layer by layer, not member by member: a layer's members write neighbouring bytes of each lora_B row
            # (a rank-8 bfloat16 range is 16 of them), so one pass fetches each cache line once.
            copies.sort(key=lambda copy: copy.position)  # stable: members keep their order within a layer
        _refuse_over_max_rank(ranks, self.max_rank)  # views past max rank come out short, and are never used
        return SwapPlan(
            copies=tuple(copies),
            targets=[target for copy in copies for target in (copy.a_target, copy.b_target)],
            scaled=tuple(scaled),
            ranks=ranks,
            bucket=bucket_for(max(ranks.values(), default=0), self.rank_buckets),
        )
