"""benchmarks/gpu_check.sh on the CPU: its argument handling, and one smoke run of the whole script on `tiny-flux`.

The figures it exists for need an H100/H200 (BENCHMARKS.md); here it must parse, refuse bad arguments with one
line and exit 2, install nothing when told no wheels, and run its variants (the fused one too, and every variant
at FLUX.1-dev's 512 T5 tokens) end to end into one JSON object.
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
        (["--variants", "fp16"], "--variants takes some of none, fp8, bare, fused"),
        (["--variants", ""], "--variants takes some of none, fp8, bare, fused"),
        (["--max-sequence-length", "0"], "--max-sequence-length must be 1 to 512"),
        (["--max-sequence-length", "513"], "--max-sequence-length must be 1 to 512"),
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
    assert "--max-sequence-length" in result.stdout and "fused" in result.stdout


def test_a_smoke_run_measures_every_variant_into_one_json_object(tmp_path) -> None:
    out = tmp_path / "gpu.json"
    result = _run(
        "--device", "cpu", "--model", "tiny-flux", "--size", "64", "--steps", "2", "--requests", "2",
        "--rank", "4", "--compile", "none", "--variants", "none,bare,fused", "--out", str(out), timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout[result.stdout.index("{") :])
    assert report == json.loads(out.read_text())
    ran_with = {key: report[key] for key in ("size", "steps", "layers", "max_sequence_length")}
    assert ran_with == {"size": 64, "steps": 2, "layers": "full depth", "max_sequence_length": 512}
    slot, bare, fused = report["variants"]["none"], report["variants"]["bare"], report["variants"]["fused"]
    assert slot["swaps"] == 2 and slot["recompilations"] == 0 and slot["swap_ms"] > 0, slot
    assert fused["swaps"] == 2 and fused["recompilations"] == 0 and fused["swap_ms"] > 0, fused
    assert fused["fused"] and not slot["fused"] and slot["fuse_pristine_gib"] == 0.0
    # Every variant ran at the real FLUX.1-dev text length.
    assert all(variant["max_sequence_length"] == 512 for variant in (slot, bare, fused))
    assert slot["seconds_per_image"] > 0 and bare["seconds_per_image"] > 0 and fused["seconds_per_image"] > 0
    assert report["lora_tax"] == pytest.approx(slot["seconds_per_image"] / bare["seconds_per_image"], rel=1e-3)
    plus_swap = bare["seconds_per_image"] + fused["swap_ms"] / 1000.0
    assert report["fused_over_bare_plus_swap"] == pytest.approx(fused["seconds_per_image"] / plus_swap, rel=1e-3)
    assert report["environment"]["device"] == "cpu" and "fp8_speedup" not in report
