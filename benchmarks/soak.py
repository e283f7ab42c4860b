"""Soak: many Generates over many adapters from concurrent clients, with cancels, short deadlines and cache churn.

    python -m benchmarks.soak                                   # shapes: 300 requests, 30 adapters, 8 clients
    python -m benchmarks.soak --requests 30 --adapters 6 --clients 4

A real `loraswap serve` process on a loopback port the OS picks, and in this
process (no torch once the adapters are written) `--clients` closed-loop
clients, one channel each, sharing `--requests` Generates drawn over
`--adapters` adapters and the base model. Of those, `--cancel-fraction` are
cancelled at a random point (half when a Queued event says they wait, half
after a random step of the denoise) and `--deadline-fraction` carry deadlines
too short to finish; beside them one client churns the cache with Evict and
PreloadAdapter, and the cache budget holds only about a third of the adapters,
so LRU evictions happen too.

It reports what became of every request (any failure that is neither the
cancel nor the deadline asked for is counted in `failed`), the server's
recompilations, whether the base model's image is bit-identical at the end,
and the server's resident memory (VmRSS) at the start and after each third of
the requests, with its growth over the last two thirds against the goal (under
2% or 50 MB, whichever is larger). Bounded in count (`--requests`) and time
(`--max-seconds`). The last line printed is one JSON object; progress goes to
stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import tempfile
import time
from collections import Counter
from pathlib import Path

from benchmarks.serve import ServerProcess
from benchmarks.swap import log, machine_info

DEFAULT_MODEL = "shapes"
PROMPTS = (
    "a red circle on a blue background",
    "a green triangle on a yellow background",
    "a blue square on a white background",
    "a yellow circle on a black background",
)
SERVER_START_TIMEOUT_S = 900.0
# Growth over the last two thirds of the run that counts as no leak: 2% of the memory then, or 50 MB.
GROWTH_GOAL_FRACTION = 0.02
GROWTH_GOAL_MB = 50.0
# How much of the adapter set the cache budget holds, so that the LRU evicts as well as Evict calls.
CACHED_FRACTION = 1 / 3


def adapter_names(count: int, shipped: list[str]) -> list[str]:
    """`count` names: variants of the shipped adapters when there are some, else random ones."""
    if shipped:
        return [f"{shipped[index % len(shipped)]}-{index // len(shipped):02d}" for index in range(count)]
    return [f"random-{index:03d}" for index in range(count)]


def write_adapters(model: str, adapter_dir: Path, count: int) -> tuple[list[str], int]:
    """Write the soak's adapters; returns their names and the most bytes one takes in the cache (float32).

    Variants of a model's shipped adapters (lora_B scaled by 0.55 to 1.0, so each is distinct bytes that
    still draw), or random PEFT adapters for models that ship none.
    """
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from loraswap.server.engine.models import BUILTINS

    builtin = BUILTINS.get(model)
    if builtin is None:
        raise SystemExit(f"unknown --model {model!r}; use one of {', '.join(BUILTINS)}")
    shipped_dir = builtin.adapter_dir
    shipped = sorted(path.name for path in shipped_dir.iterdir() if path.is_dir()) if shipped_dir else []
    names = adapter_names(count, shipped)
    pipe = None
    for index, name in enumerate(names):
        folder = adapter_dir / name
        folder.mkdir(parents=True)
        if shipped:
            source = shipped_dir / shipped[index % len(shipped)] / "pytorch_lora_weights.safetensors"
            with safe_open(str(source), framework="pt") as handle:
                metadata = handle.metadata()
                tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118 (not a dict)
            factor = 0.55 + 0.05 * (index // len(shipped) % 10)
            tensors = {k: (v * factor if "lora_B" in k else v).contiguous() for k, v in tensors.items()}
            save_file(tensors, folder / "pytorch_lora_weights.safetensors", metadata=metadata)
        else:
            from loraswap.server.devtools.random_adapter import write_random_adapter

            pipe = pipe or builtin.build(torch.float32)
            write_random_adapter(pipe, folder, rank=(4, 8)[index % 2], seed=index, init_std=0.1)
    largest = 0
    for name in names:
        with safe_open(str(adapter_dir / name / "pytorch_lora_weights.safetensors"), framework="pt") as handle:
            numel = sum(math.prod(handle.get_slice(key).get_shape()) for key in handle.keys())  # noqa: SIM118
        largest = max(largest, numel * 4)
    return names, largest


def resident_mb(pid: int) -> float:
    """The process's resident memory (VmRSS) in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    raise RuntimeError(f"no VmRSS for process {pid}")


# --------------------------------------------------------------------------- the client side (no torch)


