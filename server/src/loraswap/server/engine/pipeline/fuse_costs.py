"""What --fuse auto weighs, measured by the server on its own model at warm-up (see engine/fuse_policy.py).

- A step's cost at each rank bucket the rule may choose and at the base model's graph: timed steps
  of a default-size request, the median of the steady ones (the first step of a call is left out),
  the least of MEASURE_ROUNDS such calls, the graphs taken in turn round by round.
- A merge's cost: timed merges of random adapters over every slot layer, at the smallest bucket's
  rank and at max rank (the least of MEASURE_ROUNDS each), give the per-byte cost and the
  per-byte-and-rank cost (the factors' product); the base weights are restored after each.

The least of a few: other work on the machine only ever adds time, and a busy spell during one
measurement must not decide the rule for the server's life (real merges correct it afterwards).
"""

from __future__ import annotations

import itertools
import statistics
import time

import torch

from loraswap.server.engine.adapters.canonical import CanonicalAdapter, CanonicalLayer
from loraswap.server.engine.adapters.residency import AdapterResidency
from loraswap.server.engine.fuse_policy import FuseCosts
from loraswap.server.engine.pipeline.records import LoadedModel
from loraswap.server.engine.pipeline.runner import PipelineRunner
from loraswap.server.engine.types import GenerationRequest

MEASURED_STEPS = 5  # per call: the first step is left out, the median of the rest kept
MEASURE_ROUNDS = 3  # calls per bucket (and timed merges per rank); the least is kept
MEASURE_PROMPT = "a measured step"


class FuseCostMeter:
    """Times steps and merges on the warm pipeline, with the base model resident. Worker thread only."""

    def __init__(self, loaded: LoadedModel, runner: PipelineRunner, residency: AdapterResidency) -> None:
        self._loaded = loaded
        self._runner = runner
        self.residency = residency  # the base model resident: what the meter computes at, and merges with

    def fuse_costs(self, buckets: tuple[int, ...]) -> FuseCosts:
        """Step costs at `buckets` (the base model's 0 among them) and the merge's cost model, both measured."""
        step_ms = self.steps_ms(buckets)
        slot = self.residency.slot
        low, high = slot.rank_buckets[0], slot.max_rank
        weight_bytes = max(1, self.residency.fused_weights.all_weight_bytes)
        low_ms = self._timed_merge_ms(low)
        high_ms = self._timed_merge_ms(high) if high > low else low_ms
        per_byte_rank = max(0.0, (high_ms - low_ms) / (high - low)) / weight_bytes if high > low else 0.0
        per_byte = max(0.0, low_ms / weight_bytes - low * per_byte_rank)
        defaults = self._loaded.request_rules.defaults
        return FuseCosts(
            step_ms=step_ms,
            measured_pixels=defaults.width * defaults.height,
            merge_ms_per_byte=per_byte,
            merge_ms_per_byte_rank=per_byte_rank,
        )

    def step_ms(self, bucket: int) -> float:
        """The ms of a steady denoising step at the default size computing at `bucket` (0: the base model): the
        least of MEASURE_ROUNDS calls' medians."""
        return min(self._one_step_ms(bucket) for _ in range(MEASURE_ROUNDS))

    def steps_ms(self, buckets: tuple[int, ...]) -> dict[int, float]:
        """step_ms of each bucket, the buckets taken in turn round by round so a busy spell hits them alike."""
        rounds = [{bucket: self._one_step_ms(bucket) for bucket in buckets} for _ in range(MEASURE_ROUNDS)]
        return {bucket: min(measured[bucket] for measured in rounds) for bucket in buckets}

    def _one_step_ms(self, bucket: int) -> float:
        """The median ms of a steady step of one default-size call computing at `bucket`."""
        params = self._loaded.request_rules.resolve(
            GenerationRequest(prompt=MEASURE_PROMPT, seed=0, num_inference_steps=MEASURED_STEPS)
        )
        ends: list[float] = []
        with self.residency.computing_at(bucket), self._runner.session():
            self._runner.run(
                params, on_step=lambda progress: ends.append(progress.elapsed_ms), is_cancelled=lambda: False
            )
        gaps = [later - earlier for earlier, later in itertools.pairwise(ends)]
        return statistics.median(gaps) if gaps else ends[-1]

    def _random_adapter(self, rank: int) -> CanonicalAdapter:
        """An adapter of `rank` over every slot layer, small random factors, stored as real ones are (host memory)."""
        generator = torch.Generator().manual_seed(0)
        dtype, device = self._loaded.dtype, self._loaded.device
        layers = {}
        for name, layer in self.residency.slot.base_layers().items():
            a = torch.randn(rank, layer.in_features, generator=generator).mul_(1e-3).to(dtype)
            b = torch.randn(layer.out_features, rank, generator=generator).mul_(1e-3).to(dtype)
            if device.type == "cuda":
                a, b = a.pin_memory(), b.pin_memory()
            layers[name] = CanonicalLayer(a=a, b=b)
        return CanonicalAdapter(name=f"measured-rank-{rank}", source="warm-up", layers=layers, warnings=(), load_ms=0.0)

    def _timed_merge_ms(self, rank: int) -> float:
        fused = self.residency.fused_weights
        adapter = self._random_adapter(rank)
        device = self._loaded.device
        with torch.inference_mode():
            fused.merge(((adapter, 1.0),))  # the first merge also faults in the scratch memory: not timed
            fused.restore()
            timed = []
            for _ in range(MEASURE_ROUNDS):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                started = time.perf_counter()
                fused.merge(((adapter, 1.0),))  # merge() reads its finiteness check back: the work is done
                timed.append((time.perf_counter() - started) * 1000.0)
                fused.restore()
        return min(timed)
