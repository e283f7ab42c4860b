"""What the host learns of each denoising step, read one step late so the step loop never waits for the device.

At the end of step i the step callback queues step i's checks on the device (whether its latents are finite; its
preview's pixels when it has one), copies their results to host memory without waiting, and records a mark. It
then waits for step i-1's mark only (the device is busy with step i meanwhile) and reads step i-1: its progress
event, its preview, and a refusal if its latents were not finite. So the host queues at most two steps ahead of
the device, a progress event still means its step has finished on the device, and a non-finite latent is refused
at most one step later than the step that made it. The last step is read in its own callback, before the VAE
decode. On the CPU the marks and copies are synchronous (device_timeline.py) and the same order holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from loraswap.server.engine.pipeline.device_timeline import DeviceMark, copy_to_host
from loraswap.server.engine.pipeline.previews import LatentPreviewer, encode_preview
from loraswap.server.engine.types import GenerationParams, StepProgress


@dataclass(frozen=True)
class _QueuedStep:
    """A step whose checks are queued on the device; its host tensors hold their values once `done` is passed."""

    step: int  # 1-based
    done: DeviceMark
    finite: torch.Tensor  # 0-dim bool on the host: every latent value of the step was finite
    preview: torch.Tensor | None  # uint8 (h, w, 3) on the host, when the step carries a preview


class OneStepBehind:
    """Reads the steps of one pipeline run one step late (see the module docstring). Worker thread only."""

    def __init__(
        self,
        params: GenerationParams,
        previewer: LatentPreviewer,
        started: DeviceMark,
        on_step: Callable[[StepProgress], None],
        not_finite: Callable[[int], Exception],
    ) -> None:
        """`started`: the run's first mark, which progress times count from; `not_finite(step)`: the error that
        refuses a generation whose latents stopped being finite at `step`."""
        self._params = params
        self._previewer = previewer
        self._started = started
        self._on_step = on_step
        self._not_finite = not_finite
        self._queued: _QueuedStep | None = None
        self.last_read: DeviceMark | None = None  # the mark of the last step read: the denoising's end after the last

    def step_ended(self, step: int, latents: torch.Tensor) -> None:
        """Step `step` (1-based) has been queued and left `latents`: queue its checks, then read the step before it
        (and this one too when it is the last)."""
        queued = self._queue(step, latents)
        previous, self._queued = self._queued, queued
        if previous is not None:
            self._read(previous)
        if step == self._params.num_inference_steps:
            self._queued = None
            self._read(queued)

    def _queue(self, step: int, latents: torch.Tensor) -> _QueuedStep:
        """Step `step`'s checks on the device, copied to the host without waiting, then its mark."""
        params = self._params
        finite = copy_to_host(torch.isfinite(latents).all())
        preview = None
        if params.wants_preview(step):
            preview = copy_to_host(self._previewer.device_pixels(latents, params.height, params.width))
        return _QueuedStep(step=step, done=DeviceMark(latents.device), finite=finite, preview=preview)

    def _read(self, queued: _QueuedStep) -> None:
        """Wait for the device to pass `queued`'s mark, send its progress, and refuse it if it was not finite."""
        queued.done.wait()
        self.last_read = queued.done
        preview = encode_preview(queued.preview) if queued.preview is not None else (b"", "")
        elapsed_ms = queued.done.ms_since(self._started)
        self._on_step(StepProgress(queued.step, self._params.num_inference_steps, elapsed_ms, *preview))
        # A host tensor whose copy the mark has seen through: reading it waits for nothing.
        if not bool(queued.finite):
            raise self._not_finite(queued.step)