class Tally:
    """What became of each request, and the server's memory after each third of them."""

    def __init__(self, total: int, pid: int) -> None:
        self.total = total
        self.pid = pid
        self.outcomes: Counter[str] = Counter()
        self.failures: Counter[str] = Counter()
        self.rss_mb: dict[str, float] = {"start": resident_mb(pid)}

    def record(self, outcome: str, failure: str | None = None) -> None:
        self.outcomes[outcome] += 1
        if failure is not None:
            self.failures[failure] += 1
        done = sum(self.outcomes.values())
        for third in (1, 2, 3):
            if done == self.total * third // 3:
                self.rss_mb[f"after_third_{third}"] = resident_mb(self.pid)


async def one_request(client, plan: dict, steps: int, tally: Tally) -> None:
    """Send one Generate as planned (to finish, cancel when queued or at a step, or run into a short deadline)."""
    from loraswap.client import GeneratedImage, LoraswapError, Progress, Queued

    kind = plan["kind"]
    options = dict(adapter=plan["adapter"], seed=plan["seed"], num_inference_steps=steps)
    if kind == "deadline":
        options["timeout"] = plan["timeout_s"]
    stream = client.generate(plan["prompt"], **options)
    try:
        async with contextlib.aclosing(stream) as events:
            async for event in events:
                if kind == "cancel_queued" and isinstance(event, Queued) and event.position >= 2:
                    tally.record("cancelled_queued")
                    return  # leaving the stream cancels the call
                cancelling = kind in ("cancel_queued", "cancel_running")
                if cancelling and isinstance(event, Progress) and event.step >= plan["cancel_at_step"]:
                    tally.record("cancelled_running")
                    return
                if isinstance(event, GeneratedImage):
                    tally.record("completed")
                    return
        tally.record("failed", "stream ended without an image")
    except LoraswapError as error:
        if kind == "deadline" and error.code.name == "DEADLINE_EXCEEDED":
            tally.record("deadlined")
        else:
            tally.record("failed", f"{kind}: {error.code.name} {error.reason}")


async def churn(client, names: list[str], rng: random.Random, stop: asyncio.Event, counts: Counter) -> None:
    """Evict and preload adapters at random while the generations run."""
    from loraswap.client import LoraswapError

    while not stop.is_set():
        try:
            await client.evict(rng.choice(names))
            counts["evicts"] += 1
        except LoraswapError as error:
            counts["evict_not_cached" if error.reason == "ADAPTER_NOT_FOUND" else "churn_failed"] += 1
        try:
            await client.preload_adapter(rng.choice(names))
            counts["preloads"] += 1
        except LoraswapError:
            counts["churn_failed"] += 1
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), rng.uniform(0.05, 0.5))


def plan_requests(args, names: list[str]) -> list[dict]:
    """Every request's adapter, prompt, seed and fate, drawn from --seed."""
    rng = random.Random(args.seed)
    plans = []
    for index in range(args.requests):
        draw = rng.random()
        if draw < args.cancel_fraction:
            kind = "cancel_queued" if rng.random() < 0.5 else "cancel_running"
        elif draw < args.cancel_fraction + args.deadline_fraction:
            kind = "deadline"
        else:
            kind = "complete"
        plans.append({
            "adapter": rng.choice([*names, ""]),  # the base model as often as any one adapter
            "prompt": rng.choice(PROMPTS),
            "seed": index,
            "kind": kind,
            "cancel_at_step": rng.randint(1, max(1, args.steps - 1)),
            "timeout_s": rng.uniform(0.01, 0.1),
        })  # fmt: skip
    return plans


