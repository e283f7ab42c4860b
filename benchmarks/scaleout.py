"""Several replicas behind HAProxy: adapter affinity under bounded load against plain round-robin.

Starts `--replicas` replicas of the `shapes` model behind HAProxy (deploy/haproxy/front.py,
loopback only), sends `--requests` Generates from `--clients` concurrent clients over
`--adapters` adapters drawn Zipf(`--zipf`) through loraswap's own client (which names each
adapter in the `lora` metadata HAProxy hashes on), and prints one JSON object: adapter loads
summed over the replicas (from each replica's ListAdapters) against the ideal of one load per
distinct adapter, the busiest replica's share of requests over the mean (from HAProxy's
counters), and latency percentiles; then the same workload under plain `balance roundrobin` (no
hot-adapter rule either) for comparison. Bounded in count, and every call in time.

    python -m benchmarks.scaleout                                  # 3 replicas, 300 requests, 8 clients
    python -m benchmarks.scaleout --requests 60 --adapters 10      # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.queue_policy import percentile, zipf_sequence

PROMPT = "a red circle on a blue background"


def write_adapters(directory: Path, count: int) -> list[str]:
    """`count` adapter folders, copies of the shipped shapes adapters under distinct names."""
    from loraswap.server.engine.models import builtin_model

    shipped = sorted(p for p in builtin_model("shapes").adapter_dir.iterdir() if p.is_dir())
    names = []
    for index in range(count):
        name = f"a{index:03d}"
        shutil.copytree(shipped[index % len(shipped)], directory / name)
        names.append(name)
    return names


async def drive(address: str, sequence: list[str], clients: int, steps: int, timeout: float) -> list[float]:
    """Send the sequence from `clients` concurrent clients, each on its own channel and sending the `lora`
    metadata as every loraswap client does; returns each request's latency in ms."""
    from loraswap.client import AsyncLoraswapClient

    pending = list(enumerate(sequence))
    latencies: list[float] = []

    async def client_loop() -> None:
        async with AsyncLoraswapClient(address, default_timeout=timeout) as client:
            while pending:
                seed, adapter = pending.pop(0)
                started = time.perf_counter()
                await client.generate_image(PROMPT, adapter=adapter, seed=seed, num_inference_steps=steps)
                latencies.append((time.perf_counter() - started) * 1000.0)

    await asyncio.gather(*(client_loop() for _ in range(clients)))
    return latencies


def replica_figures(front) -> tuple[dict[str, int], list[int]]:
    """(adapter -> how many replicas hold it; requests each replica served) after a run."""
    import grpc

    from loraswap.v1 import diffusion_service_pb2 as pb
    from loraswap.v1 import diffusion_service_pb2_grpc as pb_grpc

    holders: dict[str, int] = {}
    for replica in front.started:
        with grpc.insecure_channel(replica.address) as channel:
            listing = pb_grpc.DiffusionServiceStub(channel).ListAdapters(pb.ListAdaptersRequest(), timeout=30)
        for adapter in listing.adapters:
            holders[adapter.id] = holders.get(adapter.id, 0) + 1
    served = [int(row["stot"]) for row in front.server_stats().values()]  # the calls each replica took
    return holders, served


def run_front(args, adapter_dir: Path, sequence: list[str], balance: str) -> dict:
    from deploy.haproxy.front import LocalFront

    flags = [
        "--model", "shapes", "--adapter-dir", str(adapter_dir), "--no-compile", "--torch-threads", "1",
        "--log-level", "WARNING", "--max-queue", str(len(sequence)),
    ]  # fmt: skip
    # Plain round-robin for comparison: without the hot-adapter rule too, which would steer the popular adapters.
    hot_adapters = balance != "roundrobin"
    front = LocalFront(
        replicas=args.replicas,
        serve_flags=flags,
        balance=balance,
        balance_factor=args.balance_factor,
        hot_adapters=hot_adapters,
    )
    with front:
        started = time.perf_counter()
        latencies = asyncio.run(drive(front.address, sequence, args.clients, args.steps, args.timeout))
        elapsed = time.perf_counter() - started
        holders, served = replica_figures(front)
    loads = sum(holders.values())
    distinct = len(set(sequence))
    requests = {name: sequence.count(name) for name in holders}
    mean = statistics.fmean(served)
    return {
        "balance": balance,
        "balance_factor": args.balance_factor,
        "hot_adapters": hot_adapters,
        "replicas": args.replicas,
        "requests": len(sequence),
        "distinct_adapters": distinct,
        "adapter_loads": loads,
        "loads_over_ideal": round(loads / distinct, 3),
        "requests_per_replica": served,
        # adapter -> [its requests, replicas holding it], for those held by more than one
        "held_by_several": {name: [requests[name], count] for name, count in sorted(holders.items()) if count > 1},
        "max_replica_share_over_mean": round(max(served) / mean, 3),
        "p50_ms": round(percentile(latencies, 0.5), 1),
        "p99_ms": round(percentile(latencies, 0.99), 1),
        "seconds": round(elapsed, 1),
    }


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The workload's shape, shared with benchmarks/scaleout_model.py: replicas, and requests from closed-loop
    clients over adapters drawn Zipf."""
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--adapters", type=int, default=30)
    parser.add_argument("--zipf", type=float, default=1.1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scaleout", description=__doc__.split("\n\n")[0])
    add_workload_arguments(parser)
    parser.add_argument("--steps", type=int, default=4, help="denoising steps per request")
    parser.add_argument("--timeout", type=float, default=600.0, help="deadline of each call, seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--balance-factor", type=int, default=None, help="hash-balance-factor (default: the config's)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="loraswap-scaleout-") as tmp:
        adapter_dir = Path(tmp)
        names = write_adapters(adapter_dir, args.adapters)
        sequence = [names[i] for i in zipf_sequence(args.requests, args.adapters, args.zipf, args.seed)]
        affinity = run_front(args, adapter_dir, sequence, "hdr(lora)")
        round_robin = run_front(args, adapter_dir, sequence, "roundrobin")
    print(json.dumps({**affinity, "round_robin": round_robin}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
