"""--fuse: when a swap merges the adapters into the base weights instead of copying them into the slot.

Unfused, a swap is a copy of the adapter's factors, but every denoising step pays the LoRA
branch at the stack's rank bucket. Fused (adapters/fused.py), a swap costs a merge (reading W0
and writing the touched weights, plus the factors' product), and every step then costs what the
base model's does. So:

- `never`: always the slot (today's behaviour); adapters it cannot hold are refused.
- `always`: every adapter is fused; only the base model's graph is compiled.
- `auto`: at each swap, fused when what fusing saves over the work about to run exceeds what the
  merge costs:

      (step_ms[bucket] - step_ms[0]) * pixels / measured_pixels * steps  >  merge_ms

  `steps` are this request's and those of the queued requests for the same adapters at the same
  strengths (they run next without a swap); `step_ms` is measured by the server on its own model
  at warm-up (median of timed steps at the default size, the base model's graph and each bucket's);
  `merge_ms` = touched base-weight bytes * (per-byte cost + rank * per-byte-and-rank cost), both
  measured by two timed merges at warm-up and corrected by every real merge. Adapters the slot
  cannot hold, and stacks past its rank, are fused whatever the figures say.

Which bucket graphs `auto` compiles: the base model's and the smallest bucket's, whose measured
saving per step predicts the larger buckets' (the LoRA branch's cost grows with its rank); a
larger bucket is compiled only when even one step of it would save less than merging costs, that
is, when the rule could still choose it. Plain values here, no torch: the rule is table-tested.
"""

from __future__ import annotations

from dataclasses import dataclass, field

FUSE_POLICIES = ("never", "always", "auto")
# How far one real merge moves the merge-cost correction (an exponential moving average).
MERGE_CORRECTION_WEIGHT = 0.2


@dataclass
class FuseCosts:
    """What the auto rule weighs, measured by the server on its own model (see the module docstring)."""

    step_ms: dict[int, float]  # bucket (0: the base model) -> ms a step takes at measured_pixels
    measured_pixels: int
    merge_ms_per_byte: float  # the rank-independent part: reading W0 and writing the weights
    merge_ms_per_byte_rank: float  # the product's part, per byte of weight and per rank
    correction: float = 1.0  # real merges over predicted ones, averaged
    merges_observed: int = field(default=0)

    def saving_ms_per_step(self, bucket: int, pixels: int) -> float | None:
        """What fusing saves on one step of an image of `pixels` at `bucket`; None when no graph computes it."""
        if bucket not in self.step_ms or 0 not in self.step_ms:
            return None
        return max(0.0, self.step_ms[bucket] - self.step_ms[0]) * pixels / self.measured_pixels

    def merge_ms(self, touched_bytes: int, rank: int) -> float:
        """The predicted cost of merging a stack of summed `rank` into layers of `touched_bytes`."""
        per_byte = self.merge_ms_per_byte + rank * self.merge_ms_per_byte_rank
        return touched_bytes * per_byte * self.correction

    def observe_merge(self, measured_ms: float, touched_bytes: int, rank: int) -> None:
        """Correct the merge cost by a real merge's time."""
        predicted = self.merge_ms(touched_bytes, rank) / self.correction
        if predicted <= 0:
            return
        ratio = measured_ms / predicted
        self.correction += MERGE_CORRECTION_WEIGHT * (ratio - self.correction)
        self.merges_observed += 1


def fuse_pays(saving_ms_per_step: float, steps: int, merge_ms: float) -> bool:
    """The auto rule itself: fusing saves more over `steps` than the merge costs."""
    return saving_ms_per_step * steps > merge_ms


def choose_fused(
    policy: str,
    *,
    fusing: bool,
    has_adapters: bool,
    slot_can_hold: bool,
    saving_ms_per_step: float | None,
    steps: int,
    merge_ms: float,
) -> bool:
    """Whether a swap to a stack fuses it.

    `fusing`: the server can fuse at all (a policy other than never, weights not quantized);
    `slot_can_hold`: the stack fits the slot (plain LoRAs, summed rank within max rank);
    `saving_ms_per_step`: None when no compiled graph computes the stack's bucket unfused.
    """
    if not fusing or not has_adapters or policy == "never":
        return False
    if policy == "always" or not slot_can_hold or saving_ms_per_step is None:
        return True
    return fuse_pays(saving_ms_per_step, steps, merge_ms)


def buckets_auto_may_choose(
    buckets: tuple[int, ...], smallest_saving_ms: float, full_merge_ms: dict[int, float]
) -> tuple[int, ...]:
    """The rank buckets above the smallest whose graphs auto could still choose, given the smallest's measured
    saving per step and the cost of merging an adapter of each bucket's rank into every slot layer.

    A bucket's saving is predicted from the smallest one's in proportion to its rank; when one step of it would
    save at least a full merge, fusing wins for any request and its graph is never needed.
    """
    smallest = buckets[0]
    return tuple(
        bucket
        for bucket in buckets[1:]
        if not fuse_pays(smallest_saving_ms * bucket / smallest, 1, full_merge_ms[bucket])
    )


def warm_up_graphs(policy: str, fusing: bool, graph_buckets: tuple[int, ...]) -> tuple[int, ...]:
    """The graphs (rank buckets, the base model's 0 first) the warm-up runs before anything is measured.

    Not fusing, every bucket: swaps are copies into the slot. `always`: the base model's only, since every
    adapter is fused. `auto`: the base model's and the smallest bucket's, whose measured saving predicts the rest.
    """
    if not fusing:
        return graph_buckets
    if policy == "always":
        return (0,)
    return graph_buckets[:2]


def measures_costs(policy: str, fusing: bool) -> bool:
    """Whether the warm-up measures what the rule weighs: under auto, when the server fuses at all."""
    return fusing and policy == "auto"


def measured_graphs(warmed: tuple[int, ...], graph_buckets: tuple[int, ...], compiled: bool) -> tuple[int, ...]:
    """The buckets whose steps auto times: those warmed up when compiled (a bucket that was not would compile
    while timed); every bucket when not compiled, since the rule may then choose any."""
    return warmed if compiled else graph_buckets


def larger_buckets_to_compile(
    costs: FuseCosts, rank_buckets: tuple[int, ...], all_weight_bytes: int
) -> tuple[int, ...]:
    """The buckets above the smallest that a compiled auto server must also warm up: those it could still choose
    (buckets_auto_may_choose, with the smallest bucket's measured saving and merges over every slot layer)."""
    full_merges = {bucket: costs.merge_ms(all_weight_bytes, bucket) for bucket in rank_buckets}
    saving = costs.saving_ms_per_step(rank_buckets[0], costs.measured_pixels) or 0.0
    return buckets_auto_may_choose(tuple(sorted(full_merges)), saving, full_merges)
