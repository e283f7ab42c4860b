"""benchmarks/gpu_check.sh on the CPU: its arguments, its time plan, how it tells where a stopped variant was, and
one smoke run of every variant into one JSON object with every key the outside check reads.

The figures it exists for need an H100/H200 (BENCHMARKS.md, "GPU check"); here it must parse, refuse bad arguments
with one line and exit 2, install nothing when told no wheels, serve bare, fused and unfused through the same path
end to end, and report the fp8 variants as skipped.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
from benchmarks.gpu_profile import KINDS

from benchmarks import gpu_check, gpu_variant

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
VARIANT_NAMES = ("bare", "fused", "unfused", "fp8_bare", "fp8_fused")
# What the outside check reads of every measured variant, and of the run.
VARIANT_KEYS = ("seconds_per_image", "phases_ms", "swap_ms", "swap_floor_ms", "recompilations", "host_syncs_per_step")
PHASES = {"swap", "encode_prompt", "denoise", "decode", "encode_image"}
TOP_KEYS = ("max_sequence_length", "size", "steps", "layers", "environment")


def _run_script(argv: list[str], env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    """gpu_check.sh with exactly `argv` and `env`, its output captured as text."""
    return subprocess.run(
        ["bash", str(SCRIPT), *argv], check=False, capture_output=True, text=True, timeout=timeout, env=env
    )


def _run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    return _run_script(["--wheels", "", *args], env, timeout)


def test_the_variants_are_named_as_the_outside_check_reads_them() -> None:
    assert tuple(gpu_check.VARIANTS) == VARIANT_NAMES
    assert gpu_check.DEFAULT_VARIANTS == ("bare", "fused", "fp8_bare", "fp8_fused")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--variants", "fp16"], "--variants takes some of bare, fused, unfused, fp8_bare, fp8_fused"),
        (["--variants", "none,fp8"], "--variants takes some of bare, fused, unfused, fp8_bare, fp8_fused"),
        (["--variants", ""], "--variants takes some of bare, fused, unfused, fp8_bare, fp8_fused"),
        (["--max-sequence-length", "0"], "--max-sequence-length must be 1 to 512"),
        (["--max-sequence-length", "513"], "--max-sequence-length must be 1 to 512"),
        (["--size", "1000"], "--size must be a positive multiple of 16"),
        (["--requests", "0"], "--steps, --requests, --profile-steps and --rank must be at least 1"),
        (["--profile-steps", "0"], "--steps, --requests, --profile-steps and --rank must be at least 1"),
        (["--time-limit", "0"], "--time-limit must be positive"),
        (["--caps", "fp8=100"], "--caps takes NAME=SECONDS with NAME one of bare, fused"),
        (["--caps", "fused=soon"], "--caps takes NAME=SECONDS"),
        (["--compile", "partial"], "invalid choice: 'partial'"),
        (["--compile-mode", "fast"], "invalid choice: 'fast'"),
    ],
)
def test_bad_arguments_exit_2_naming_what_to_fix(args, message) -> None:
    result = _run(*args)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_the_wrapper_refuses_a_missing_wheel_folder(tmp_path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    missing = tmp_path / "nowhere"
    result = _run_script(["--wheels", str(missing)], env)
    assert result.returncode == 2 and f"--wheels {missing} is not a folder" in result.stderr
    result = _run_script(["--python"], env)
    assert result.returncode == 2 and "--python needs an interpreter" in result.stderr


def test_help_names_the_defaults_of_the_check() -> None:
    result = _run("--help")
    assert result.returncode == 0
    assert "--wheels DIR" in result.stdout and "--variants" in result.stdout and "--time-limit" in result.stdout
    assert "--max-sequence-length" in result.stdout and "fp8_fused" in result.stdout and "--caps" in result.stdout


def test_the_default_plan_fits_540_seconds_and_a_slow_variant_leaves_the_later_ones_their_share() -> None:
    args = gpu_check.parse_args([])
    assert args.time_limit == 540 and args.requests == 5 and args.variant_list == list(gpu_check.DEFAULT_VARIANTS)
    reserved = sum(gpu_check.BUDGETS[name].reserve_s for name in gpu_check.DEFAULT_VARIANTS)
    assert reserved <= args.time_limit
    # At the start bare gets its cap; fp8_bare, however slow, leaves fp8_fused its reserve.
    assert gpu_check.limit_for("bare", ["fused", "fp8_bare", "fp8_fused"], 540, args) == 120
    assert gpu_check.limit_for("fp8_bare", ["fp8_fused"], 365, args) == 170
    assert gpu_check.limit_for("fp8_bare", ["fp8_fused"], 250, args) == 250 - gpu_check.BUDGETS["fp8_fused"].reserve_s
    # unfused is optional: it keeps nothing back from those before it.
    assert gpu_check.limit_for("fp8_fused", ["unfused"], 200, args) == 200
    assert gpu_check.parse_args(["--caps", "fp8_bare=60"]).cap_s["fp8_bare"] == 60
    # Off CUDA the fp8 variants will not run: nothing is kept for them.
    on_cpu = gpu_check.parse_args(["--device", "cpu"])
    assert gpu_check.limit_for("unfused", ["fp8_bare", "fp8_fused"], 300, on_cpu) == 150


@pytest.mark.parametrize(
    ("variant", "compile_kind", "done", "next_phase"),
    [
        ("bare", "regional", "load", "compile"),
        ("bare", "none", "load", "first_request"),
        ("fp8_bare", "regional", "load", "quantize"),
        ("fused", "regional", "load", "slot"),
        ("fused", "regional", "slot", "compile"),
        ("fused", "regional", "compile", "adapters"),
        ("fp8_fused", "regional", "slot", "quantize"),
        ("fp8_fused", "regional", "quantize", "compile"),
        ("unfused", "none", "slot", "adapters"),
        ("fused", "regional", "timed_requests", "swap_floor"),
    ],
)
def test_a_phase_that_ended_says_which_began(variant, compile_kind, done, next_phase) -> None:
    args = gpu_check.parse_args(["--compile", compile_kind])
    assert gpu_check.phase_after(done, gpu_check.VARIANTS[variant], args) == next_phase


def test_a_child_that_hangs_after_its_last_figure_is_not_reported_stopped() -> None:
    child = (
        "import json, time\n"
        "print(json.dumps({'variant': 'bare', 'complete': True, 'seconds_per_image': 3.7}), flush=True)\n"
        "time.sleep(60)\n"
    )
    run = gpu_check.run_child([sys.executable, "-c", child], 2.0, "bare")
    report = gpu_check.variant_report(run, gpu_check.VARIANTS["bare"], gpu_check.parse_args([]), 2.0)
    assert run.stopped and report["seconds_per_image"] == 3.7
    assert report["exit"] == "killed at its limit after its last figure" and "stopped" not in report


@pytest.mark.parametrize(
    ("marks", "phase", "seconds"),
    [
        ([], "load", 30.0),  # nothing logged yet: the engine's first phase, since the child started
        ([({"phase": "load", "event": "begins", "seconds": 0.0}, 70.0)], "load", 30.0),
        ([({"phase": "slot", "event": "done", "seconds": 12.0}, 70.0)], "quantize", 30.0),
        # A step line within a phase (a warm-up pass) says how long the phase had run by then.
        ([({"phase": "warm-up", "event": "step", "seconds": 40.0}, 90.0)], "warm-up", 50.0),
        ([({"phase": "first_request", "event": "begins", "seconds": None}, 95.0)], "first_request", 5.0),
    ],
)
def test_a_stopped_child_is_placed_in_the_phase_its_last_line_names(marks, phase, seconds) -> None:
    run = gpu_check.ChildRun(marks=marks, wall_s=30.0, stopped=True)
    args = gpu_check.parse_args(["--warm-up"])
    where = gpu_check.where_stopped(run, gpu_check.VARIANTS["fp8_fused"], args, now=100.0)
    assert where == {"stopped_in_phase": phase, "seconds_in_phase": seconds}


def test_the_engines_start_up_lines_become_phase_marks(capsys) -> None:
    logger = logging.getLogger("loraswap.server.engine.pipeline.startup")
    handler = gpu_variant.PhaseMarks()
    logger.addHandler(handler)
    try:
        with pytest.MonkeyPatch.context() as patch:
            # setLevel, not the attribute: it also clears the logger's cache of isEnabledFor answers, which an
            # earlier test in this process may have filled while the level was WARNING.
            patch.setattr(logger, "level", logger.level)
            logger.setLevel(logging.INFO)
            # As PhaseClock (pipeline/phase_clock.py) logs a phase's end.
            logger.info(
                "start-up %s: %.2f s, %s", "quantize", 181.5, "fp8", extra={"phase": "quantize", "seconds": 181.5}
            )
            logger.info("start-up compile begins", extra={"phase": "compile"})
            logger.info(
                "start-up warm-up: pass 1 of 2 begins", extra={"phase": "warm-up", "event": "step", "seconds": 2.5}
            )
    finally:
        logger.removeHandler(handler)
        logger.setLevel(logger.level)  # the level restored by the patch; the cache cleared again
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith(gpu_check.PHASE_MARK)]
    marks = [json.loads(line[len(gpu_check.PHASE_MARK) :]) for line in lines]
    assert marks == [
        {"phase": "quantize", "event": "done", "seconds": 181.5},
        {"phase": "compile", "event": "begins", "seconds": None},
        {"phase": "warm-up", "event": "step", "seconds": 2.5},
    ]


def test_a_variant_stopped_at_its_limit_keeps_what_it_measured_and_says_where_it_stopped() -> None:
    child = (
        "import json, sys, time\n"
        "print(json.dumps({'variant': 'fp8_bare', 'complete': False, 'startup_s': 1.5}), flush=True)\n"
        f"sys.stderr.write({gpu_check.PHASE_MARK!r} + json.dumps({{'phase': 'load', 'event': 'done', 'seconds': 0.5}}) + '\\n')\n"
        "sys.stderr.write('quantizing...\\n'); sys.stderr.flush()\n"
        "time.sleep(60)\n"
    )
    run = gpu_check.run_child([sys.executable, "-c", child], 3.0, "fp8_bare")
    assert run.stopped and run.wall_s < 20
    args = gpu_check.parse_args([])
    report = gpu_check.variant_report(run, gpu_check.VARIANTS["fp8_bare"], args, 3.0)
    assert report["stopped"] == "still running after 3 s, its limit"
    # load ended, nothing else was logged: fp8_bare was quantizing, for about the 3 s since.
    assert report["stopped_in_phase"] == "quantize" and 1.0 < report["seconds_in_phase"] < 20
    assert report["startup_s"] == 1.5 and report["startup_phases_s"] == {"load": 0.5}
    assert "quantizing..." in report["stderr_tail"]


def test_a_smoke_run_measures_every_variant_into_one_json_object(tmp_path) -> None:
    out = tmp_path / "gpu.json"
    # tiny-flux encodes 32 T5 tokens by default: 64 shows the check's own length reaches every variant.
    result = _run(
        "--device", "cpu", "--model", "tiny-flux", "--size", "64", "--steps", "2", "--requests", "2",
        "--rank", "4", "--compile", "none", "--max-sequence-length", "64", "--profile-steps", "3",
        "--variants", ",".join(VARIANT_NAMES),
        "--out", str(out), timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout[result.stdout.index("{") :])
    assert report == json.loads(out.read_text())
    ran_with = {key: report[key] for key in TOP_KEYS}
    assert ran_with["environment"]["gpu"] is None and ran_with["environment"]["device"] == "cpu"
    assert {key: ran_with[key] for key in TOP_KEYS[:4]} == {
        "max_sequence_length": 64, "size": 64, "steps": 2, "layers": "full depth"
    }  # fmt: skip
    variants = report["variants"]
    assert tuple(variants) == VARIANT_NAMES
    assert variants["fp8_bare"] == variants["fp8_fused"] == {"skipped": "fp8 needs CUDA"}
    bare, fused, unfused = variants["bare"], variants["fused"], variants["unfused"]
    for name, variant in (("bare", bare), ("fused", fused), ("unfused", unfused)):
        missing = [key for key in VARIANT_KEYS if key not in variant]
        assert not missing and variant.get("complete", True), (name, missing, variant)
        phases = variant["phases_ms"]
        assert set(phases) == PHASES and all(phases[name] > 0 for name in PHASES - {"swap"}), phases
        assert variant["seconds_per_image"] > 0 and variant["recompilations"] == 0
        assert variant["max_sequence_length"] == 64 and variant["startup_s"] > 0 and variant["first_request_s"] > 0
        # The engine's own start-up log lines reached the parent.
        assert "load" in variant["startup_phases_s"], variant["startup_phases_s"]
        syncs = variant["host_syncs_per_step"]
        assert syncs is None or syncs >= 0, variant
        profile = variant["profile"]
        # 3 steps, 3 step ends: the 2 steps after the first are measured.
        assert set(profile["kernel_ms"]) == set(KINDS) and profile["steps_measured"] == 2, profile
        assert profile["attention_kernels"] and profile["kernel_count"]["gemm"] > 0, profile
    assert bare["swap_ms"] is None and bare["swap_floor_ms"] is None and bare["phases_ms"]["swap"] == 0
    assert bare["profile"]["kernel_count"]["merge"] == 0 and bare["profile"]["kernel_count"]["lora_factors"] == 0
    for slot in (fused, unfused):
        # A new adapter before every request: every timed request swapped.
        assert slot["swaps"] == 2 and slot["swap_ms"] > 0 and slot["swap_floor_ms"] > 0, slot
        assert "slot" in slot["startup_phases_s"]
    assert fused["fused"] and not unfused["fused"] and fused["fuse_pristine_gib"] >= unfused["fuse_pristine_gib"]
    assert fused["profile"]["kernel_count"]["merge"] > 0 and fused["profile"]["kernel_count"]["lora_factors"] == 0
    assert unfused["profile"]["kernel_count"]["lora_factors"] > 0
    plus_swap = bare["seconds_per_image"] + fused["swap_ms"] / 1000.0
    assert report["fused_over_bare"] == pytest.approx(fused["seconds_per_image"] / bare["seconds_per_image"], rel=1e-3)
    assert report["fused_over_bare_plus_swap"] == pytest.approx(fused["seconds_per_image"] / plus_swap, rel=1e-3)
    denoise = fused["phases_ms"]["denoise"] / bare["phases_ms"]["denoise"]
    assert report["fused_denoise_over_bare_denoise"] == pytest.approx(denoise, rel=1e-3)
    assert set(report["swap_over_floor"]) == {"fused", "unfused"} and "fp8_fused_seconds_per_image" not in report
    assert report["goals"]["fp8_fused_at_most_2_7_s"] is None and report["goals"]["no_recompilations"] is True


class _Scheduler:
    def step(self) -> None:
        pass


class _Residency:
    def load_stack(self) -> float:
        warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)  # the swap waits once
        return 1.0


class _Path:
    """A served request as the CUDA path sees it: a swap, then 4 steps, each step's callback waiting once."""

    def __init__(self) -> None:
        self.pipe = types.SimpleNamespace(scheduler=_Scheduler())
        self.residency = _Residency()

    def request(self, index: int):
        self.residency.load_stack()
        warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)  # prompt: not a step's
        for _ in range(4):
            self.pipe.scheduler.step()
            warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
            warnings.warn("some other warning", UserWarning, stacklevel=1)
        return index


