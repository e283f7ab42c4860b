"""Cold starts: start-to-SERVING of a first and a second `loraswap serve` sharing one `--compile-cache`.

    python -m benchmarks.startup                                  # tiny-sdxl, inductor, --compile full and regional
    python -m benchmarks.startup --kinds full --model tiny-flux --steps 4

For each `--compile` kind in `--kinds`, a fresh, empty cache folder, then two real
`loraswap serve` processes one after the other (port 0, `--device cpu`, `--torch-threads
--threads`, `--compile-backend inductor`, `--compile-cache` that folder): the first
compiles everything and fills the cache, the second starts from it. Each start is timed
from spawning the process to its "serving" line (the health check turns SERVING at the
same moment), in wall-clock seconds and in the CPU seconds the process and the compilers
it ran had used by then (`cpu_s_to_serving`, which a busy machine disturbs least), and
split into the phases the server logs (load, slot, compile, warm-up), with the FX graph
and AOTAutograd cache hits and misses it logs. After the first start,
`--requests` Generates of `--steps` steps give the per-step time of that kind (the
median interval between the server's Progress events) and its recompilations. `none`
in `--kinds` (the default includes it) starts once, uncompiled, as the baseline.
The last line printed is one JSON object; progress goes to stderr.

    python -m benchmarks.startup --model shapes --fuse-policies never,always,auto

`--fuse-policies` measures instead what `--fuse` does to a compiled start (`--compile full`, empty
cache, no second start): one start per policy at the defaults (`--max-rank` and `--rank-buckets`
left to the server: max rank 64, buckets 16, 32, 64), beside the start before fused adapters
existed, `--fuse never --max-rank 16` (the base model's graph and one bucket's). Goal:
`auto_over_never_max_rank_16` <= 1 (auto compiles the base graph and the smallest bucket's, and
the larger ones only where its rule can still choose them).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.processes import stop_process, wait_for_serving_line

PROMPT = "a red circle on a blue background"
AUTO_LINE = re.compile(r"--fuse auto: .*")
PHASE_LINE = re.compile(r"start-up (?P<phase>[\w-]+): (?P<seconds>[\d.]+) s")
CACHE_LINE = re.compile(
    r"compile cache .*: FX graphs (?P<fx_hit>\d+) hit, (?P<fx_miss>\d+) missed; "
    r"AOTAutograd (?P<aot_hit>\d+) hit, (?P<aot_miss>\d+) missed"
)


def cpu_seconds(pid: int) -> float | None:
    """CPU time of a process and its reaped children (the compilers inductor ran), from /proc; None elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return sum(int(value) for value in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class Start:
    """One `loraswap serve` process: spawned, timed until it serves, stopped with SIGTERM."""

    def __init__(self, args, kind: str, cache: Path | None, log_path: Path, serve_args: tuple[str, ...] = ()) -> None:
        command = [
            sys.executable, "-m", "loraswap.client.command", "serve", "--model", args.model,
            "--host", "127.0.0.1", "--port", "0", "--device", "cpu", "--torch-threads", str(args.threads),
            "--log-level", "INFO", "--compile", kind, *(serve_args or ("--max-rank", str(args.max_rank))),
        ]  # fmt: skip
        if kind != "none":
            command += ["--compile-backend", "inductor"]
        if cache is not None:
            command += ["--compile-cache", str(cache)]
        self.log_path = log_path
        self._log = log_path.open("w")
        env = dict(os.environ, HF_HUB_OFFLINE="1")
        self.spawned = time.perf_counter()
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env)
        self.port: int | None = None

    def wait_until_serving(self, timeout: float) -> float:
        """Seconds from spawning to the "serving" line."""
        serving = wait_for_serving_line(self.process, timeout)
        if serving is None:
            self.stop()
            raise RuntimeError(f"no SERVING within {timeout:.0f} s; the log ends:\n{self.log_path.read_text()[-3000:]}")
        self.cpu_s = cpu_seconds(self.process.pid)
        self.port, at = serving
        return at - self.spawned

    def phases(self) -> dict:
        """The start-up phases and cache lookups the server logged (and --fuse auto's measured rule)."""
        text = self.log_path.read_text()
        phases = {match["phase"]: float(match["seconds"]) for match in PHASE_LINE.finditer(text)}
        cache = CACHE_LINE.search(text)
        lookups = {name: int(value) for name, value in cache.groupdict().items()} if cache else None
        auto_rule = AUTO_LINE.search(text)
        return {"phases_s": phases, "cache_lookups": lookups, **({"auto_rule": auto_rule[0]} if auto_rule else {})}

    def stop(self) -> None:
        stop_process(self.process)
        self._log.close()


async def per_step(port: int, args) -> dict:
    """Median server-side step time over `--requests` Generates, and the server's compile facts."""
    from loraswap.client import AsyncLoraswapClient, Progress

    steps_ms: list[float] = []
    async with AsyncLoraswapClient(f"127.0.0.1:{port}", default_timeout=3600) as client:
        for request in range(args.requests):
            elapsed: list[float] = []
            async for event in client.generate(PROMPT, seed=request, num_inference_steps=args.steps):
                if isinstance(event, Progress):
                    elapsed.append(event.elapsed_ms)
            steps_ms += [b - a for a, b in itertools.pairwise(elapsed)]
        info = await client.server_info()
    return {
        "per_step_ms": round(statistics.median(steps_ms), 2),
        "recompilations": info.recompilations,
        "compile_mode": getattr(info, "compile_mode", ""),
        "fuse": info.fuse,
        "max_rank": info.max_rank,
        "rank_buckets": list(info.rank_buckets),
    }


