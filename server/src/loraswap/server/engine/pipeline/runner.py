"""One pipeline call: the denoising steps streamed through a callback, then the image encoded.

Whatever is resident stays as it is: the runtime makes a stack resident first (runtime.py), the warm-up
runs the base model at each rank bucket (startup.py). Always inside `session()`: under
`torch.inference_mode()` (compiled graphs are specialised on the grad mode, so warming up and serving
in the same mode keeps them valid) and the compiled convolutions' backend guard.
"""

from __future__ import annotations

import contextlib
import io
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from loraswap.server.engine.adapters.canonical import StackMember
from loraswap.server.engine.errors import ErrorReason, GenerationCancelledError, InvalidRequestError
from loraswap.server.engine.pipeline.compile import conv_backend
from loraswap.server.engine.pipeline.records import CompiledDenoiser, LoadedModel
from loraswap.server.engine.types import GenerationParams, ImageFormat, StepProgress

JPEG_QUALITY = 95


@dataclass(frozen=True)
class PipelineRun:
    """An encoded image and how long its steps and its decode took."""

    data: bytes
    width: int
    height: int
    denoise_ms: float
    decode_ms: float


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
        """Run the pipeline, streaming each step through on_step, and encode the image; call inside session().

        `stack` is what is resident, for the message of a generation that stops being finite. Raises
        GenerationCancelledError at the first step boundary after is_cancelled() turns true, before the decode.
        """
        loaded = self._loaded
        started = time.perf_counter()
        last_step_at = started

        def step_end(pipe, index, timestep, callback_kwargs):
            nonlocal last_step_at
            loaded.threads.adjust()
            last_step_at = time.perf_counter()
            preview = b"", ""
            if params.wants_preview(index + 1):
                preview = loaded.previewer.encode(callback_kwargs["latents"], params)
            elapsed_ms = (last_step_at - started) * 1000.0
            on_step(StepProgress(index + 1, params.num_inference_steps, elapsed_ms, *preview))
            if is_cancelled():
                raise GenerationCancelledError("the caller cancelled; generation stopped at a step boundary")
            # One reduction per step: a non-finite latent would decode to a NaN image returned as OK.
            latents = callback_kwargs.get("latents")
            if latents is not None and not bool(torch.isfinite(latents).all()):
                raise _not_finite_error(stack, index + 1)
            return callback_kwargs

        loaded.threads.adjust()
        result = loaded.pipe(**self._pipeline_kwargs(params), callback_on_step_end=step_end)
        image = result.images[0]
        data = encode_image(image, params.image_format)
        finished = time.perf_counter()
        return PipelineRun(
            data=data,
            width=image.width,
            height=image.height,
            denoise_ms=(last_step_at - started) * 1000.0,
            decode_ms=(finished - last_step_at) * 1000.0,
        )

    def _pipeline_kwargs(self, params: GenerationParams) -> dict:
        defaults = self._loaded.defaults
        kwargs = dict(
            prompt=params.prompt, num_inference_steps=params.num_inference_steps,
            guidance_scale=params.guidance_scale, width=params.width, height=params.height, output_type="pil",
            # A CPU generator makes the initial noise, and so the image, the same on every device.
            generator=torch.Generator("cpu").manual_seed(params.seed),
        )  # fmt: skip
        kwargs.update(self._loaded.traits.pipeline_kwargs(params.negative_prompt, defaults))
        if defaults.max_sequence_length is not None:
            kwargs["max_sequence_length"] = defaults.max_sequence_length
        return kwargs


def encode_image(image, image_format: ImageFormat) -> bytes:
    """PIL image -> file bytes in the requested format."""
    buffer = io.BytesIO()
    if image_format is ImageFormat.JPEG:
        image.convert("RGB").save(buffer, format="JPEG", quality=JPEG_QUALITY)
    elif image_format is ImageFormat.WEBP:
        image.save(buffer, format="WEBP", lossless=True)
    else:
        image.save(buffer, format="PNG")
    return buffer.getvalue()


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
