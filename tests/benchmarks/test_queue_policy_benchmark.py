"""python -m benchmarks.queue_policy runs on the tiny model and prints well-formed JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_queue_policy_benchmark_prints_its_figures():
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks.queue_policy", "--requests", "24", "--adapters", "6", "--steps", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    report = json.loads(completed.stdout.strip().splitlines()[-1])
    for policy in ("fifo", "adapter_aware"):
        figures = report[policy]
        assert figures["recompilations"] == 0
        assert 0 < figures["swaps"] <= 24
        assert figures["wait_ms"]["p50"] <= figures["wait_ms"]["p99"] <= figures["wait_ms"]["max"]
    assert report["fifo"]["max_bypass"] == 0 and report["adapter_aware"]["max_bypass"] == 4
    assert report["adapter_aware"]["swaps"] <= report["fifo"]["swaps"]