def test_on_cuda_the_syncs_are_counted_between_step_ends_and_inside_swaps(monkeypatch) -> None:
    import torch

    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    path = _Path()
    served, counted = gpu_variant.timed_requests(path, gpu_check.parse_args(["--requests", "3"]), cuda=True)
    assert served == [1, 2, 3] and modes == ["warn", 0]
    # From the first step end to the last: 3 steps, 3 waits (the last step's callback wait comes after the last
    # step end, the prompt's before the first); each swap waits once.
    assert counted.figures() == {
        "host_syncs_per_step": 1.0,
        "host_syncs_per_swap": 1.0,
        "host_syncs_counted_by": "torch.cuda.set_sync_debug_mode",
    }
    # The wrappers are gone again: the scheduler's and the residency's own methods are back.
    assert "step" not in vars(path.pipe.scheduler) and "load_stack" not in vars(path.residency)


@pytest.mark.parametrize(
    "model",
    [
        "random-qwen-image",
        # A minute each here: make test-heavy. The default run checks the same path on random-qwen-image.
        pytest.param("random-z-image", marks=pytest.mark.heavy),
        pytest.param("random-flux2-klein", marks=pytest.mark.heavy),
    ],
)
def test_the_newer_families_random_models_run_the_check(model, tmp_path) -> None:
    # The full-width models of issue 42's families, one block deep and in float32 (bfloat16 matmuls are slow on
    # CPUs without AVX512-BF16): the check serves them as it will on the GPU, so the next GPU run can measure them.
    out = tmp_path / "gpu.json"
    result = _run(
        "--device", "cpu", "--dtype", "float32", "--model", model, "--layers", "1", "--size", "32", "--steps", "2",
        "--requests", "1", "--rank", "4", "--compile", "none", "--max-sequence-length", "64", "--profile-steps", "2",
        "--variants", "bare", "--out", str(out), timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert (report["model"], report["layers"], report["dtype"], report["size"]) == (model, 1, "float32", 32)
    bare = report["variants"]["bare"]
    assert all(key in bare for key in VARIANT_KEYS), bare
    assert bare["seconds_per_image"] > 0 and bare["recompilations"] == 0 and bare["host_syncs_per_step"] == 0
