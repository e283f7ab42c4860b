"""The GPU check: FLUX.1-dev's full-depth transformer (random weights), every variant served through the same path.

    benchmarks/gpu_check.sh --wheels .whl --out result.json    # on an H100/H200: one JSON object, within 540 s
    python -m benchmarks.gpu_check --variants bare,fused --requests 3
    python -m benchmarks.gpu_check --device cpu --model tiny-flux --size 64 --steps 2 --requests 2 --rank 4 \\
        --compile none --max-sequence-length 64 --variants bare,fused,unfused,fp8_bare,fp8_fused   # smoke, ~1.5 min

Variants, in the order given (default: bare, fused, fp8_bare, fp8_fused; unfused is optional): bare (no adapter
slot), fused (--fuse always), unfused (--fuse never), fp8_bare and fp8_fused (--quantize fp8), each through the
server's own start-up phases and PipelineRunner, a new rank-64 adapter before every request: gpu_serving.py says
what each is, gpu_variant.py how each figure is measured. Each runs in a child process of its own (fresh device memory, fresh
torch.compile state); off CUDA the fp8 variants are reported skipped ("fp8 needs CUDA").

The JSON: what the run ran with (`max_sequence_length`, `size`, `steps`, `layers`, `environment`, whose `gpu` is
null off CUDA), one entry per variant (`seconds_per_image`, `phases_ms`, `swap_ms`, `swap_floor_ms`,
`recompilations`, `host_syncs_per_step`, `profile`, `startup_s`, `startup_phases_s`, `first_request_s`, ...), the
ratios that are only fair side by side in one run (`fused_over_bare`, `fused_over_bare_plus_swap`,
`fused_denoise_over_bare_denoise`, `swap_over_floor`, `fp8_fused_seconds_per_image`, ...) and issue 40's `goals`.
It is also written to `--out` after each variant, so a run cut short keeps what it measured.

Time: the check ends within `--time-limit` seconds (540: one 10-minute device command, with room for installing
the wheels). Each variant runs within its cap (`--caps`) and never into the time reserved for the default variants
after it, so that one slow variant (fp8 sat in its start-up for more than 220 s in two past runs) cannot starve the
others. A variant stopped at its limit keeps what it measured so far and says where it stopped: the phase it was
in (`stopped_in_phase`: one of the engine's start-up phases, read from its "start-up <phase>" log lines, or one of
the check's own: adapters, first_request, timed_requests, swap_floor, host_syncs, profile) and `seconds_in_phase`;
`startup_phases_s`, `startup_s` and `first_request_s` say what each variant's time went to, for planning the next
run.

Issue 40 item 6 (CUDA graphs): `benchmarks/gpu_check.sh --compile-mode reduce-overhead --variants bare,fused,unfused`
measures the slot and the fused merges under CUDA graphs (weights are written in place, so the graphs' addresses
hold); compare with a default-mode run and check `recompilations` stays 0.

The text encoders and the VAE of random-flux are tiny stand-ins (engine/models/random_full.py): `encode_prompt` and
`decode` are small here; FLUX.1-dev's T5-XXL and VAE add roughly 0.1-0.2 s per image on an H100.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from importlib import metadata
from pathlib import Path

from benchmarks.gpu_serving import VARIANTS, Variant
from benchmarks.gpu_variant import CHECK_PHASES, PHASE_MARK, STARTUP_PHASES

ROOT = Path(__file__).resolve().parent.parent
# FLUX.1-dev's prompt length in T5 tokens (diffusers' FluxPipeline default).
FLUX_MAX_SEQUENCE_LENGTH = 512
DEFAULT_TIME_LIMIT_S = 540.0
DEFAULT_VARIANTS = ("bare", "fused", "fp8_bare", "fp8_fused")
# A child starts in the engine's first phase, before it has logged anything.
FIRST_PHASE = STARTUP_PHASES[0]
# Below this many seconds a variant is not started.
LEAST_S = 20.0


@dataclasses.dataclass(frozen=True)
class Budget:
    """A variant's share of the time: `cap_s` the most it may run; `reserve_s` what the variants run before it
    leave for it (0: optional, it takes what is left)."""

    cap_s: float
    reserve_s: float


# The time plan of a default run on an H200 (BENCHMARKS.md, "GPU check"): bare about 75 s and fused about 100 s
# (start-up, compile, 5 + 1 requests, the profile), fp8 unknown (it never got past start-up in 220 s), so each fp8
# variant is capped and the one after it keeps its reserve.
BUDGETS = {
    "bare": Budget(cap_s=120.0, reserve_s=80.0),
    "fused": Budget(cap_s=150.0, reserve_s=100.0),
    "unfused": Budget(cap_s=150.0, reserve_s=0.0),
    "fp8_bare": Budget(cap_s=170.0, reserve_s=110.0),
    "fp8_fused": Budget(cap_s=240.0, reserve_s=130.0),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from loraswap.server.engine.compile_options import COMPILE_KINDS, COMPILE_MODES
    from loraswap.server.engine.types import ImageFormat

    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--variants",
        default=",".join(DEFAULT_VARIANTS),
        help=f"comma-separated, run in this order: {', '.join(VARIANTS)} (default: {','.join(DEFAULT_VARIANTS)})",
    )
    parser.add_argument("--model", default="random-flux", help="built-in model (random-flux, tiny-flux, ...)")
    parser.add_argument("--layers", type=int, help="random models with depth: blocks kept (default: full depth)")
    parser.add_argument("--size", type=int, default=1024, help="width and height in pixels")
    parser.add_argument("--steps", type=int, default=28, help="denoising steps per image")
    parser.add_argument(
        "--max-sequence-length",
        type=int,
        default=FLUX_MAX_SEQUENCE_LENGTH,
        help="Flux: T5 tokens each prompt is encoded to, in every variant (FLUX.1-dev's is 512)",
    )
    parser.add_argument("--requests", type=int, default=5, help="timed requests per variant")
    parser.add_argument(
        "--profile-steps",
        type=int,
        default=8,
        help="steps of the one profiled request per variant (the same graphs as --steps; fewer keep the profile "
        "quick to record and read)",
    )
    parser.add_argument("--rank", type=int, default=64, help="rank of the slot and of the adapters")
    parser.add_argument("--compile", default="regional", choices=COMPILE_KINDS)
    parser.add_argument("--compile-mode", default="default", choices=COMPILE_MODES, help="torch.compile mode")
    parser.add_argument(
        "--image-format",
        default=ImageFormat.PNG.value,
        choices=[image_format.value for image_format in ImageFormat],
        help="what every request asks its image in (the server's default: png)",
    )
    parser.add_argument("--device", default="cuda", help="torch device (cpu only for a smoke run)")
    parser.add_argument(
        "--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
        help="the model's dtype (bfloat16, as served on GPUs; float32 makes a CPU smoke run of a random model fast)",
    )  # fmt: skip
    parser.add_argument(
        "--warm-up",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="slot variants: run the server's warm-up (every size class) before the first request; off by default: the check "
        "serves one size, whose graphs the untimed first request compiles",
    )
    parser.add_argument(
        "--time-limit", type=float, default=DEFAULT_TIME_LIMIT_S, help="seconds for the whole check (default 540)"
    )
    parser.add_argument(
        "--caps",
        default="",
        help="NAME=SECONDS,... : a variant's own cap (defaults: "
        + ", ".join(f"{name} {budget.cap_s:.0f}" for name, budget in BUDGETS.items())
        + ")",
    )
    parser.add_argument("--out", type=Path, help="also write the JSON here, updated after each variant")
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # a child process: run this one variant
    parser.add_argument("--seconds", type=float, help=argparse.SUPPRESS)  # the child's own limit
    args = parser.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        parser.error(f"--variants takes some of {', '.join(VARIANTS)}; got {args.variants!r}")
    if args.size <= 0 or args.size % 16:
        parser.error(f"--size must be a positive multiple of 16; got {args.size}")
    if args.steps < 1 or args.requests < 1 or args.rank < 1 or args.profile_steps < 1:
        parser.error("--steps, --requests, --profile-steps and --rank must be at least 1")
    if not 1 <= args.max_sequence_length <= FLUX_MAX_SEQUENCE_LENGTH:
        parser.error(f"--max-sequence-length must be 1 to {FLUX_MAX_SEQUENCE_LENGTH}; got {args.max_sequence_length}")
    if args.time_limit <= 0:
        parser.error("--time-limit must be positive")
    try:
        args.cap_s = _caps(args.caps)
    except ValueError as error:
        parser.error(str(error))
    args.variant_list = variants
    return args


def _caps(text: str) -> dict[str, float]:
    caps = {name: budget.cap_s for name, budget in BUDGETS.items()}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, seconds = item.partition("=")
        try:
            value = float(seconds)
        except ValueError:
            value = -1.0
        if name not in VARIANTS or value <= 0:
            raise ValueError(f"--caps takes NAME=SECONDS with NAME one of {', '.join(VARIANTS)}; got {item!r}")
        caps[name] = value
    return caps


# -- the parent: every variant in turn, within the time limit -------------------------------------------------------


@dataclasses.dataclass
class ChildRun:
    """What the parent saw of one child: its last result line, its phase marks (with when they came), its stderr's
    tail, how it ended."""

    result: dict = dataclasses.field(default_factory=dict)
    marks: list = dataclasses.field(default_factory=list)  # (mark dict, monotonic time it came)
    tail: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=40))
    returncode: int | None = None
    stopped: bool = False
    wall_s: float = 0.0


def run_child(command: list[str], seconds: float, label: str) -> ChildRun:
    """Run one child within `seconds`, reading its stdout (result lines) and stderr (phase marks, forwarded with a
    prefix) as they come; at the limit its whole process group is killed (inductor's compile workers too)."""
    outcome = ChildRun()
    started = time.monotonic()
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace",
        start_new_session=True, env=os.environ.copy(),
    )  # fmt: skip

    def read_stdout() -> None:
        for line in process.stdout:
            with contextlib.suppress(json.JSONDecodeError):
                value = json.loads(line)
                if isinstance(value, dict):
                    outcome.result = value

    def read_stderr() -> None:
        for line in process.stderr:
            if line.startswith(PHASE_MARK):
                with contextlib.suppress(json.JSONDecodeError):
                    outcome.marks.append((json.loads(line[len(PHASE_MARK) :]), time.monotonic()))
                continue
            outcome.tail.append(line)
            sys.stderr.write(f"  [{label}] {line}")
            sys.stderr.flush()

    readers = [threading.Thread(target=read, daemon=True) for read in (read_stdout, read_stderr)]
    for reader in readers:
        reader.start()
    try:
        process.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        outcome.stopped = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    for reader in readers:
        reader.join(timeout=10)
    outcome.returncode = process.returncode
    outcome.wall_s = time.monotonic() - started
    return outcome


