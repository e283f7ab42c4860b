"""benchmarks/lora_tax.py runs on a tiny model and prints every variant as its last line of JSON.

Uncompiled here (compiling six graphs takes minutes on CI's cores); the figures are not asserted, only the
report's shape and what holds on any machine: the slot computes at each adapter's bucket, and a fused adapter at
the base model's graph after a merge.
"""

from __future__ import annotations

from benchmarks.lora_tax import FUSED_VARIANTS, VARIANTS

from tests.benchmarks.test_benchmarks import run_benchmark


def test_lora_tax_benchmark_reports_every_variant_and_its_bucket(tmp_path):
    report = run_benchmark(
        "benchmarks.lora_tax", "--model", "tiny-flux", "--size", "32", "--repeats", "2", "--backend", "none",
        "--quantize", "none", "--json-out", str(tmp_path / "tax.json"),
    )  # fmt: skip
    assert report["model"] == "tiny-flux" and report["max_rank"] == 64 and report["torch_threads"] == 1
    (run,) = report["runs"]
    assert run["quantization"] == "none" and run["rank_buckets"] == [16, 32, 64]
    assert set(run["variants"]) == set(VARIANTS) and set(FUSED_VARIANTS) == {"fused_r8", "fused_r32", "fused_r64"}
    assert run["pristine_bytes"] > 0
    for figures in run["variants"].values():
        assert 0 < figures["min_ms"] <= figures["median_ms"] <= figures["max_ms"]
    buckets = {name: figures.get("computes_at_rank") for name, figures in run["variants"].items()}
    assert buckets == {
        "bare": None, "slot_base": 0, "slot_base_full_width": 64, "slot_r8": 16, "slot_r8_full_width": 64,
        "slot_r32": 32, "slot_r64": 64, "fused_r8": 0, "fused_r32": 0, "fused_r64": 0, "diffusers_hotswap": None,
    }  # fmt: skip
    for name in FUSED_VARIANTS:
        fused = run["variants"][name]
        # A merge before the first call and before each of the 2 timed rounds (the order rotates every round).
        assert fused["merges"] == 3 and fused["merge_ms"] > 0, fused
        assert {"over_slot_base_pct", "saving_ms_per_forward", "merge_pays_after_forwards"} <= set(fused)
