"""--fuse: when a swap merges the adapters into the base weights instead of copying them into the slot.

Unfused, a swap is a copy of the adapter's factors, but every denoising step pays the LoRA branch at the stack's
rank bucket. Fused (adapters/residency/fused.py), a swap costs a merge (reading W0 and writing the touched
weights, plus the factors' products), and every step then costs what the base model's does. So:

- `never`: always the slot; adapters it cannot hold are refused.
- `always`: every adapter is fused; only the base model's graph is compiled.
- `auto`: fused when the LoRA branch's work over this request's steps would cost more than the merge, both
  predicted from shapes and ranks by a cost model whose constants are written below per device type:

      unfused_ms = steps * (calls * lora_call_ns + bucket * (macs_per_pixel * pixels + fixed_macs) * lora_mac_ns)
      merge_ms   = layers * merge_layer_ns + weight_bytes * merge_byte_ns + product_macs * merge_mac_ns

  - `calls`, `macs_per_pixel` and `fixed_macs` (`LoraWork`): what one step's LoRA branch does per rank over every
    slot layer, sum of rows * (in + out), counted once at start-up (pipeline/lora_work.py) at two image sizes and
    the default guidance; rows that grow with the image (its tokens) make the per-pixel part, the text's rows the
    fixed part; a request whose guidance changes the denoiser's batch (SDXL's classifier-free guidance on or off)
    scales the rows by it;
  - `bucket`: the rank bucket the stack computes at unfused; `pixels`: the request's width * height;
  - `layers`, `weight_bytes`: the layers the merge touches and their base weights' bytes; `product_macs`: the
    merge's products, each touched weight's elements times the stack's rank there (LoHa: twice).

  Adapters the slot cannot hold, and stacks past its rank, are fused whatever the figures say.

auto's choice is therefore a pure function of the request (its adapters' contents and strengths, steps, size) and
of what the server was started with (model, dtype, device type, flags): never of timings, the queue, the load or
what ran before, so the same request gives the same bytes on every replica and after a restart. The constants
are calibrated by `benchmarks/fuse_costs.py` (BENCHMARKS.md says where each came from); a request can also pin
the path (GenerateRequest.fuse).

Which bucket graphs `auto` compiles follows from the same rule: a bucket's graph is needed only when some request
could choose it, that is when one step at the smallest image costs less unfused than merging an adapter of the
bucket's rank into every slot layer. Plain values here, no torch: the rule is table-tested.
"""

from __future__ import annotations

from dataclasses import dataclass

FUSE_POLICIES = ("never", "always", "auto")


@dataclass(frozen=True)
class DeviceCosts:
    """The cost model's constants for one device type, in nanoseconds (see the module docstring)."""

    lora_call_ns: float  # per slot layer call of a step's LoRA branch (dispatch, launches)
    lora_mac_ns: float  # per multiply-add of the LoRA branch (rows * rank * (in + out))
    merge_layer_ns: float  # per layer a merge touches
    merge_byte_ns: float  # per byte of base weight a merge reads from the pristine copy and writes
    merge_mac_ns: float  # per multiply-add of a merge's products (weight elements * rank)


# Calibrated by benchmarks/fuse_costs.py; BENCHMARKS.md ("--fuse auto's cost model") gives each figure's source.
DEVICE_COSTS: dict[str, DeviceCosts] = {
    # This project's 2-core CPU machines: the least-squares fit of benchmarks/fuse_costs.py over shapes, tiny-flux
    # and tiny-sdxl (float32, eager), at 1 and 2 threads, 2026-12-04 (benchmarks/results/fuse-costs-cpu-*.json).
    "cpu": DeviceCosts(
        lora_call_ns=48_000.0, lora_mac_ns=0.02, merge_layer_ns=18_000.0, merge_byte_ns=0.09, merge_mac_ns=0.015
    ),
    # H200, FLUX.1-dev: the LoRA branch from the published 4.24 s (rank 64) against 3.49 s (bare) over 28 steps;
    # the merge from the device's memory bandwidth and float32 product rate (not yet timed on a GPU).
    "cuda": DeviceCosts(
        lora_call_ns=2_000.0, lora_mac_ns=8.7e-5, merge_layer_ns=30_000.0, merge_byte_ns=3e-3, merge_mac_ns=4e-5
    ),
}
# Any other device type (mps, xpu) is costed as a GPU.
OTHER_DEVICE_COSTS = DEVICE_COSTS["cuda"]