def phase_after(done: str, variant: Variant, args: argparse.Namespace) -> str:
    """The phase a child is in after `done` ended, when no line said which began (the engine logs a phase when it
    ends; unquantized there is no quantize line, uncompiled no compile line, without --warm-up no warm-up line)."""
    order = ["load"]
    if variant.slot:
        order.append("slot")
    if variant.quantize != "none":
        order.append("quantize")
    if args.compile != "none":
        order.append("compile")
    if args.warm_up and variant.slot:
        order.append("warm-up")
    order += [phase for phase in CHECK_PHASES if variant.slot or phase != "adapters"]
    if done in order and order.index(done) + 1 < len(order):
        return order[order.index(done) + 1]
    for phase in order:  # a start-up phase that order skips (compiled, yet no line): the next the check knows
        if phase in CHECK_PHASES:
            return phase
    return done


def where_stopped(run: ChildRun, variant: Variant, args: argparse.Namespace, now: float) -> dict:
    """The last phase the child's marks put it in, and for how long it had been there: a phase's lines as it begins
    and at its steps (a warm-up pass) carry how long it had run by then; after a phase ended, the next one began."""
    if not run.marks:
        return {"stopped_in_phase": FIRST_PHASE, "seconds_in_phase": round(run.wall_s, 1)}
    mark, at = run.marks[-1]
    if mark.get("event") == "done":
        return {"stopped_in_phase": phase_after(mark["phase"], variant, args), "seconds_in_phase": round(now - at, 1)}
    return {"stopped_in_phase": mark["phase"], "seconds_in_phase": round(now - at + (mark.get("seconds") or 0.0), 1)}


