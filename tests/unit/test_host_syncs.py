"""The step loop never waits for the device: 0 host syncs per step, counted by devtools/host_syncs.py.

Real tiny-flux and tiny-sdxl pipelines run through the engine's PipelineRunner under the counter, with a preview
every step (the most the loop copies to the host). The same counter sees the finiteness check the runner used to
make (`bool(torch.isfinite(latents).all())` in the step callback) once per step, so putting it back fails the first
test. The counter's own rules (what counts as the device's value on the CPU) are checked on small modules.
"""

from __future__ import annotations

import pytest
import torch

from loraswap.server.devtools.host_syncs import HostSyncCounter
from loraswap.server.engine.config import EngineConfig
from loraswap.server.engine.pipeline.runner import PipelineRunner
from loraswap.server.engine.pipeline.startup import start_runtime
from loraswap.server.engine.types import GenerationRequest
from tests.support.servers import TEST_TORCH_THREADS

STEPS = 4


@pytest.fixture(scope="module", params=["tiny-flux", "tiny-sdxl"])
def runtime(request):
    return start_runtime(
        EngineConfig(model=request.param, device="cpu", compile=False, warmup=False, torch_threads=TEST_TORCH_THREADS)
    )


def counted(runtime, run) -> HostSyncCounter:
    """`run(runner, params)` under a counter watching the pipeline's components, with a boundary per step."""
    pipe = runtime.loaded.pipe
    runner = PipelineRunner(runtime.loaded, runtime.compiled)
    params = runtime.request_rules.resolve(
        GenerationRequest(prompt="a red circle", seed=1, num_inference_steps=STEPS, preview_every=1)
    )
    with runner.session():
        with HostSyncCounter(runtime.loaded.device, watched=pipe.components.values()) as counter:
            with counter.steps_of(pipe.scheduler):
                run(runner, params)
    return counter


def test_the_runners_step_loop_makes_no_host_sync(runtime) -> None:
    progress = []
    counter = counted(runtime, lambda runner, params: runner.run(params, on_step=progress.append, is_cancelled=bool))

    assert [event.step for event in progress] == list(range(1, STEPS + 1))
    assert all(event.preview for event in progress)  # the previews' pixels came to the host too, without a wait
    # One entry before the first step's end, one per step after it (the last covers the decode).
    assert counter.per_step == [0] * (STEPS + 1), counter.seen


def test_the_counter_sees_a_finiteness_check_read_in_the_step_callback(runtime) -> None:
    def eager_check(pipe, index, timestep, callback_kwargs):
        bool(torch.isfinite(callback_kwargs["latents"]).all())
        return callback_kwargs

    def run(runner, params):
        runtime.loaded.pipe(
            prompt=params.prompt, num_inference_steps=params.num_inference_steps, width=params.width,
            height=params.height, generator=torch.Generator().manual_seed(params.seed),
            callback_on_step_end=eager_check,
        )  # fmt: skip

    counter = counted(runtime, run)

    # The callback runs after each step's boundary: one read in every step but the first's entry.
    assert counter.per_step == [0] + [1] * STEPS, counter.seen
    assert {sync.op for sync in counter.seen} <= {"aten.is_nonzero", "aten._local_scalar_dense"}


# -------------------------------------------------------------------------------- the counter's rules on the CPU


def test_a_read_of_what_the_watched_weights_computed_counts_and_one_of_host_values_does_not() -> None:
    layer = torch.nn.Linear(4, 4)
    sigmas = torch.linspace(1.0, 0.0, 5)  # like a scheduler's: made on the host, kept there
    with torch.inference_mode(), HostSyncCounter("cpu", watched=[layer]) as counter:
        output = layer(torch.ones(1, 4))
        bool(sigmas[1] <= 0.9)
        float(sigmas.max())
        assert counter.syncs == 0
        float(output.sum())
        assert counter.syncs == 1
        bool(torch.isfinite(output * sigmas[2]).all())  # mixed with host values: still the device's
        assert counter.syncs == 2
        output.nonzero()
        assert [sync.op for sync in counter.seen][-1] == "aten.nonzero"


def test_an_asynchronous_copy_to_host_memory_ends_the_devices_lineage() -> None:
    layer = torch.nn.Linear(4, 1)
    with torch.inference_mode(), HostSyncCounter("cpu", watched=[layer]) as counter:
        flag = torch.isfinite(layer(torch.ones(1, 4))).all()
        staged = torch.empty((), dtype=torch.bool)
        staged.copy_(flag, non_blocking=True)
        bool(staged)
        assert counter.syncs == 0
        waited = torch.empty((), dtype=torch.bool)
        waited.copy_(flag)  # a blocking copy keeps the lineage: on a GPU it is the wait
        bool(waited)
        assert counter.syncs == 1


def test_steps_are_counted_apart_and_on_the_cpu_the_watched_modules_are_required() -> None:
    layer = torch.nn.Linear(2, 2)
    with torch.inference_mode(), HostSyncCounter("cpu", watched=[layer, "not a module"]) as counter:
        float(layer(torch.ones(2)).sum())
        counter.next_step()
        counter.next_step()
        float(layer(torch.ones(2)).sum())
        float(layer(torch.ones(2)).sum())
    assert counter.per_step == [1, 0, 2]
    assert [sync.step for sync in counter.seen] == [0, 2, 2]
    with pytest.raises(ValueError, match="watched"):
        HostSyncCounter("cpu")
