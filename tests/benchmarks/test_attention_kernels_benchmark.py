"""benchmarks/attention_kernels.py runs tiny on the CPU and prints each installed backend's figures in one JSON line."""

from __future__ import annotations

from loraswap.server.engine.pipeline.attention import installed_backends
from tests.benchmarks.test_benchmarks import run_benchmark


def test_attention_kernels_benchmark_measures_the_reference_and_the_models_shape():
    report = run_benchmark(
        "benchmarks.attention_kernels", "--device", "cpu", "--model", "tiny-flux", "--shape", "1,2,64,16",
        "--calls", "2", "--dtype", "float32",
    )  # fmt: skip
    shapes = report["shapes"]
    assert shapes["reference"]["shape"] == [1, 2, 64, 16]
    assert shapes["model"]["shape"] == [1, 2, 288, 16]  # tiny-flux at 64²: 256 image tokens and 32 T5 tokens
    for figures in shapes.values():
        # Every installed candidate and native is either measured or skipped with its reason.
        assert set(figures["ms"]) | set(figures["skipped"]) == {*installed_backends(), "native"}
        assert {"_native_flash", "native"} <= set(figures["tflops"])  # torch's flash kernel runs on a CPU
        assert all(value > 0 for value in figures["tflops"].values()) and set(figures["tflops"]) == set(figures["ms"])
        assert figures["fastest"] in installed_backends() and figures["native_kernel"] in {"flash", "math"}
    assert report["environment"]["torch"]