def startup_phases(run: ChildRun) -> dict[str, float]:
    """Seconds of each start-up phase the child logged as done."""
    return {
        mark["phase"]: mark["seconds"]
        for mark, _ in run.marks
        if mark.get("event") == "done" and mark["phase"] in STARTUP_PHASES and mark.get("seconds") is not None
    }


def variant_report(run: ChildRun, variant: Variant, args: argparse.Namespace, limit_s: float) -> dict:
    """One variant's entry in the JSON: its child's last result, and how it ended if not complete."""
    report = {key: value for key, value in run.result.items() if key not in ("variant", "complete")}
    report["startup_phases_s"] = startup_phases(run)
    report["limit_s"] = round(limit_s, 1)
    report["wall_s"] = round(run.wall_s, 1)
    complete = bool(run.result.get("complete"))
    if complete and (run.stopped or run.returncode != 0):
        report["exit"] = "killed at its limit after its last figure" if run.stopped else f"exit status {run.returncode}"
    elif run.stopped:
        report["stopped"] = f"still running after {limit_s:.0f} s, its limit"
        report.update(where_stopped(run, variant, args, time.monotonic()))
    elif run.returncode != 0 or not complete:
        report["failed"] = run.returncode
        report.setdefault("error", "no result: see stderr_tail")
        report.update(where_stopped(run, variant, args, time.monotonic()))
    if "stopped" in report or "failed" in report:
        report["stderr_tail"] = "".join(run.tail)[-2500:]
    return report


