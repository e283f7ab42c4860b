"""CPU serving that shares its cores: ms per step alone and beside a process that keeps one core busy.

    python -m benchmarks.cpu_sharing                       # shapes, uncompiled, old and new thread policy, ~2 min
    python -m benchmarks.cpu_sharing --rounds 7 --steps 30

One worker process per thread policy loads the `shapes` runtime (no compile, no warm-up)
and waits; the parent then runs short bursts in turn, interleaved so that whatever else
the machine does hits every variant alike: for each round, each policy runs one
generation of `--steps` steps alone and one while a busy-loop process (`while True: pass`,
started just before and killed just after) keeps one core busy. A burst's figure is the
median of its step intervals; the JSON reports, per policy and condition, the median over
the rounds, the thread count the policy ended on, and `busy_over_alone`.

Policies: `old`, torch threads fixed at the usable cores (what the server did before,
OpenMP's default waiting); `new`, the server's default now (`--torch-threads` unset:
`CoreShare` follows the cores other processes leave free, engine/pipeline/cpu_threads.py); `one`,
a fixed single thread, for reference. The last line printed is one JSON object;
progress goes to stderr.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

POLICIES = ("old", "new", "one")
BUSY_LOOP = "while True:\n    pass\n"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- the worker (torch)


def worker(policy: str, steps: int) -> None:
    """Load shapes under `policy`, then run one generation per `run` line on stdin, printing its step intervals."""
    import torch

    from loraswap.server.engine.config import EngineConfig
    from loraswap.server.engine.pipeline.cpu_threads import usable_cores
    from loraswap.server.engine.pipeline.startup import start_runtime
    from loraswap.server.engine.types import GenerationRequest

    threads = {"old": usable_cores(), "new": 0, "one": 1}[policy]  # new: --torch-threads 0, following the load
    runtime = start_runtime(
        EngineConfig(model="shapes", device="cpu", compile="none", warmup=False, torch_threads=threads)
    )
    params = runtime.request_rules.resolve(
        GenerationRequest(prompt="a red circle on a blue background", seed=0, num_inference_steps=steps)
    )
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        marks: list[float] = []
        runtime.generate(params, (), on_step=lambda progress, marks=marks: marks.append(time.perf_counter()),
                         is_cancelled=bool)  # fmt: skip
        intervals = [(b - a) * 1000.0 for a, b in itertools.pairwise(marks)]
        result = {"step_ms": statistics.median(intervals), "threads": torch.get_num_threads()}
        print(json.dumps(result), flush=True)


# --------------------------------------------------------------------------- the parent (no torch)


class Worker:
    def __init__(self, policy: str, steps: int) -> None:
        command = [sys.executable, "-m", "benchmarks.cpu_sharing", "--worker", policy, "--steps", str(steps)]
        env = dict(os.environ, HF_HUB_OFFLINE="1")
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        if self.process.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the {policy} worker did not start")

    def run(self) -> dict:
        self.process.stdin.write("run\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())

    def stop(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


def busy_core() -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", BUSY_LOOP])
    time.sleep(0.3)  # let it get going and the scheduler settle
    return process


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.cpu_sharing",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="denoising steps per burst")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--worker", choices=POLICIES, help=argparse.SUPPRESS)
    parser.add_argument("--json-out")
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.steps)
        return {}

    policies = [policy for policy in args.policies.split(",") if policy]
    workers = {policy: Worker(policy, args.steps) for policy in policies}
    bursts: dict[tuple[str, str], list[dict]] = {(p, c): [] for p in policies for c in ("alone", "busy")}
    loads = []
    try:
        for round_index in range(args.rounds):
            for policy in policies:
                for condition in ("alone", "busy") if round_index % 2 == 0 else ("busy", "alone"):
                    busy = busy_core() if condition == "busy" else None
                    try:
                        bursts[(policy, condition)].append(workers[policy].run())
                    finally:
                        if busy is not None:
                            busy.kill()
                            busy.wait()
                    loads.append(os.getloadavg()[0])
            log(f"round {round_index + 1}/{args.rounds} done")
    finally:
        for process in workers.values():
            process.stop()

    result = {
        "benchmark": "cpu_sharing",
        "model": "shapes",
        "compiled": False,
        "steps": args.steps,
        "rounds": args.rounds,
        "cores_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "load_average_1min": {"min": min(loads), "median": statistics.median(loads), "max": max(loads)},
        "policies": {},
        "busy_over_alone_goal": 2.0,
    }
    for policy in policies:
        figures = {}
        for condition in ("alone", "busy"):
            runs = bursts[(policy, condition)]
            figures[f"{condition}_ms_per_step"] = round(statistics.median(run["step_ms"] for run in runs), 2)
            figures[f"{condition}_threads"] = runs[-1]["threads"]
        figures["busy_over_alone"] = round(figures["busy_ms_per_step"] / figures["alone_ms_per_step"], 2)
        result["policies"][policy] = figures
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
