"""Calibrates --fuse auto's cost model (engine/fuse_policy.py): measured steps and merges against its predictions.

    python -m benchmarks.fuse_costs                                   # shapes, tiny-flux, tiny-sdxl; 1 thread, eager
    python -m benchmarks.fuse_costs --models shapes --threads 2 --dtype bfloat16
    python -m benchmarks.fuse_costs --device cuda --models tiny-flux,random-flux --dtype bfloat16   # on a GPU

Per model, one runtime built as `loraswap serve` builds it (the swap slot at `--max-rank`, --fuse auto, the LoRA
work counted at start-up, no warm-up, the denoiser eager or compiled with `--compile-backend`):

1. a step's cost at each rank bucket and with the LoRA branch skipped (bucket 0), at the model's default size:
   the median of a call's steady steps (the first left out), the least of `--rounds` calls, the buckets taken in
   turn round by round; `lora_ms` is a bucket's step over bucket 0's;
2. a merge's cost: random factors of each bucket's rank on every slot layer, merged and restored, the least of
   `--rounds` timed merges (after one untimed).

Then the constants: `lora_call_ns` and `lora_mac_ns` by least squares of every model's and bucket's `lora_ms`
over (calls, macs) = (`LoraWork.calls`, `LoraWork.step_macs`); `merge_layer_ns`, `merge_byte_ns` and
`merge_mac_ns` likewise over every merge's (layers, weight bytes, product MACs). Printed beside them: the code's
constants (`DEVICE_COSTS` for this device type), and each measurement's prediction with the code's constants and
with the fitted ones. The last line printed is one JSON object; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import time

from benchmarks.swap import log, machine_info

DEFAULT_MODELS = ("shapes", "tiny-flux", "tiny-sdxl")


def _least_squares(rows: list[tuple[float, ...]], targets: list[float]) -> list[float]:
    """Non-negative least squares of targets over rows' columns (a column whose coefficient would be negative is
    dropped and the rest fitted again)."""
    import torch

    columns = list(range(len(rows[0])))
    while True:
        a = torch.tensor([[row[c] for c in columns] for row in rows], dtype=torch.float64)
        b = torch.tensor(targets, dtype=torch.float64).unsqueeze(1)
        scale = a.abs().amax(dim=0).clamp_min(1e-30)
        solution = (torch.linalg.lstsq(a / scale, b).solution.squeeze(1) / scale).tolist()
        negative = [c for c, value in zip(columns, solution) if value < 0]
        if not negative:
            fitted = [0.0] * len(rows[0])
            for c, value in zip(columns, solution):
                fitted[c] = value
            return fitted
        columns = [c for c in columns if c not in negative]
        if not columns:
            return [0.0] * len(rows[0])


class Meter:
    """Times steps and merges on one warm runtime, the base model resident. Worker-thread code, run inline."""

    def __init__(self, runtime, rounds: int, steps: int) -> None:
        from loraswap.server.engine.pipeline.runner import PipelineRunner

        self.runtime = runtime
        self.rounds = rounds
        self.steps = steps
        self.runner = PipelineRunner(runtime.loaded, runtime.compiled)

    def step_ms(self, buckets: tuple[int, ...]) -> dict[int, float]:
        rounds = [{bucket: self._one_step_ms(bucket) for bucket in buckets} for _ in range(self.rounds)]
        return {bucket: min(measured[bucket] for measured in rounds) for bucket in buckets}

    def _one_step_ms(self, bucket: int) -> float:
        from loraswap.server.engine.types import GenerationRequest

        params = self.runtime.request_rules.resolve(
            GenerationRequest(prompt="a measured step", seed=0, num_inference_steps=self.steps)
        )
        ends: list[float] = []
        with self.runtime.residency.computing_at(bucket), self.runner.session():
            self.runner.run(
                params, on_step=lambda progress: ends.append(progress.elapsed_ms), is_cancelled=lambda: False
            )
        gaps = [later - earlier for earlier, later in itertools.pairwise(ends)]
        return statistics.median(gaps) if gaps else ends[-1]

    def merge_ms(self, rank: int) -> float:
        import torch

        from loraswap.server.engine.adapters.formats import CanonicalAdapter, CanonicalLayer

        generator = torch.Generator().manual_seed(rank)
        dtype = self.runtime.loaded.dtype
        layers = {}
        for name, layer in self.runtime.residency.slot.base_layers().items():
            a = torch.randn(rank, layer.in_features, generator=generator).mul_(1e-3).to(dtype)
            b = torch.randn(layer.out_features, rank, generator=generator).mul_(1e-3).to(dtype)
            layers[name] = CanonicalLayer(a=a, b=b)
        adapter = CanonicalAdapter(name=f"rank-{rank}", source="benchmark", layers=layers, warnings=(), load_ms=0.0)
        fused = self.runtime.residency.fused_weights
        timed = []
        with torch.inference_mode():
            fused.merge(((adapter, 1.0),))  # faults in the scratch memory: not timed
            fused.restore()
            for _ in range(self.rounds):
                if self.runtime.loaded.device.type == "cuda":
                    torch.cuda.synchronize(self.runtime.loaded.device)
                started = time.perf_counter()
                fused.merge(((adapter, 1.0),))  # reads its finiteness check back: the work is done
                timed.append((time.perf_counter() - started) * 1000.0)
                fused.restore()
        return min(timed)


def measure_model(model: str, args) -> dict:
    from loraswap.server.engine.config import EngineConfig
    from loraswap.server.engine.pipeline.startup import start_runtime

    compile_kwargs = (
        dict(compile=False)
        if args.compile_backend == "none"
        else dict(compile=True, compile_backend=args.compile_backend)
    )
    config = EngineConfig(
        model=model, device=args.device, dtype=args.dtype, max_rank=args.max_rank, torch_threads=args.threads, fuse="auto",
        warmup=args.compile_backend != "none", **compile_kwargs,
    )  # fmt: skip
    runtime = start_runtime(config)
    work = runtime.installed.lora_work
    buckets = runtime.residency.slot.rank_buckets
    meter = Meter(runtime, args.rounds, args.steps)
    log(f"{model}: {work}; buckets {buckets}")
    step_ms = meter.step_ms((0, *buckets))
    pixels = runtime.loaded.defaults.width * runtime.loaded.defaults.height
    fused = runtime.residency.fused_weights
    lora = [
        {"bucket": bucket, "lora_ms": step_ms[bucket] - step_ms[0], "calls": work.calls,
         "macs": work.step_macs(bucket, pixels)}
        for bucket in buckets
    ]  # fmt: skip
    merges = []
    for bucket in buckets:
        merge = fused.full_merge_work(bucket)
        merges.append({"rank": bucket, "merge_ms": meter.merge_ms(bucket), **dataclasses.asdict(merge)})
    log(f"  steps {step_ms}; merges {[round(m['merge_ms'], 2) for m in merges]}")
    return {
        "model": model, "dtype": str(runtime.loaded.dtype).removeprefix("torch."), "pixels": pixels,
        "lora_work": dataclasses.asdict(work), "step_ms": step_ms, "lora": lora, "merges": merges,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fuse_costs", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), help="comma-separated built-in models")
    parser.add_argument(
        "--device", default="cpu", help="the device the runtimes run on (its type's constants are compared)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (serve.py --fuse's servers: 1)")
    parser.add_argument("--dtype", default=None, help="weights' dtype (default: the model's on the CPU)")
    parser.add_argument("--max-rank", type=int, default=64, help="the slot's max rank")
    parser.add_argument("--compile-backend", default="none", help="torch.compile backend of the denoiser; none: eager")
    parser.add_argument("--rounds", type=int, default=5, help="timed calls per bucket and timed merges per rank")
    parser.add_argument("--steps", type=int, default=6, help="steps per timed call (the first is left out)")
    args = parser.parse_args()

    from loraswap.server.engine.fuse_policy import DeviceCosts, LoraWork, MergeWork, device_costs, merge_ms, unfused_ms

    started = time.perf_counter()
    models = [measure_model(model, args) for model in args.models.split(",") if model]
    lora_rows = [(row["calls"], row["macs"]) for m in models for row in m["lora"]]
    lora_targets = [row["lora_ms"] * 1e6 for m in models for row in m["lora"]]
    merge_rows = [(row["layers"], row["weight_bytes"], row["product_macs"]) for m in models for row in m["merges"]]
    merge_targets = [row["merge_ms"] * 1e6 for m in models for row in m["merges"]]
    call_ns, mac_ns = _least_squares(lora_rows, lora_targets)
    layer_ns, byte_ns, merge_mac_ns = _least_squares(merge_rows, merge_targets)
    fitted = DeviceCosts(lora_call_ns=call_ns, lora_mac_ns=mac_ns, merge_layer_ns=layer_ns, merge_byte_ns=byte_ns,
                         merge_mac_ns=merge_mac_ns)  # fmt: skip
    import torch

    code = device_costs(torch.device(args.device).type)
    for m in models:
        work = LoraWork(**m["lora_work"])
        for row in m["lora"]:
            for label, costs in (("code", code), ("fitted", fitted)):
                row[f"predicted_ms_{label}"] = unfused_ms(costs, work, row["bucket"], 1, m["pixels"])
        for row in m["merges"]:
            merge = MergeWork(layers=row["layers"], weight_bytes=row["weight_bytes"], product_macs=row["product_macs"])
            for label, costs in (("code", code), ("fitted", fitted)):
                row[f"predicted_ms_{label}"] = merge_ms(costs, merge)
    print(json.dumps({
        "benchmark": "fuse_costs", "device": args.device, "threads": args.threads, "compile_backend": args.compile_backend,
        "models": models, "fitted": dataclasses.asdict(fitted), "code": dataclasses.asdict(code),
        "machine": machine_info(), "elapsed_s": time.perf_counter() - started,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