def _environment(device: str) -> dict:
    """Versions, read without importing torch (the parent holds no CUDA context); the GPU from the children."""
    facts: dict = {"device": device, "gpu": None, "python": sys.version.split()[0], "cpus": os.cpu_count()}
    for package in ("torch", "diffusers", "torchao", "transformers", "peft"):
        try:
            facts[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            facts[package] = None
    return facts


def skip_reason(name: str, args: argparse.Namespace) -> str | None:
    """Why a variant cannot run on this device at all (None: it can)."""
    if VARIANTS[name].quantize == "fp8" and not args.device.startswith("cuda"):
        return "fp8 needs CUDA"
    return None


def limit_for(name: str, remaining: list[str], left: float, args: argparse.Namespace) -> float:
    """A variant's time: its cap, and never the time kept for the variants still to come after it (those that can
    run here)."""
    kept = sum(BUDGETS[later].reserve_s for later in remaining if skip_reason(later, args) is None)
    return min(args.cap_s[name], left - kept)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.variant:
        from benchmarks.gpu_variant import child_main

        return child_main(args)
    deadline = time.monotonic() + args.time_limit
    report: dict = {
        "check": "gpu_check",
        "model": args.model,
        "layers": args.layers or "full depth",
        "dtype": args.dtype,
        "size": args.size,
        "steps": args.steps,
        "max_sequence_length": args.max_sequence_length,
        "requests": args.requests,
        "rank": args.rank,
        "compile": args.compile,
        "compile_mode": args.compile_mode,
        "image_format": args.image_format,
        "warm_up": args.warm_up,
        "time_limit_s": args.time_limit,
        "environment": _environment(args.device),
        "variants": {},
    }
    passed = list(argv if argv is not None else sys.argv[1:])
    child_args = _without_option(passed, "--out")
    for position, name in enumerate(args.variant_list):
        variant = VARIANTS[name]
        reason = skip_reason(name, args)
        if reason is not None:
            report["variants"][name] = {"skipped": reason}
            continue
        left = deadline - time.monotonic()
        limit = limit_for(name, args.variant_list[position + 1 :], left, args)
        if limit < LEAST_S:
            report["variants"][name] = {"skipped": f"no time left ({left:.0f} s, the later variants' share kept)"}
            continue
        # The same spelling as the parent's, in its working directory and environment: benchmarks resolves alike.
        command = [
            sys.executable,
            "-m",
            "benchmarks.gpu_check",
            *child_args,
            "--variant",
            name,
            "--seconds",
            f"{limit:.0f}",
        ]
        print(f"gpu_check: {name} within {limit:.0f} s ({left:.0f} s left)", file=sys.stderr, flush=True)
        run = run_child(command, limit, name)
        report["variants"][name] = variant_report(run, variant, args, limit)
        gpu = report["variants"][name].get("gpu")
        if gpu and report["environment"]["gpu"] is None:
            report["environment"]["gpu"] = gpu
            report["environment"]["compute_capability"] = report["variants"][name].get("compute_capability")
        summarise_report(report)
        if args.out:
            args.out.write_text(json.dumps(report, indent=2) + "\n")
    report["total_s"] = round(args.time_limit - (deadline - time.monotonic()), 1)
    summarise_report(report)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


def _without_option(argv: list[str], option: str) -> list[str]:
    """argv without `option` and its value (either spelling)."""
    kept, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item == option:
            skip = True
        elif not item.startswith(f"{option}="):
            kept.append(item)
    return kept


# Issue 40's goals on an H200, checked against every run's figures (None: not measured in this run).
GOALS = {
    "fused_denoise_within_1pct_of_bare": ("fused_denoise_over_bare_denoise", 1.01),
    "fused_within_1pct_of_bare_plus_swap": ("fused_over_bare_plus_swap", 1.01),
    "fp8_fused_at_most_2_7_s": ("fp8_fused_seconds_per_image", 2.7),
}


def summarise_report(report: dict) -> None:
    """The ratios between variants of this run, and the issue's goals as far as this run measured them."""
    variants = report["variants"]

    def figure(name: str, key: str):
        return variants.get(name, {}).get(key)

    def phase(name: str, key: str):
        return (figure(name, "phases_ms") or {}).get(key)

    def ratio(top, bottom, digits: int = 4):
        return round(top / bottom, digits) if top is not None and bottom else None

    def plus_swap(name: str, base: str):
        seconds, swap_ms = figure(base, "seconds_per_image"), figure(name, "swap_ms")
        return seconds + swap_ms / 1000.0 if seconds is not None and swap_ms is not None else None

    ratios = {
        "fused_over_bare": ratio(figure("fused", "seconds_per_image"), figure("bare", "seconds_per_image")),
        "fused_over_bare_plus_swap": ratio(figure("fused", "seconds_per_image"), plus_swap("fused", "bare")),
        "fused_denoise_over_bare_denoise": ratio(phase("fused", "denoise"), phase("bare", "denoise")),
        "unfused_over_bare": ratio(figure("unfused", "seconds_per_image"), figure("bare", "seconds_per_image")),
        "unfused_denoise_over_bare_denoise": ratio(phase("unfused", "denoise"), phase("bare", "denoise")),
        "fp8_bare_over_bare": ratio(figure("fp8_bare", "seconds_per_image"), figure("bare", "seconds_per_image")),
        "fp8_fused_over_fp8_bare": ratio(
            figure("fp8_fused", "seconds_per_image"), figure("fp8_bare", "seconds_per_image")
        ),
        "fp8_fused_over_fp8_bare_plus_swap": ratio(
            figure("fp8_fused", "seconds_per_image"), plus_swap("fp8_fused", "fp8_bare")
        ),
        "fp8_fused_denoise_over_fp8_bare_denoise": ratio(phase("fp8_fused", "denoise"), phase("fp8_bare", "denoise")),
        "fp8_fused_seconds_per_image": figure("fp8_fused", "seconds_per_image"),
    }
    report.update({key: value for key, value in ratios.items() if value is not None})
    report["swap_over_floor"] = {
        name: ratio(entry.get("swap_ms"), entry.get("swap_floor_ms"), 2)
        for name, entry in variants.items()
        if entry.get("swap_ms") is not None and entry.get("swap_floor_ms")
    }
    measured = [entry for entry in variants.values() if "seconds_per_image" in entry]
    goals = {name: _at_most(report.get(key), bound) for name, (key, bound) in GOALS.items()}
    goals["swap_at_most_2x_floor"] = _all_at_most(report["swap_over_floor"].values(), 2.0)
    goals["no_host_syncs_in_steps"] = _all_at_most((entry.get("host_syncs_per_step") for entry in measured), 0)
    goals["no_recompilations"] = _all_at_most((entry.get("recompilations") for entry in measured), 0)
    report["goals"] = goals


def _at_most(value, bound) -> bool | None:
    return None if value is None else value <= bound


def _all_at_most(values, bound) -> bool | None:
    values = [value for value in values if value is not None]
    return all(value <= bound for value in values) if values else None


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "server" / "src"))
    sys.path.insert(0, str(ROOT / "client" / "src"))
    sys.exit(main())
