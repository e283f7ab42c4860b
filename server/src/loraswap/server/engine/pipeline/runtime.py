"""The warm pipeline with its swap slot: run one job, and say what is resident.

Everything here runs on the engine's single worker thread, always under
`torch.inference_mode()`: compiled graphs are specialised on the grad mode, so
warming up and serving in the same mode keeps them valid. `start_runtime`
(startup.py) builds a DiffusionRuntime phase by phase; the records below are
what each phase makes.
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from loraswap.server.engine.adapters.canonical import SlotSpec
from loraswap.server.engine.adapters.fused import FusedWeights
from loraswap.server.engine.adapters.slot import HotswapSlot, StackMember
from loraswap.server.engine.compile_options import compile_mode_label
from loraswap.server.engine.config import EngineConfig
from loraswap.server.engine.errors import ErrorReason, GenerationCancelledError, InvalidRequestError
from loraswap.server.engine.families import FamilyTraits
from loraswap.server.engine.fuse_policy import FuseCosts, choose_fused
from loraswap.server.engine.pipeline.compile import CountingBackend, conv_backend
from loraswap.server.engine.pipeline.cpu_threads import CoreShare, FixedThreads
from loraswap.server.engine.pipeline.previews import LatentPreviewer
from loraswap.server.engine.request_rules import RequestRules
from loraswap.server.engine.types import (
    GeneratedImage,
    GenerationParams,
    ImageFormat,
    ModelDefaults,
    StepProgress,
    Timings,
)

JPEG_QUALITY = 95
# --fuse auto's choices remembered per request (adapters, strengths, steps, size); the oldest go past this.
MAX_REMEMBERED_CHOICES = 65536


@dataclass(frozen=True)
class LoadedModel:
    """The load phase's product: the pipeline on its device, its family's traits, and the rules for requests."""

    pipe: Any  # a diffusers pipeline of the family
    traits: FamilyTraits
    device: torch.device
    dtype: torch.dtype
    threads: CoreShare | FixedThreads  # --torch-threads, or the cores other processes leave free
    defaults: ModelDefaults
    request_rules: RequestRules
    previewer: LatentPreviewer

    @property
    def denoiser(self) -> torch.nn.Module:
        return self.traits.denoiser(self.pipe)


@dataclass(frozen=True)
class InstalledSlot:
    """The slot phase's product: the swap slot on the denoiser's target layers."""

    slot: HotswapSlot
    target_layers: tuple[str, ...]
    device_adapter_bytes: int  # device memory for the hot set of adapters (CUDA only; else 0)
    pristine_bytes: int = 0  # the pristine copies fused swaps merge from (--fuse auto|always; else 0)


@dataclass(frozen=True)
class StoredWeights:
    """The quantize phase's product: how the denoiser's base linear weights are stored, and their bytes."""

    quantization: str
    denoiser_weight_bytes: int


@dataclass(frozen=True)
class CompiledDenoiser:
    """The compile phase's product: the attention backend the graphs trace and how torch.compile covers them."""

    kind: str  # none, full or regional
    mode: str  # the mode compiled with (a CUDA-graph mode runs as its graph-free twin off CUDA)
    attention_backend: str
    backend: CountingBackend | None  # counts the graphs compiled; None when not compiled

    @property
    def compiled(self) -> bool:
        return self.kind != "none"

    @property
    def label(self) -> str:
        """How the denoiser is compiled, as GetServerInfo.compile_mode says it: `full/default`, `regional/...`, `none`."""
        return compile_mode_label(self.kind, self.mode)


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


