"""benchmarks/gpu_check.sh on the CPU: its argument handling, and one smoke run of the whole script on `tiny-flux`.

The figures it exists for need an H100/H200 (BENCHMARKS.md); here it must parse, refuse bad arguments with one
line and exit 2, install nothing when told no wheels, and run its variants end to end into one JSON object.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


def _run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        ["bash", str(SCRIPT), "--wheels", "", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--variants", "fp16"], "--variants takes some of none, fp8, bare"),
        (["--variants", ""], "--variants takes some of none, fp8, bare"),
        (["--size", "1000"], "--size must be a positive multiple of 16"),
        (["--requests", "0"], "--steps, --requests and --rank must be at least 1"),
        (["--time-limit", "0"], "--time-limit must be positive"),
        (["--compile", "partial"], "invalid choice: 'partial'"),
    ],
)
def test_bad_arguments_exit_2_naming_what_to_fix(args, message) -> None:
    result = _run(*args)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_the_wrapper_refuses_a_missing_wheel_folder(tmp_path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    missing = tmp_path / "nowhere"
    result = subprocess.run(
        ["bash", str(SCRIPT), "--wheels", str(missing)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode == 2 and f"--wheels {missing} is not a folder" in result.stderr
    result = subprocess.run(
        ["bash", str(SCRIPT), "--python"], check=False, capture_output=True, text=True, timeout=60, env=env
    )
    assert result.returncode == 2 and "--python needs an interpreter" in result.stderr


def test_help_names_the_defaults_of_the_check() -> None:
    result = _run("--help")
    assert result.returncode == 0
    assert "--wheels DIR" in result.stdout and "--variants" in result.stdout and "--time-limit" in result.stdout


def test_a_smoke_run_measures_every_variant_into_one_json_object(tmp_path) -> None:
    out = tmp_path / "gpu.json"
    result = _run(
        "--device", "cpu", "--model", "tiny-flux", "--size", "64", "--steps", "2", "--requests", "2",
        "--rank", "4", "--compile", "none", "--variants", "none,bare", "--out", str(out), timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout[result.stdout.index("{") :])
    assert report == json.loads(out.read_text())
    slot, bare = report["variants"]["none"], report["variants"]["bare"]
    assert slot["swaps"] == 2 and slot["recompilations"] == 0 and slot["swap_ms"] > 0, slot
    assert slot["seconds_per_image"] > 0 and bare["seconds_per_image"] > 0
    assert report["lora_tax"] == pytest.approx(slot["seconds_per_image"] / bare["seconds_per_image"], rel=1e-3)
    assert report["environment"]["device"] == "cpu" and "fp8_speedup" not in report
