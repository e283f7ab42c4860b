"""What one denoising step's LoRA branch does, per rank, counted on the real pipeline (--fuse auto's cost model).

Each slot layer's LoRA branch costs rows * rank * (in + out) multiply-adds per call, where `rows` is what the step
feeds the layer (tokens times batch: the image's latent tokens at that layer's resolution, or the text's). Those
rows are counted, not guessed: the pipeline runs one step, eagerly (before anything is compiled), at the smallest
image and at twice its width, with a hook on every slot layer's base layer adding up what it is called with. The
rows that grow with the image give `macs_per_pixel`, the rest `fixed_macs` (both sizes fit rows = a * pixels + b
exactly for the families served: every row is an image token or a text token). Counting is deterministic: the same
model and flags give the same figures on any machine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch

from loraswap.server.engine.fuse_policy import LoraWork
from loraswap.server.engine.pipeline.records import CompiledDenoiser, LoadedModel
from loraswap.server.engine.pipeline.runner import PipelineRunner
from loraswap.server.engine.types import GenerationRequest

COUNT_PROMPT = "a counted step"


def work_at_guidance(loaded: LoadedModel, work: LoraWork, guidance: float) -> LoraWork:
    """`work` (counted at the default guidance) for a request at `guidance`: its rows scaled by the denoiser's batch
    there over the counted one's (SDXL's classifier-free guidance on or off)."""
    traits, pipe, defaults = loaded.traits, loaded.pipe, loaded.defaults
    return work.at_batch(
        traits.guidance_batch(pipe, defaults, guidance) / traits.guidance_batch(pipe, defaults, defaults.guidance_scale)
    )


# The guidance whose denoiser batch is the smallest (no classifier-free guidance): the cheapest unfused step.
SMALLEST_BATCH_GUIDANCE = 0.0


def count_lora_work(loaded: LoadedModel, base_layers: dict[str, torch.nn.Module]) -> LoraWork:
    """The LoRA branch's work per step and rank over `base_layers` (the slot layers' base linears)."""
    rules = loaded.request_rules
    small = rules.min_size
    wide = 2 * small if 2 * small <= rules.max_size else small
    calls, small_macs = _counted(loaded, base_layers, small, small)
    small_pixels, wide_pixels = small * small, wide * small
    if wide_pixels == small_pixels:  # a single allowed size: every row counted as the image's
        return LoraWork(calls=calls, macs_per_pixel=small_macs / small_pixels, fixed_macs=0.0)
    _, wide_macs = _counted(loaded, base_layers, wide, small)
    per_pixel = (wide_macs - small_macs) / (wide_pixels - small_pixels)
    return LoraWork(calls=calls, macs_per_pixel=per_pixel, fixed_macs=max(0.0, small_macs - per_pixel * small_pixels))


def _counted(loaded: LoadedModel, base_layers: dict[str, torch.nn.Module], width: int, height: int) -> tuple[int, int]:
    """(layer calls, rows * (in + out) summed) of one step at width x height."""
    counts = [0, 0]

    def count(module: torch.nn.Module, args: tuple) -> None:
        inputs = args[0]
        counts[0] += 1
        counts[1] += inputs.numel() // inputs.shape[-1] * (module.in_features + module.out_features)

    steps = loaded.request_rules.min_steps  # the fewest the scheduler takes; the counts are divided back to one
    params = loaded.request_rules.resolve(
        GenerationRequest(prompt=COUNT_PROMPT, seed=0, num_inference_steps=steps, width=width, height=height)
    )
    runner = PipelineRunner(loaded, CompiledDenoiser(kind="none", mode="default", attention_backend="", backend=None))
    with _hooked(base_layers.values(), count), runner.session():
        runner.run(params, on_step=lambda progress: None, is_cancelled=lambda: False)
    return counts[0] // steps, counts[1] // steps


@contextlib.contextmanager
def _hooked(modules: Iterable[torch.nn.Module], hook) -> Iterator[None]:
    """Forward pre-hooks on `modules` while inside (removed on the way out, before anything is compiled)."""
    handles = [module.register_forward_pre_hook(hook) for module in modules]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