class DiffusionRuntime:
    """The warm pipeline with its swap slot, made by start_runtime. Call only on the worker thread."""

    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel,
        installed: InstalledSlot,
        weights: StoredWeights,
        compiled: CompiledDenoiser,
    ) -> None:
        self.config = config
        self.pipe, self.traits, self.family = loaded.pipe, loaded.traits, loaded.traits.family
        self.device, self.dtype, self.threads = loaded.device, loaded.dtype, loaded.threads
        self.defaults, self.request_rules, self.previewer = loaded.defaults, loaded.request_rules, loaded.previewer
        self.denoiser = loaded.denoiser
        self.slot, self.target_layers = installed.slot, list(installed.target_layers)
        self.device_adapter_bytes = installed.device_adapter_bytes
        self.pristine_bytes = installed.pristine_bytes
        # --fuse auto's measured figures and the buckets a swap may compute at unfused: set by the warm-up.
        self.fuse_costs: FuseCosts | None = None
        self.unfused_buckets: frozenset[int] = frozenset(installed.slot.rank_buckets)
        self._fuse_choices: dict[tuple, bool] = {}  # auto's choice per request, kept (see fuse_choice)
        self.quantization, self.denoiser_weight_bytes = weights.quantization, weights.denoiser_weight_bytes
        self.compile_kind, self.compile_mode = compiled.kind, compiled.mode
        self.compiled, self.compile_label = compiled.compiled, compiled.label
        self.attention_backend = compiled.attention_backend
        self._backend = compiled.backend
        self._graphs_at_ready = 0

    # -- facts --------------------------------------------------------------------------------------

    @property
    def graphs_compiled(self) -> int:
        """Graphs compiled since start-up (0 when not compiled)."""
        return self._backend.graphs_compiled if self._backend is not None else 0

    def count_recompilations_from_now(self) -> None:
        """The warm-up is over: every graph compiled from here on is a recompilation."""
        self._graphs_at_ready = self.graphs_compiled

    @property
    def recompilations(self) -> int:
        """Graphs compiled since warm-up finished (0 when not compiled)."""
        return self.graphs_compiled - self._graphs_at_ready

    @property
    def pristine_weight_bytes(self) -> int:
        """Bytes of every slot layer's base weight: what a merge over all of them reads and writes (0: no fusing)."""
        fused = self.slot.fused_weights
        return fused.pristine.weight_bytes(fused.pristine.weights) if fused is not None else 0

    def fuse_choice(self, stack: tuple[StackMember, ...], params: GenerationParams, steps_after: int = 0) -> bool:
        """Whether `params` runs with `stack` fused (--fuse; see fuse_policy.py); `steps_after` are the queued
        requests' for the same stack, which run next without a swap.

        Fused and unfused images differ in their last bits, so under auto a request keeps the choice made the
        first time it was seen (by adapters, strengths, steps and size) for the server's life: the same request
        gives the same image bytes whatever ran before it, as under never and always.
        """
        if not stack or not self.config.fuses:
            return False
        key = self._choice_key(stack, params)
        chosen = self._fuse_choices.get(key)
        if chosen is None:
            chosen = self._choose_fused(stack, params.num_inference_steps + steps_after, params.width * params.height)
            if len(self._fuse_choices) >= MAX_REMEMBERED_CHOICES:
                self._fuse_choices.pop(next(iter(self._fuse_choices)))
            self._fuse_choices[key] = chosen
        return chosen

    @staticmethod
    def _choice_key(stack: tuple[StackMember, ...], params: GenerationParams) -> tuple:
        """What a request's fuse choice is remembered by: its adapters and strengths, steps and size."""
        return (tuple((adapter.name, scale) for adapter, scale in stack), params.num_inference_steps,
                params.width, params.height)  # fmt: skip

    def needs_swap(self, stack: tuple[StackMember, ...], fused: bool) -> bool:
        """Whether running `stack` (fused or not) changes what is resident: other adapters, or the same in the other
        way."""
        return not self.slot.holds(stack) or (bool(stack) and fused != self.slot.fused)

    def _choose_fused(self, stack: tuple[StackMember, ...], steps: int, pixels: int) -> bool:
        bucket = self.slot.unfused_bucket(stack)
        saving = merge_ms = None
        costs = self.fuse_costs
        if bucket is not None and bucket in self.unfused_buckets:
            saving = costs.saving_ms_per_step(bucket, pixels) if costs is not None else 0.0
        if costs is not None:
            summed = self.slot.summed_ranks(stack) or {}
            touched = self.slot.fused_weights.pristine.weight_bytes(FusedWeights.layers_of(stack))
            merge_ms = costs.merge_ms(touched, max(summed.values(), default=0))
        return choose_fused(
            self.config.fuse,
            fusing=self.config.fuses,
            has_adapters=bool(stack),
            slot_can_hold=bucket is not None,
            saving_ms_per_step=saving,
            steps=steps,
            merge_ms=merge_ms if merge_ms is not None else 0.0,
        )

    def slot_spec(self) -> SlotSpec:
        """What adapters must fit to be swapped into this runtime's slot."""
        return self.slot.spec(self.family, self.dtype, self.device, strict=self.config.strict_adapters)

    def describe(self) -> dict[str, object]:
        """The ServerDescription fields this runtime knows: the model as loaded, its slot, compile and storage."""
        rules = self.request_rules
        resident = self.slot.resident
        return dict(
            family=self.family,
            dtype=str(self.dtype).removeprefix("torch."),
            device=str(self.device),
            max_rank=self.slot.max_rank,
            target_layers=tuple(self.target_layers),
            compiled=self.compiled,
            compile_mode=self.compile_label,
            recompilations=self.recompilations,
            resident_adapter=resident.name if resident is not None else "",
            resident_adapters=tuple(adapter.name for adapter in self.slot.resident_adapters),
            size_multiple=rules.size_multiple,
            min_size=rules.min_size,
            max_size=rules.max_size,
            max_stack=rules.max_stack,
            default_width=rules.defaults.width,
            default_height=rules.defaults.height,
            default_num_inference_steps=rules.defaults.num_inference_steps,
            default_guidance_scale=rules.defaults.guidance_scale,
            rank_buckets=self.slot.rank_buckets,
            quantization=self.quantization,
            denoiser_weight_bytes=self.denoiser_weight_bytes,
            attention_backend=self.attention_backend,
            pinned_adapter_memory=self.slot_spec().pin_memory,
            device_adapter_bytes=self.device_adapter_bytes,
            fuse=self.config.fuse,
            fuse_pristine_bytes=self.pristine_bytes,
            torch_threads=self.threads.threads if isinstance(self.threads, FixedThreads) else 0,
        )

    # -- requests -----------------------------------------------------------------------------------

    def generate(
        self,
        params: GenerationParams,
        stack: tuple[StackMember, ...],
        *,
        on_step: Callable[[StepProgress], None],
        is_cancelled: Callable[[], bool],
        timings: Timings | None = None,
        warnings: tuple[str, ...] = (),
        on_swap: Callable[[float, bool], None] | None = None,
        fused: bool = False,
    ) -> GeneratedImage:
        """Swap `stack` in, run the pipeline streaming each step through on_step, encode the image.

        `stack` holds the adapters and their strengths (() for the base model); `params` come from
        `request_rules.resolve`; `fused` merges the stack into the base weights (fuse_choice says when). Raises GenerationCancelledError at the first step boundary after
        is_cancelled() turns true, before the VAE decode.
        """
        timings = timings or Timings()
        conv_guard = conv_backend(
            compiled=self.compiled, convolutional=self.traits.convolutional_denoiser, device=self.device,
            dtype=self.dtype,
        )  # fmt: skip
        with torch.inference_mode(), conv_guard:
            swaps = self.needs_swap(stack, fused)
            swap_ms, fused = self._swap_in(stack, params, fused, merges=fused and swaps)
            if swaps and on_swap is not None:
                on_swap(swap_ms, fused)
            started = time.perf_counter()
            last_step_at = started

            def step_end(pipe, index, timestep, callback_kwargs):
                nonlocal last_step_at
                self.threads.adjust()
                last_step_at = time.perf_counter()
                preview = b"", ""
                if params.wants_preview(index + 1):
                    preview = self.previewer.encode(callback_kwargs["latents"], params)
                elapsed_ms = (last_step_at - started) * 1000.0
                on_step(StepProgress(index + 1, params.num_inference_steps, elapsed_ms, *preview))
                if is_cancelled():
                    raise GenerationCancelledError("the caller cancelled; generation stopped at a step boundary")
                # One reduction per step: a non-finite latent would decode to a NaN image returned as OK.
                latents = callback_kwargs.get("latents")
                if latents is not None and not bool(torch.isfinite(latents).all()):
                    raise _not_finite_error(stack, index + 1)
                return callback_kwargs

            self.threads.adjust()
            result = self.pipe(**self._pipeline_kwargs(params), callback_on_step_end=step_end)
            image = result.images[0]
            data = encode_image(image, params.image_format)
        finished = time.perf_counter()
        return GeneratedImage(
            data=data,
            image_format=params.image_format,
            width=image.width,
            height=image.height,
            seed=params.seed,
            adapter=params.adapter,
            adapter_scale=params.adapter_scale,
            adapters=params.adapters,
            fused=self.slot.fused,
            timings=Timings(
                queue_ms=timings.queue_ms,
                adapter_load_ms=timings.adapter_load_ms,
                adapter_swap_ms=swap_ms,
                denoise_ms=(last_step_at - started) * 1000.0,
                decode_ms=(finished - last_step_at) * 1000.0,
            ),
            warnings=warnings,
        )

    def _swap_in(
        self, stack: tuple[StackMember, ...], params: GenerationParams, fused: bool, *, merges: bool
    ) -> tuple[float, bool]:
        """Make `stack` resident, fused or not (`merges`: this swap merges); returns (ms spent, whether it is fused).

        Under auto, fusing is only the cheaper way: a stack whose merge would overflow the model's dtype but
        fits the slot runs unfused instead (the request keeps that choice), as it would under never.
        """
        try:
            swap_ms = self.slot.load_stack(stack, fused=fused)
        except InvalidRequestError as refused:
            auto_may_unfuse = self.config.fuse == "auto" and self.slot.unfused_bucket(stack) is not None
            if not (merges and auto_may_unfuse and refused.reason == ErrorReason.ADAPTER_OUT_OF_RANGE):
                raise
            self._fuse_choices[self._choice_key(stack, params)] = False
            return self.slot.load_stack(stack, fused=False), False
        if merges and self.fuse_costs is not None:
            summed = self.slot.summed_ranks(stack) or {}
            touched = self.slot.fused_weights.pristine.weight_bytes(FusedWeights.layers_of(stack))
            self.fuse_costs.observe_merge(swap_ms, touched, max(summed.values(), default=0))
        return swap_ms, fused

    def _pipeline_kwargs(self, params: GenerationParams) -> dict:
        kwargs = dict(
            prompt=params.prompt,
            num_inference_steps=params.num_inference_steps,
            guidance_scale=params.guidance_scale,
            width=params.width,
            height=params.height,
            # A CPU generator makes the initial noise, and so the image, the same on every device.
            generator=torch.Generator("cpu").manual_seed(params.seed),
            output_type="pil",
        )
        kwargs.update(self.traits.pipeline_kwargs(params.negative_prompt, self.defaults))
        if self.defaults.max_sequence_length is not None:
            kwargs["max_sequence_length"] = self.defaults.max_sequence_length
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
