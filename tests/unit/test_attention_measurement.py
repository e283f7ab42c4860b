"""--attention unset: on Hopper the start-up measures the installed attention kernels on the model's own shape and
runs the fastest; elsewhere native runs, unmeasured. GetServerInfo.attention_backend names what runs.

The choice (which candidates, which wins) is pure and tested here table by table; the timing loop runs on the CPU
here (wall clock) and on a Hopper GPU (CUDA events) in the test marked for it.
"""

from __future__ import annotations

import logging

import pytest
import torch

from loraswap.server.engine.config import EngineConfig
from loraswap.server.engine.pipeline.attention import (
    MEASURED_BACKENDS,
    NATIVE,
    AttentionShape,
    AttentionTimings,
    agreement_problem,
    attention_shape,
    choose_attention,
    eligible_backends,
    fastest,
    installed_backends,
    resolve_attention,
    sdpa_kernel,
    time_backends,
)
from loraswap.server.engine.pipeline.startup import load

torch.set_num_threads(1)

FLUX_SHAPE = AttentionShape(batch=1, heads=24, tokens=4608, head_dim=128)
EVERY_PACKAGE = frozenset(MEASURED_BACKENDS)
TORCH_ORDER = ("_native_cudnn", "_native_flash", "_native_efficient")  # torch's own kernels, in measuring order
TORCH_ONLY = frozenset(TORCH_ORDER)
HUB = ("_flash_3_hub", "flash_hub")


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _never_measure(*args, **kwargs) -> AttentionTimings:
    pytest.fail("measured where nothing should be")


@pytest.mark.parametrize(
    ("capability", "packages", "names", "eligible"),
    [
        ((9, 0), EVERY_PACKAGE, MEASURED_BACKENDS, MEASURED_BACKENDS),
        ((9, 0), TORCH_ONLY, MEASURED_BACKENDS, TORCH_ORDER),
        ((9, 0), TORCH_ONLY | {"_flash_3"}, MEASURED_BACKENDS, ("_flash_3", *TORCH_ORDER)),
        # A Hub kernel is fetched at start-up: never a candidate, even with `kernels` installed.
        ((9, 3), {*HUB, "_native_cudnn"}, (*HUB, "_native_cudnn"), ("_native_cudnn",)),
        ((8, 0), EVERY_PACKAGE, MEASURED_BACKENDS, ()),  # Ampere: native, as torch chooses
        ((8, 9), EVERY_PACKAGE, MEASURED_BACKENDS, ()),
        ((10, 0), EVERY_PACKAGE, MEASURED_BACKENDS, ()),
        (None, EVERY_PACKAGE, MEASURED_BACKENDS, ()),  # not CUDA
    ],
)  # fmt: skip
def test_eligible_backends(capability, packages, names, eligible):
    assert eligible_backends(capability, packages.__contains__, names) == eligible


def test_the_candidates_include_cudnn_and_flash_from_torch_and_no_hub_kernel():
    assert {"_native_cudnn", "_native_flash"} <= set(installed_backends())  # torch's own: always installed
    assert not any(name.endswith("_hub") for name in MEASURED_BACKENDS)


@pytest.mark.parametrize(
    ("seconds", "winner"),
    [
        ({}, None),
        ({"_native_flash": 0.8e-3}, "_native_flash"),
        ({"_native_flash": 0.79e-3, "_native_cudnn": 0.41e-3, "_native_efficient": 1.1e-3}, "_native_cudnn"),
        ({"_flash_3": 0.41e-3, "_native_cudnn": 0.42e-3}, "_flash_3"),
        ({"_native_cudnn": 0.5e-3, "_flash_3": 0.5e-3}, "_native_cudnn"),  # a tie: the one measured first
    ],
)
def test_fastest(seconds, winner):
    assert fastest(seconds) == winner


def test_tflops_are_the_published_figures_unit():
    # Published H100 figures for FLUX's shape: FA2 330 TFLOP/s, cuDNN and FA3 630 (4·B·H·S²·D FLOPs per call).
    assert FLUX_SHAPE.flops == 4 * 24 * 4608**2 * 128
    assert FLUX_SHAPE.tflops(FLUX_SHAPE.flops / 630e12) == pytest.approx(630)
    assert str(FLUX_SHAPE) == "(1, 24, 4608, 128)"


@pytest.mark.parametrize(
    ("output", "agrees"),
    [
        (lambda reference: reference, True),
        (lambda reference: reference.bfloat16().float(), True),  # one bf16 rounding: another kernel's sums
        (lambda reference: torch.zeros_like(reference), False),
        (lambda reference: reference.flip(0), False),
        (lambda reference: torch.full_like(reference, float("nan")), False),
    ],
)
def test_a_candidate_must_agree_with_native(output, agrees):
    reference = torch.randn(2, 48, 4, 16, generator=torch.Generator().manual_seed(0))
    assert (agreement_problem(output(reference), reference) is None) == agrees