def one_start(
    args, kind: str, cache: Path | None, log_path: Path, *, measure_steps: bool, serve_args: tuple[str, ...] = ()
) -> dict:
    start = Start(args, kind, cache, log_path, serve_args)
    try:
        seconds = start.wait_until_serving(args.timeout)
        cpu_s = round(start.cpu_s, 2) if start.cpu_s is not None else None
        result = {"start_to_serving_s": round(seconds, 2), "cpu_s_to_serving": cpu_s, **start.phases()}
        if measure_steps:
            result.update(asyncio.run(per_step(start.port, args)))
        return result
    finally:
        start.stop()


def measure_kind(args, kind: str, workdir: Path) -> dict:
    if kind == "none":
        log("none: one start (uncompiled baseline)")
        return {"first": one_start(args, kind, None, workdir / "none.log", measure_steps=True)}
    cache = workdir / f"cache-{kind}"
    log(f"{kind}: first start, empty cache {cache}")
    first = one_start(args, kind, cache, workdir / f"{kind}-1.log", measure_steps=True)
    log(f"{kind}: {first['start_to_serving_s']} s; second start from the cache")
    second = one_start(args, kind, cache, workdir / f"{kind}-2.log", measure_steps=False)
    log(f"{kind}: {second['start_to_serving_s']} s")
    return {
        "first": first,
        "second": second,
        "second_over_first": round(second["start_to_serving_s"] / first["start_to_serving_s"], 3),
        "cpu_second_over_first": (
            round(second["cpu_s_to_serving"] / first["cpu_s_to_serving"], 3) if first["cpu_s_to_serving"] else None
        ),
        "cache_bytes": sum(path.stat().st_size for path in cache.rglob("*") if path.is_file()),
    }


# The start before fused adapters: the base model's graph and one bucket's (a rank-16 slot).
FUSE_BASELINE = ("never_max_rank_16", ("--fuse", "never", "--max-rank", "16"))


def measure_fuse_policies(args, workdir: Path) -> dict:
    """One compiled start per --fuse policy at the defaults, and the never --max-rank 16 baseline."""
    starts = {}
    runs = [FUSE_BASELINE] + [(policy, ("--fuse", policy)) for policy in args.fuse_policies.split(",") if policy]
    for name, serve_args in runs:
        log(f"--fuse {name}: a compiled start, empty cache")
        cache = workdir / f"cache-fuse-{name}"
        starts[name] = one_start(args, "full", cache, workdir / f"fuse-{name}.log", measure_steps=True,
                                 serve_args=(*serve_args, "--compile-cache", str(cache)))  # fmt: skip
        log(f"--fuse {name}: {starts[name]['start_to_serving_s']} s")
    baseline = starts[FUSE_BASELINE[0]]
    return {
        "starts": starts,
        "over_never_max_rank_16": {
            name: {
                "wall": round(start["start_to_serving_s"] / baseline["start_to_serving_s"], 3),
                "cpu": (
                    round(start["cpu_s_to_serving"] / baseline["cpu_s_to_serving"], 3)
                    if start["cpu_s_to_serving"] and baseline["cpu_s_to_serving"] else None
                ),
            }
            for name, start in starts.items()
            if name != FUSE_BASELINE[0]
        },
        "goal": "auto_over_never_max_rank_16 <= 1",
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.startup",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default="tiny-sdxl")
    parser.add_argument("--kinds", default="none,full,regional", help="comma-separated --compile kinds")
    parser.add_argument("--threads", type=int, default=1, help="the servers' --torch-threads")
    parser.add_argument("--max-rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8, help="steps per timed request")
    parser.add_argument("--requests", type=int, default=3, help="timed requests after the first start")
    parser.add_argument("--timeout", type=float, default=3600, help="longest wait for one start, seconds")
    parser.add_argument("--json-out", help="also write the JSON, indented, to this file")
    parser.add_argument(
        "--fuse-policies", default="",
        help="comma-separated --fuse policies: one compiled start of each at the defaults, beside --fuse never "
        "--max-rank 16, instead of the --kinds comparison (e.g. never,always,auto)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.steps < 2 or args.requests < 1:
        parser.error("--steps must be at least 2 (a step's time is the gap between two) and --requests at least 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    import torch

    result = {
        "benchmark": "startup",
        "model": args.model,
        "backend": "inductor",
        "torch_threads": args.threads,
        "torch": torch.__version__,
        "cores_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "steps": args.steps,
    }
    with tempfile.TemporaryDirectory(prefix="loraswap-startup-") as folder:
        if args.fuse_policies:
            result["fuse_policies"] = measure_fuse_policies(args, Path(folder))
            ratios = result["fuse_policies"]["over_never_max_rank_16"]
            if "auto" in ratios:
                result["auto_over_never_max_rank_16"] = ratios["auto"]["wall"]
        else:
            result["kinds"] = {kind: measure_kind(args, kind, Path(folder)) for kind in args.kinds.split(",") if kind}
            result["second_over_first_goal"] = 0.35
    text = json.dumps(result)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
    print(text)
    return result


if __name__ == "__main__":
    main()