async def soak(args, port: int, pid: int, names: list[str]) -> dict:
    from loraswap.client import AsyncLoraswapClient

    target = f"127.0.0.1:{port}"
    plans = plan_requests(args, names)
    queue: asyncio.Queue[dict] = asyncio.Queue()
    for plan in plans:
        queue.put_nowait(plan)
    churn_counts: Counter[str] = Counter()
    async with AsyncLoraswapClient(target, default_timeout=600) as control:
        base_before = (await control.generate_image(PROMPTS[0], seed=0, num_inference_steps=args.steps)).data
        tally = Tally(len(plans), pid)

        async def client_loop() -> None:
            async with AsyncLoraswapClient(target, default_timeout=600) as client:
                while not queue.empty():
                    await one_request(client, queue.get_nowait(), args.steps, tally)

        stop = asyncio.Event()
        churner = asyncio.ensure_future(churn(control, names, random.Random(args.seed + 1), stop, churn_counts))
        started = time.perf_counter()
        timed_out = False
        try:
            await asyncio.wait_for(asyncio.gather(*(client_loop() for _ in range(args.clients))), args.max_seconds)
        except asyncio.TimeoutError:  # noqa: UP041 (the builtin is the same class only from Python 3.11)
            timed_out = True
        wall_s = time.perf_counter() - started
        stop.set()
        await churner
        base_after = (await control.generate_image(PROMPTS[0], seed=0, num_inference_steps=args.steps)).data
        info = await control.server_info()
    rss = tally.rss_mb
    growth_mb = rss["after_third_3"] - rss["after_third_1"] if "after_third_3" in rss else None
    limit_mb = max(GROWTH_GOAL_FRACTION * rss.get("after_third_1", rss["start"]), GROWTH_GOAL_MB)
    outcomes = tally.outcomes
    return {
        "requests": len(plans),
        "completed": outcomes["completed"],
        "cancelled": outcomes["cancelled_queued"] + outcomes["cancelled_running"],
        "cancelled_queued": outcomes["cancelled_queued"],
        "cancelled_running": outcomes["cancelled_running"],
        "deadlined": outcomes["deadlined"],
        "failed": outcomes["failed"],
        "failures": dict(tally.failures),
        "planned": dict(Counter(plan["kind"] for plan in plans)),
        "churn": {key: churn_counts[key] for key in ("evicts", "evict_not_cached", "preloads", "churn_failed")},
        "recompilations": info.recompilations,
        "base_image_unchanged": base_before == base_after,
        "rss_mb": rss,
        "rss_growth_last_two_thirds_mb": growth_mb,
        "rss_growth_goal_mb": limit_mb,
        "rss_growth_within_goal": growth_mb is not None and growth_mb < limit_mb,
        "wall_s": wall_s,
        "timed_out": timed_out,
    }


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="a built-in model: shapes, tiny-flux or tiny-sdxl")
    parser.add_argument("--requests", type=int, default=300, help="Generates in the run")
    parser.add_argument("--adapters", type=int, default=30, help="adapters the requests are drawn over")
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients, one channel each")
    parser.add_argument("--steps", type=int, default=10, help="denoising steps per request")
    parser.add_argument("--cancel-fraction", type=float, default=0.2, help="requests cancelled at a random point")
    parser.add_argument("--deadline-fraction", type=float, default=0.05, help="requests with too short a deadline")
    parser.add_argument("--max-seconds", type=float, default=1800.0, help="stop sending after this long")
    parser.add_argument("--compile-backend", default="aot_eager", help="the server's torch.compile backend; 'none'")
    parser.add_argument("--threads", type=int, default=1, help="the server's torch threads (the clients run none)")
    parser.add_argument("--seed", type=int, default=0, help="seeds every random choice of the run")
    parser.add_argument("--json-out", type=Path, default=None, help="also write the JSON result here")
    args = parser.parse_args(argv)
    if args.requests < 3 or args.adapters < 1 or args.clients < 1 or args.steps < 2:
        parser.error("need --requests >= 3, --adapters >= 1, --clients >= 1 and --steps >= 2")
    if not 0 <= args.cancel_fraction + args.deadline_fraction <= 1:
        parser.error("--cancel-fraction and --deadline-fraction must add up to at most 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    """Run the soak, print the JSON result as the last line of stdout, and return it."""
    args = parse_args(argv)
    import torch

    # One thread here and `--threads` in the server: on a small machine the two must not oversubscribe the cores.
    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="loraswap-soak-") as temp:
        workdir = Path(temp)
        adapter_dir = workdir / "adapters"
        names, largest = write_adapters(args.model, adapter_dir, args.adapters)
        budget = max(1, round(args.adapters * CACHED_FRACTION)) * largest
        log(f"{len(names)} adapters written; cache budget {budget} bytes")
        server_args = argparse.Namespace(
            threads=args.threads, dtype="float32", max_rank=64, compile_backend=args.compile_backend
        )
        server = ServerProcess(
            server_args, args.model, adapter_dir, workdir / "server.log",
            extra_flags=("--adapter-cache-bytes", str(budget), "--max-queue", str(max(64, args.clients * 2))),
        )  # fmt: skip
        try:
            ready_s = server.wait_until_serving(SERVER_START_TIMEOUT_S)
            log(f"server ready in {ready_s:.1f} s on port {server.port}")
            figures = asyncio.run(soak(args, server.port, server.process.pid, names))
        finally:
            server.stop()
    report = {
        "benchmark": "soak",
        "model": args.model,
        "adapters": args.adapters,
        "clients": args.clients,
        "steps": args.steps,
        "server_torch_threads": args.threads,
        "compile_backend": args.compile_backend,
        "cache_budget_bytes": budget,
        "server_ready_s": ready_s,
        **figures,
        "machine": machine_info(),
    }
    line = json.dumps(report)
    if args.json_out is not None:
        args.json_out.write_text(line + "\n")
    print(line, flush=True)
    return report


if __name__ == "__main__":
    main()
