"""What is resident, and where: the one place that decides a swap's path and the rank bucket the graphs compute at.

Two writers can make a stack resident. Unfused, the slot (slot.py) copies the members' factors into
the LoRA slot, as swap_plan.py plans them, and every step pays the LoRA branch at the stack's rank
bucket. Fused (with --fuse auto|always), the fused writer (fused.py) merges the stack into the base
weights of the layers it touches, and the graphs compute at bucket 0, the base model's; the LoRA slot
keeps whatever it held, so going back to that stack unfused later copies nothing. An adapter the slot
cannot hold (DoRA, a trained bias, a rank above max rank, another kind, a layer outside the slot) is only
ever made resident fused.

Text-encoder layers are merged into the text encoders by a writer of their own (`encoder_weights`), whichever
way the denoiser's part is made resident, and before it: a merge that fails changes nothing else.

Rank buckets (rank_buckets.py): the graphs compute with only the first `bucket` ranks of each slot
layer, the smallest bucket at or above the resident stack's rank on its fullest layer; with nothing
resident, or the stack fused, the LoRA branch is skipped. Each bucket, and the base model, is one graph,
compiled during warm-up (`computing_at`), all layers switching together. Bucketing is exact up to float
summation order: the ranks it leaves out are gated to zero in the full-width product too.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator

import torch

from loraswap.server.engine.adapters.formats import CanonicalAdapter, ModelLayers, SlotSpec, StackMember
from loraswap.server.engine.adapters.residency.device_cache import DeviceAdapterCache
from loraswap.server.engine.adapters.residency.fused import FusedWeights
from loraswap.server.engine.adapters.residency.slot import HotswapSlot
from loraswap.server.engine.adapters.residency.swap_plan import SwapPlanner
from loraswap.server.engine.types import ModelFamily


def stack_order(members: Iterable[StackMember]) -> tuple[StackMember, ...]:
    """Members in the order the slot places them and merges sum them: by their contents (content_key), then
    strength and name, so neither the order a request gives nor the names its adapters are reached by change the
    image."""
    members = tuple(members)
    if len(members) < 2:
        return members
    return tuple(sorted(members, key=lambda member: (member[0].content_key, member[1], member[0].name)))


def same_members(ordered: tuple[StackMember, ...], other: tuple[StackMember, ...]) -> bool:
    """The same adapter objects at the same strengths, both in stack_order: one runs after the other unswapped."""
    return len(ordered) == len(other) and all(
        adapter is other_adapter and scale == other_scale
        for (adapter, scale), (other_adapter, other_scale) in zip(ordered, other)
    )


class AdapterResidency:
    """Makes stacks resident through the slot or the fused writer, and keeps the graphs at the right bucket.

    Worker thread only.
    """

    def __init__(
        self,
        slot: HotswapSlot,
        fused_weights: FusedWeights | None = None,
        device_cache: DeviceAdapterCache | None = None,
        encoder_weights: FusedWeights | None = None,
    ) -> None:
        """`fused_weights` (--fuse auto|always): merges into the denoiser's base weights from their pristine copies;
        `device_cache` (--device-adapter-bytes): device copies of hot adapters for the slot to copy from;
        `encoder_weights` (--text-encoder-layers apply): merges into the text encoders' weights."""
        self.slot = slot
        self.fused_weights = fused_weights
        self.device_cache = device_cache
        self.encoder_weights = encoder_weights
        self._in_encoders: tuple[StackMember, ...] = ()  # the members whose text-encoder changes are merged
        self.planner = SwapPlanner(slot.factor_views(), slot.max_rank, slot.rank_buckets, device_cache)
        self._in_slot: tuple[StackMember, ...] = ()  # what the LoRA slot holds, in stack_order
        self._slot_known = True  # False after a write failed part-way: then nothing is resident for sure
        self._slot_bucket = 0  # the bucket the LoRA slot's stack computes at
        self._fused: tuple[StackMember, ...] | None = None  # what is merged into the base weights; None: nothing
        self._floor = 0  # computing_at: the least bucket to compute at whatever is resident

    # -- what is resident -----------------------------------------------------------------------------------

    @property
    def fused(self) -> bool:
        """Whether the resident adapters are fused into the base weights (False for the base model)."""
        return bool(self._fused)

    @property
    def resident_adapters(self) -> tuple[CanonicalAdapter, ...]:
        """Every resident adapter, fused or not, in stack_order; empty for the base model."""
        members = self._fused if self._fused is not None else self._in_slot
        return tuple(adapter for adapter, _ in members)

    @property
    def resident_members(self) -> tuple[StackMember, ...]:
        """The resident adapters with their strengths, in stack_order; empty for the base model."""
        return self._fused if self._fused is not None else self._in_slot

    def holds(self, members: Iterable[StackMember]) -> bool:
        """True when exactly these adapter objects are resident at these strengths, in any order, fused or not."""
        members = stack_order(members)
        if not same_members(self._encoder_part(members), self._in_encoders):
            return False
        if self._fused is not None:
            return same_members(members, self._fused)
        return self._slot_known and same_members(members, self._in_slot)

    def _encoder_part(self, members: tuple[StackMember, ...]) -> tuple[StackMember, ...]:
        """The members that change a text encoder (what the encoder writer holds when they are resident)."""
        if self.encoder_weights is None:
            return ()
        encoders = self.encoder_weights.components
        return tuple(member for member in members if member[0].changed_components & encoders)

    def needs_swap(self, members: tuple[StackMember, ...], fused: bool) -> bool:
        """Whether running `members` (fused or not) changes what is resident: other adapters, or the same in the
        other way."""
        return not self.holds(members) or (bool(members) and fused != self.fused)

    def unfused_bucket(self, members: Iterable[StackMember]) -> int | None:
        """The bucket these adapters compute at unfused; None when the slot cannot hold them."""
        return self.planner.unfused_bucket(members)

    @property
    def bucket(self) -> int:
        """The rank bucket the graphs compute at now; 0: the LoRA branch is skipped."""
        return self.slot.bucket

    def spec(
        self,
        family: ModelFamily,
        dtype: torch.dtype,
        device: torch.device,
        model_layers: ModelLayers,
        *,
        strict: bool = False,
        text_encoder_layers: str = SlotSpec.text_encoder_layers,
    ) -> SlotSpec:
        """What an adapter must fit to be made resident here: swapped into the slot or, when fusing, fused; its
        text-encoder layers merged (`text_encoder_layers`, --text-encoder-layers, apply) when there is a writer for
        them, dropped (ignore) or refused (--strict-adapters, `strict`; apply without a writer)."""
        base_layers = self.slot.base_layers()
        return SlotSpec(
            family=family,
            layer_shapes={name: (layer.in_features, layer.out_features) for name, layer in base_layers.items()},
            max_rank=self.slot.max_rank,
            dtype=dtype,
            device=device,
            denoiser_config=self.slot.denoiser.config,  # diffusers' FrozenDict: its converters read attributes
            strict=strict,
            fuse=self.fused_weights is not None,
            biased_layers=frozenset(name for name, layer in base_layers.items() if layer.bias is not None),
            model_layers=model_layers,
            text_encoder_layers=text_encoder_layers,
            merges_text_encoders=self.encoder_weights is not None,
        )

    # -- swaps ----------------------------------------------------------------------------------------------

    @torch.no_grad()
    def load_stack(self, members: Iterable[StackMember], *, fused: bool = False) -> float:
        """Make these adapters resident together, each at its strength (none: the base model); returns ms spent.

        `fused`: merge them into the base weights (fused_weights must be set). Raises STACK_RANK_EXCEEDED
        (AdapterIncompatibleError) before the slot changes when an unfused stack's ranks add up to more than max
        rank on some layer (the text encoders, merged first, then hold the stack's part); a merge that overflows the
        model's dtype raises ADAPTER_OUT_OF_RANGE and leaves the unfused slot resident (see fused.py and
        overflow_bounds.py).
        """
        members = stack_order(members)
        if self.holds(members) and (not members or fused == self.fused):
            return 0.0
        spent_ms = self._merge_encoders(members)
        if fused and members:
            return spent_ms + self._merge(members)
        spent_ms += self._unmerge()
        if not (self._slot_known and same_members(members, self._in_slot)):
            spent_ms += self._copy_in(members)
        return spent_ms

    @contextlib.contextmanager
    def computing_at(self, bucket: int) -> Iterator[None]:
        """Compute at `bucket` while inside, whatever is resident (warm-up: compiles that bucket's graph).

        The results do not change: ranks beyond the resident ones are gated to zero. Not below the
        resident stack's own bucket.
        """
        if bucket not in self.slot.graph_buckets or bucket < self._needed_bucket:
            raise ValueError(
                f"bucket {bucket} is not one of {self.slot.graph_buckets} at or above the resident stack's"
            )
        self._floor = bucket
        self._refresh_bucket()
        try:
            yield
        finally:
            self._floor = 0
            self._refresh_bucket()

    @property
    def _needed_bucket(self) -> int:
        """The resident stack's own bucket: 0 when it is fused."""
        return 0 if self._fused is not None else self._slot_bucket

    def _refresh_bucket(self) -> None:
        self.slot.set_bucket(max(self._needed_bucket, self._floor))

    def _merge(self, members: tuple[StackMember, ...]) -> float:
        if self.fused_weights is None:
            raise RuntimeError("this server has no pristine weights to fuse from (--fuse never)")
        self._fused = None  # until the merge is done: a failed one leaves W0 everywhere
        try:
            # The slot's factors from the device hot set, where there is one (they stay there for the next swap).
            factors = self.planner.device_factors if self.device_cache is not None else None
            merge_ms = self.fused_weights.merge(members, factors)
            self._fused = members
        finally:
            self._refresh_bucket()
        return merge_ms

    def _merge_encoders(self, members: tuple[StackMember, ...]) -> float:
        """The members' text-encoder changes merged into the text encoders (none: W0 there)."""
        wanted = self._encoder_part(members)
        if same_members(wanted, self._in_encoders):
            return 0.0
        self._in_encoders = ()  # until the merge is done: a failed one leaves W0 everywhere
        merge_ms = self.encoder_weights.merge(wanted)
        self._in_encoders = wanted
        return merge_ms

    def _unmerge(self) -> float:
        """W0 back in the base weights when a stack is fused there; the LoRA slot's stack is resident again."""
        if self._fused is None:
            return 0.0
        restore_ms = self.fused_weights.restore()
        self._fused = None
        self._refresh_bucket()
        return restore_ms

    def _copy_in(self, members: tuple[StackMember, ...]) -> float:
        """The unfused swap: the planned copies written into the LoRA slot."""
        started = time.perf_counter()
        copy = self.planner.copy_for(members)  # refuses an over-rank stack before anything is written
        try:
            self.slot.write(copy)
        except BaseException:
            # Weights and gates are now in an unknown state: until the next load, compute everything they hold.
            self._in_slot, self._slot_known, self._slot_bucket = (), False, self.slot.max_rank
            self._refresh_bucket()
            raise
        self._in_slot, self._slot_known, self._slot_bucket = members, True, copy.bucket
        self._refresh_bucket()
        return (time.perf_counter() - started) * 1000.0