@pytest.mark.parametrize(
    ("capability", "name", "seconds", "runs", "measured"),
    [
        ((9, 0), None, {"_native_cudnn": 0.41e-3, "_native_flash": 0.79e-3}, "_native_cudnn", True),
        ((9, 0), None, {"_native_flash": 0.79e-3, "_native_cudnn": 0.9e-3}, "_native_flash", True),
        ((9, 0), None, {}, NATIVE, True),  # every candidate skipped
        ((9, 0), "_native_flash", {}, "_native_flash", False),  # an explicit --attention is honoured
        ((9, 0), "Native", {}, NATIVE, False),
        ((8, 0), None, {}, NATIVE, False),  # off Hopper: as before
    ],
)
def test_on_cuda_unset_measures_on_hopper_only_and_runs_the_fastest(
    monkeypatch, caplog, capability, name, seconds, runs, measured
):
    # No CUDA here: torch's capability query answers for the device, and the timing is a stand-in.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    asked = []

    def measure(names, shape, dtype, device):
        asked.append(names)
        return AttentionTimings(shape, seconds, {"_native_efficient": "RuntimeError: no kernel"}, 0.2)

    with caplog.at_level(logging.INFO, logger="loraswap.server.engine.pipeline.attention"):
        assert resolve_attention(name, torch.device("cuda"), FLUX_SHAPE, torch.bfloat16, measure) == runs
    assert asked == ([installed_backends()] if measured else [])
    lines = [record.getMessage() for record in caplog.records]
    if measured:
        # One line: what runs, on which shape, and every candidate's TFLOP/s or why it was skipped.
        assert len(lines) == 1 and lines[0].startswith(f"attention: {runs} runs, measured on (1, 24, 4608, 128)")
        assert all(f"{name} {FLUX_SHAPE.tflops(s):.3g} TFLOP/s" in lines[0] for name, s in seconds.items())
        assert "_native_efficient skipped (RuntimeError: no kernel)" in lines[0]
    else:
        assert lines == []


def test_a_denoiser_without_its_shape_is_not_measured(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert resolve_attention(None, torch.device("cuda"), None, torch.bfloat16, _never_measure) == NATIVE


@pytest.fixture(scope="module")
def tiny_flux():
    return load(EngineConfig(model="tiny-flux", device="cpu", torch_threads=1))


@pytest.mark.parametrize("model", ["tiny-flux", "shapes"])
def test_the_measured_shape_is_the_one_the_denoiser_attends_at_by_default(monkeypatch, model, tiny_flux):
    from diffusers.models.transformers import transformer_flux

    loaded = tiny_flux if model == "tiny-flux" else load(EngineConfig(model=model, device="cpu", torch_threads=1))
    seen = set()
    dispatch = transformer_flux.dispatch_attention_fn

    def recording(query, *args, **kwargs):
        seen.add(tuple(query.shape))  # (batch, tokens, heads, head_dim)
        return dispatch(query, *args, **kwargs)

    monkeypatch.setattr(transformer_flux, "dispatch_attention_fn", recording)
    arguments = loaded.defaults.to_dict() | loaded.traits.pipeline_kwargs("", loaded.defaults.guidance_scale, loaded.defaults)
    loaded.pipe("a red circle", **arguments | {"num_inference_steps": 1}, output_type="latent")
    shape = attention_shape(loaded)
    assert seen == {(shape.batch, shape.tokens, shape.heads, shape.head_dim)}


def test_sdxl_has_no_shape_to_measure():
    loaded = load(EngineConfig(model="tiny-sdxl", device="cpu", torch_threads=1))
    assert attention_shape(loaded) is None
    assert choose_attention(None, loaded, _never_measure) == NATIVE


def test_on_cpu_the_start_up_runs_native_without_measuring(tiny_flux):
    assert choose_attention(None, tiny_flux, _never_measure) == NATIVE


def test_the_timing_loop_measures_what_runs_and_skips_what_raises():
    # On the CPU torch's flash kernel runs and cuDNN's cannot: one measured, one skipped with torch's reason.
    shape = AttentionShape(batch=1, heads=2, tokens=64, head_dim=16)
    timings = time_backends(("_native_cudnn", "_native_flash"), shape, torch.float32, torch.device("cpu"), calls=2)
    assert list(timings.seconds) == ["_native_flash"] and timings.seconds["_native_flash"] > 0
    assert list(timings.skipped) == ["_native_cudnn"] and timings.skipped["_native_cudnn"].startswith("RuntimeError")
    assert fastest(timings.seconds) == "_native_flash"
    assert timings.tflops()["_native_flash"] == pytest.approx(shape.tflops(timings.seconds["_native_flash"]))


def test_torch_says_which_sdpa_kernel_native_takes():
    # What `native/<kernel>` names on CUDA; the CPU's SDPA answers the same question.
    assert sdpa_kernel(AttentionShape(1, 2, 64, 16), torch.float32, torch.device("cpu")) in {"flash", "math"}


@pytest.mark.skipif(not _hopper(), reason="the start-up measures on Hopper GPUs only")
def test_on_hopper_the_measurement_times_cudnn_and_flash_quickly(caplog):
    timings = time_backends(installed_backends(), FLUX_SHAPE, torch.bfloat16, torch.device("cuda"))
    assert {"_native_cudnn", "_native_flash"} <= set(timings.seconds), timings.skipped
    assert timings.elapsed_s < 2.0
    assert fastest(timings.seconds) in installed_backends()
    loaded = load(EngineConfig(model="tiny-flux", device="cuda", dtype="bfloat16", torch_threads=1))
    with caplog.at_level(logging.INFO, logger="loraswap.server.engine.pipeline.attention"):
        running = choose_attention(None, loaded)
    assert running in installed_backends() and "TFLOP/s" in caplog.text
