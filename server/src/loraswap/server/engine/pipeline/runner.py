"""One pipeline call: the prompt encoded, the denoising steps streamed through a callback, the image decoded.

Whatever is resident stays as it is: the runtime makes a stack resident first (runtime.py), the warm-up
runs the base model at each rank bucket (warm_up.py). Always inside `session()`: under
`torch.inference_mode()` (compiled graphs are specialised on the grad mode, so warming up and serving
in the same mode keeps them valid) and the compiled convolutions' backend guard. The step callback never
waits for the device: each step is read one step late (step_reads.py). Writing the image's file is the
caller's (image_encoding.py), so that it can overlap the next run.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from loraswap.server.engine.adapters.formats import StackMember
from loraswap.server.engine.errors import ErrorReason, GenerationCancelledError, InvalidRequestError
from loraswap.server.engine.pipeline.call_hooks import around_calls
from loraswap.server.engine.pipeline.compile import conv_backend
from loraswap.server.engine.pipeline.device_timeline import DeviceMark
from loraswap.server.engine.pipeline.records import CompiledDenoiser, LoadedModel
from loraswap.server.engine.pipeline.step_reads import OneStepBehind
from loraswap.server.engine.types import GenerationParams, StepProgress

if TYPE_CHECKING:
    from PIL.Image import Image


@dataclass(frozen=True)
class PipelineRun:
    """A decoded image, not yet written as a file, and where the run's time went."""

    pixels: Image
    denoise_ms: float  # from the call to the last step's end: the prompt encoded and the steps run
    decode_ms: float  # from the last step's end to the decoded image: the VAE decode (no file written yet)
    encode_prompt_ms: float  # the part of denoise_ms spent in the pipeline's encode_prompt
    decoded_at: float  # time.perf_counter() when the image was decoded


class PipelineRunner:
    """Runs the loaded pipeline once per call. Worker thread only."""

    def __init__(self, loaded: LoadedModel, compiled: CompiledDenoiser) -> None:
        self._loaded = loaded
        self._compiled = compiled

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """Where swaps and runs happen: inference mode, and the compiled convolutions' backend."""
        loaded = self._loaded
        conv_guard = conv_backend(
            compiled=self._compiled.compiled, convolutional=loaded.traits.convolutional_denoiser,
            device=loaded.device, dtype=loaded.dtype,
        )  # fmt: skip
        with torch.inference_mode(), conv_guard:
            yield

    def run(
        self,
        params: GenerationParams,
        *,
        on_step: Callable[[StepProgress], None],
        is_cancelled: Callable[[], bool],
        stack: tuple[StackMember, ...] = (),
    ) -> PipelineRun:
        """Run the pipeline, streaming each step through on_step, up to the decoded image; call inside session().

        A step's progress comes once the device has finished it, during the next step's callback (the last one's
        in its own). `stack` is what is resident, for the message of a generation that stops being finite: it is
        refused (GENERATION_NOT_FINITE) at most one step after the step that overflowed. Raises
        GenerationCancelledError at the first step boundary after is_cancelled() turns true, before the decode.
        """
        loaded = self._loaded
        started_at = time.perf_counter()
        started = DeviceMark(loaded.device)
        steps = OneStepBehind(
            params, loaded.previewer, started, on_step, not_finite=lambda step: _not_finite_error(stack, step)
        )

        def step_end(pipe, index, timestep, callback_kwargs):
            loaded.threads.adjust()
            steps.step_ended(index + 1, callback_kwargs["latents"])
            if is_cancelled():
                raise GenerationCancelledError("the caller cancelled; generation stopped at a step boundary")
            return callback_kwargs

        loaded.threads.adjust()
        prompt_marks: list[DeviceMark] = []  # before and after each encode_prompt call, read after the run

        def mark() -> None:
            prompt_marks.append(DeviceMark(loaded.device))

        with around_calls(loaded.pipe, "encode_prompt", before=mark, after=mark):
            result = loaded.pipe(**self._pipeline_kwargs(params), callback_on_step_end=step_end)
        decoded_at = time.perf_counter()
        # Every mark is passed by now: the last step was waited for before the decode.
        denoise_ms = steps.last_read.ms_since(started)
        return PipelineRun(
            pixels=result.images[0],
            denoise_ms=denoise_ms,
            decode_ms=(decoded_at - started_at) * 1000.0 - denoise_ms,
            encode_prompt_ms=sum(end.ms_since(begun) for begun, end in zip(prompt_marks[::2], prompt_marks[1::2])),
            decoded_at=decoded_at,
        )

    def _pipeline_kwargs(self, params: GenerationParams) -> dict:
        defaults = self._loaded.defaults
        kwargs = dict(
            prompt=params.prompt, num_inference_steps=params.num_inference_steps,
            width=params.width, height=params.height, output_type="pil",
            # A CPU generator makes the initial noise, and so the image, the same on every device.
            generator=torch.Generator("cpu").manual_seed(params.seed),
        )  # fmt: skip
        kwargs.update(self._loaded.traits.pipeline_kwargs(params.negative_prompt, params.guidance_scale, defaults))
        if defaults.max_sequence_length is not None:
            kwargs["max_sequence_length"] = defaults.max_sequence_length
        return kwargs


def _not_finite_error(stack: tuple[StackMember, ...], step: int) -> InvalidRequestError:
    """What to tell a caller whose generation overflowed: the adapter values are finite, their effect is not."""
    if not stack:
        return InvalidRequestError(
            f"the generation's latents stopped being finite at step {step}; the model overflows at these settings, "
            "try another guidance_scale, size or prompt",
            reason=ErrorReason.GENERATION_NOT_FINITE,
            field="guidance_scale",
            step=step,
        )
    return InvalidRequestError(
        f"the generation's latents stopped being finite at step {step}: the adapter's effect overflows the model; "
        "lower adapter_scale (or the stack's scales) or use another adapter",
        reason=ErrorReason.GENERATION_NOT_FINITE,
        field="adapter_scale" if len(stack) == 1 else "adapters",
        step=step,
    )
