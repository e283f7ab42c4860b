"""benchmarks/url_load.py runs small against a real nginx and prints its figures as one JSON line."""

from __future__ import annotations

import math

from tests.benchmarks.test_benchmarks import run_benchmark
from tests.support.web_servers import require_nginx

require_nginx()

PATHS = ("disk", "url", "transfer", "disk_load", "url_load")


def test_url_load_benchmark_times_each_path_side_by_side():
    report = run_benchmark("benchmarks.url_load", "--repeats", "2", "--rank", "8")
    assert report["benchmark"] == "url_load" and report["model"] == "shapes" and report["adapter_bytes"] > 0
    assert set(report["median_s"]) == set(report["samples_s"]) == set(PATHS)
    assert all(len(samples) == 2 and all(value > 0 for value in samples) for samples in report["samples_s"].values())
    for ratio in ("url_over_disk_plus_transfer", "url_over_disk"):
        assert math.isfinite(report[ratio]) and report[ratio] > 0
