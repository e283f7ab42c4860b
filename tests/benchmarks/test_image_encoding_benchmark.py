"""benchmarks/image_encoding.py runs small and prints every setting's figures for both pictures as one JSON line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_image_encoding_benchmark_measures_every_setting_on_both_pictures() -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks.image_encoding", "--size", "64", "--repeats", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-3000:]
    report = json.loads(completed.stdout.strip().splitlines()[-1])

    assert report["benchmark"] == "image_encoding" and report["size"] == 64 and report["repeats"] == 2
    settings = set(report["settings"])
    assert {f"png_level_{level}" for level in range(10)} <= settings
    assert {"png_rle_level_1", "jpeg_q95", "webp_lossless_method_4_quality_80"} <= settings
    assert {"served_png", "served_jpeg", "served_webp"} <= settings
    for picture in ("noise", "photo"):
        figures = report["pictures"][picture]
        assert set(figures) == settings
        for figure in figures.values():
            assert 0 < figure["min_ms"] <= figure["median_ms"] and figure["bytes"] > 0
        # What the server writes is measured with the server's own options.
        assert figures["served_png"]["bytes"] == figures["png_rle_level_1"]["bytes"]
    # Noise is the incompressible one; photo-like pixels compress to about half under PNG.
    assert report["pictures"]["noise"]["png_level_6"]["of_raw"] > 0.95
    assert report["pictures"]["photo"]["png_level_6"]["of_raw"] < 0.8
