"""Adapter-aware ordering versus FIFO on a Zipf-distributed adapter workload, over real gRPC.

Runs the same arrival sequence (requests over N adapters, Zipf-distributed,
arriving faster than the server drains them) against two real servers, one
with --max-bypass 0 (FIFO) and one with the adapter-aware policy, and prints
one JSON object: adapter swaps made, and p50/p99/max queue waits, per policy.

    python -m benchmarks.queue_policy                      # defaults
    python -m benchmarks.queue_policy --requests 200 --adapters 50 --max-bypass 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path


def zipf_sequence(count: int, adapters: int, exponent: float, seed: int) -> list[int]:
    """Adapter indices drawn from a Zipf(exponent) law over `adapters` choices."""
    rng = random.Random(seed)
    weights = [1.0 / (rank + 1) ** exponent for rank in range(adapters)]
    return rng.choices(range(adapters), weights=weights, k=count)


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


async def run_policy(args, adapter_dir: Path, sequence: list[int], max_bypass: int) -> dict:
    from loraswap.client import AsyncLoraswapClient
    from loraswap.server.app import start_server
    from loraswap.server.config import Settings
    from loraswap.server.engine.config import EngineConfig

    settings = Settings(
        engine=EngineConfig(
            model=args.model, adapter_dir=adapter_dir, max_rank=args.rank, compile=False,
            max_queue=len(sequence), max_bypass=max_bypass, torch_threads=args.torch_threads,
        ),
        host="127.0.0.1",
        port=0,
    )  # fmt: skip
    running = await start_server(settings)
    try:
        async with AsyncLoraswapClient(f"127.0.0.1:{running.port}", default_timeout=600) as client:
            for index in set(sequence):  # every adapter cached: the policy, not the disk, is measured
                await client.preload_adapter(f"a{index:03d}")
            swaps_before = running.engine.swaps
            started = time.perf_counter()

            async def one(position: int, adapter_index: int):
                await asyncio.sleep(position * args.arrival_ms / 1000.0)
                image = await client.generate_image(
                    "a lighthouse", adapter=f"a{adapter_index:03d}", seed=position, num_inference_steps=args.steps
                )
                return image.timings.queue_ms

            waits = await asyncio.gather(*(one(i, a) for i, a in enumerate(sequence)))
            elapsed = time.perf_counter() - started
            info = await client.server_info()
    finally:
        await running.stop(5.0)
    return {
        "max_bypass": max_bypass,
        "swaps": running.engine.swaps - swaps_before,
        "wait_ms": {
            "p50": round(percentile(waits, 0.50), 1),
            "p99": round(percentile(waits, 0.99), 1),
            "max": round(max(waits), 1),
            "mean": round(statistics.fmean(waits), 1),
        },
        "elapsed_s": round(elapsed, 2),
        "recompilations": info.recompilations,
    }


def write_adapters(model: str, directory: Path, count: int, rank: int) -> None:
    import torch

    from loraswap.server.devtools.random_adapter import write_random_adapter
    from loraswap.server.engine.models import load_pipeline

    pipe = load_pipeline(model, torch.float32)
    for index in range(count):
        write_random_adapter(pipe, directory / f"a{index:03d}", rank=rank, seed=index, init_std=0.1)


async def main_async(args) -> dict:
    sequence = zipf_sequence(args.requests, args.adapters, args.zipf, args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        adapter_dir = Path(tmp)
        await asyncio.to_thread(write_adapters, args.model, adapter_dir, args.adapters, args.rank)
        fifo = await run_policy(args, adapter_dir, sequence, 0)
        aware = await run_policy(args, adapter_dir, sequence, args.max_bypass)
    return {
        "benchmark": "queue_policy",
        "model": args.model,
        "requests": args.requests,
        "adapters": args.adapters,
        "zipf_exponent": args.zipf,
        "arrival_ms": args.arrival_ms,
        "steps": args.steps,
        "torch_threads": args.torch_threads,
        "fifo": fifo,
        "adapter_aware": aware,
        "swaps_fifo_over_adapter_aware": round(fifo["swaps"] / max(1, aware["swaps"]), 2),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.queue_policy",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default="tiny-flux")
    parser.add_argument("--requests", type=int, default=120)
    parser.add_argument("--adapters", type=int, default=50)
    parser.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of adapter popularity")
    parser.add_argument("--arrival-ms", type=float, default=2.0, help="gap between arrivals")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--max-bypass", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--torch-threads", type=int, default=1)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.torch_threads)
    print(json.dumps(asyncio.run(main_async(args))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