def device_costs(device_type: str) -> DeviceCosts:
    return DEVICE_COSTS.get(device_type, OTHER_DEVICE_COSTS)


@dataclass(frozen=True)
class LoraWork:
    """What one denoising step's LoRA branch does per rank over every slot layer, counted at start-up."""

    calls: int  # slot layer calls per step
    macs_per_pixel: float  # rows * (in + out) per image pixel (the image's tokens)
    fixed_macs: float  # rows * (in + out) that do not grow with the image (the text's tokens)

    def step_macs(self, bucket: int, pixels: int) -> float:
        return bucket * (self.macs_per_pixel * pixels + self.fixed_macs)

    def at_batch(self, ratio: float) -> LoraWork:
        """The work of a step whose denoiser batch is `ratio` times the counted one's (classifier-free guidance on
        or off): as many calls, each over that many times the rows."""
        return LoraWork(self.calls, self.macs_per_pixel * ratio, self.fixed_macs * ratio)


@dataclass(frozen=True)
class MergeWork:
    """What a merge reads, writes and multiplies."""

    layers: int
    weight_bytes: int
    product_macs: int


def unfused_ms(costs: DeviceCosts, work: LoraWork, bucket: int, steps: int, pixels: int) -> float:
    """The LoRA branch's cost over `steps` steps of an image of `pixels` at `bucket`."""
    return steps * (work.calls * costs.lora_call_ns + work.step_macs(bucket, pixels) * costs.lora_mac_ns) / 1e6


def merge_ms(costs: DeviceCosts, merge: MergeWork) -> float:
    """A merge's cost."""
    return (
        merge.layers * costs.merge_layer_ns
        + merge.weight_bytes * costs.merge_byte_ns
        + merge.product_macs * costs.merge_mac_ns
    ) / 1e6


def choose_fused(
    policy: str,
    *,
    fusing: bool,
    has_adapters: bool,
    bucket: int | None,
    unfused_cost_ms: float,
    merge_cost_ms: float,
) -> bool:
    """Whether a request's stack runs fused.

    `fusing`: the server can fuse at all (a policy other than never, weights not int8 weight-only); `bucket`: the rank
    bucket the stack computes at unfused, None when the slot cannot hold it.
    """
    if not fusing or not has_adapters or policy == "never":
        return False
    if policy == "always" or bucket is None:
        return True
    return unfused_cost_ms > merge_cost_ms


def buckets_auto_may_choose(
    costs: DeviceCosts, work: LoraWork, buckets: tuple[int, ...], min_pixels: int, full_merges: dict[int, MergeWork]
) -> tuple[int, ...]:
    """The rank buckets whose graphs auto could choose: those where one step of the smallest image costs no more
    unfused than merging an adapter of the bucket's rank into every slot layer (`full_merges`)."""
    return tuple(
        bucket
        for bucket in buckets
        if not unfused_ms(costs, work, bucket, 1, min_pixels) > merge_ms(costs, full_merges[bucket])
    )


def warm_up_graphs(
    policy: str, fusing: bool, graph_buckets: tuple[int, ...], auto_buckets: tuple[int, ...]
) -> tuple[int, ...]:
    """The graphs (rank buckets, the base model's 0 first) the warm-up compiles.

    Not fusing, every bucket: swaps are copies into the slot. `always`: the base model's only, since every
    adapter is fused. `auto`: the base model's and the buckets auto may choose (`auto_buckets`).
    """
    if not fusing:
        return graph_buckets
    if policy == "always":
        return (0,)
    return (0, *auto_buckets)
