"""Each step is read one step late (engine/pipeline/step_reads.py), on a real tiny-flux pipeline.

What the host reads of step i (its progress, its preview, whether its latents are finite) comes during step i+1's
callback, and the last step's in its own, before the decode. So a progress event arrives when the denoiser has run
exactly one step further (never more: the host queues at most two steps ahead), a non-finite latent is refused at
most one step after the step that made it and before any decode, and a cancel stops at the next step boundary.
The denoiser's and the VAE's calls are counted with forward hooks; a non-finite step is made by a hook that turns
one step's denoiser output into infinities (the runner under test is not touched).
"""

from __future__ import annotations

import contextlib

import pytest

from loraswap.server.engine.config import EngineConfig
from loraswap.server.engine.errors import GenerationCancelledError, InvalidRequestError
from loraswap.server.engine.pipeline.runner import PipelineRunner
from loraswap.server.engine.pipeline.startup import start_runtime
from loraswap.server.engine.types import GenerationRequest
from tests.support.servers import TEST_TORCH_THREADS

STEPS = 5


@pytest.fixture(scope="module")
def runtime():
    return start_runtime(
        EngineConfig(model="tiny-flux", device="cpu", compile=False, warmup=False, torch_threads=TEST_TORCH_THREADS)
    )


class Calls:
    """Forward calls of the denoiser and of the VAE's decoder; `overflow_at`: the denoiser call whose output is
    filled with `value` (1-based; 0: none)."""

    def __init__(self, overflow_at: int = 0, value: float = float("inf")) -> None:
        self.denoiser = 0
        self.decoder = 0
        self.overflow_at = overflow_at
        self.value = value

    def denoised(self, module, inputs, output):
        self.denoiser += 1
        if self.denoiser == self.overflow_at:
            sample = output[0] if isinstance(output, tuple) else output.sample
            sample.fill_(self.value)
        return output

    def decoded(self, module, inputs, output):
        self.decoder += 1


@contextlib.contextmanager
def counting(runtime, calls: Calls):
    hooks = (
        runtime.loaded.denoiser.register_forward_hook(calls.denoised),
        runtime.loaded.pipe.vae.decoder.register_forward_hook(calls.decoded),
    )
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def run(runtime, calls: Calls, *, on_step=None, is_cancelled=bool, preview_every: int = 0):
    runner = PipelineRunner(runtime.loaded, runtime.compiled)
    params = runtime.request_rules.resolve(
        GenerationRequest(prompt="a red circle", seed=3, num_inference_steps=STEPS, preview_every=preview_every)
    )
    with runner.session(), counting(runtime, calls):
        return runner.run(params, on_step=on_step or (lambda progress: None), is_cancelled=is_cancelled)


def test_a_step_is_read_once_the_next_has_run_and_the_last_before_the_decode(runtime) -> None:
    calls = Calls()
    seen = []  # (step, denoiser calls, decoder calls) at each progress event

    def on_step(progress):
        seen.append((progress.step, calls.denoiser, calls.decoder))

    result = run(runtime, calls, on_step=on_step, preview_every=2)

    assert seen == [(step, min(step + 1, STEPS), 0) for step in range(1, STEPS + 1)]
    assert calls.decoder == 1
    assert result.pixels.size == (64, 64)


def test_progress_times_grow_and_the_phases_add_up(runtime) -> None:
    events = []
    result = run(runtime, Calls(), on_step=events.append, preview_every=2)

    times = [event.elapsed_ms for event in events]
    assert times == sorted(times) and times[0] > 0
    assert [bool(event.preview) for event in events] == [False, True, False, True, True]
    assert times[-1] == pytest.approx(result.denoise_ms)
    assert 0 < result.encode_prompt_ms < result.denoise_ms
    assert result.decode_ms > 0


@pytest.mark.parametrize("overflow_at", [2, STEPS])
def test_a_non_finite_step_is_refused_at_most_one_step_later_and_never_decoded(runtime, overflow_at: int) -> None:
    calls = Calls(overflow_at=overflow_at)
    steps = []

    with pytest.raises(InvalidRequestError) as refused:
        run(runtime, calls, on_step=lambda progress: steps.append(progress.step))

    error = refused.value
    assert error.reason == "GENERATION_NOT_FINITE"
    assert error.metadata == {"field": "guidance_scale", "step": str(overflow_at)}
    assert f"stopped being finite at step {overflow_at};" in error.message
    assert steps == list(range(1, overflow_at + 1))  # its progress came, as before the refusal
    assert calls.denoiser == min(overflow_at + 1, STEPS)
    assert calls.decoder == 0


def test_a_cancel_stops_at_the_next_step_boundary_before_the_decode(runtime) -> None:
    calls = Calls()
    cancelled = False
    steps = []

    def on_step(progress):
        nonlocal cancelled
        steps.append(progress.step)
        cancelled = cancelled or progress.step == 2  # the caller cancels on seeing step 2

    with pytest.raises(GenerationCancelledError):
        run(runtime, calls, on_step=on_step, is_cancelled=lambda: cancelled)

    assert steps == [1, 2]
    assert calls.denoiser == 3  # step 2 was read in step 3's callback, which then stopped
    assert calls.decoder == 0


def test_a_nan_step_is_refused_as_an_infinite_one(runtime) -> None:
    calls = Calls(overflow_at=1, value=float("nan"))
    with pytest.raises(InvalidRequestError, match="at step 1;"):
        run(runtime, calls)
    assert (calls.denoiser, calls.decoder) == (2, 0)
