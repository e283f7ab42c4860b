"""The resident pipeline: load it, put the swap slot in place, compile, warm up, run one job.

Everything here runs on the engine's single worker thread (start-up included),
always under `torch.inference_mode()`: compiled graphs are specialised on the
grad mode, so warming up and serving in the same mode keeps them valid.
"""

from __future__ import annotations

import functools
import io
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from loraswap.server.engine.adapters.canonical import SlotSpec
from loraswap.server.engine.adapters.device_cache import DeviceAdapterCache
from loraswap.server.engine.adapters.slot import HotswapSlot, StackMember
from loraswap.server.engine.compile_options import (
    compile_mode_label,
    compile_options_problem,
    effective_compile_mode,
    resolve_compile_kind,
)
from loraswap.server.engine.config import EngineConfig
from loraswap.server.engine.errors import ErrorReason, GenerationCancelledError, InvalidRequestError
from loraswap.server.engine.families import family_of
from loraswap.server.engine.models import default_dtype, generation_defaults, latent_rgb, load_pipeline
from loraswap.server.engine.pipeline.attention import apply_attention, resolve_attention
from loraswap.server.engine.pipeline.compile import RECOMPILE_LIMIT, CountingBackend, compile_counting, conv_backend
from loraswap.server.engine.pipeline.compile_cache import compile_cache_scope, runtime_cache_key
from loraswap.server.engine.pipeline.cpu_threads import CoreShare, thread_policy
from loraswap.server.engine.pipeline.previews import LatentPreviewer
from loraswap.server.engine.pipeline.quantization import quantize_denoiser, weight_bytes
from loraswap.server.engine.pipeline.target_layers import resolve_target_layers
from loraswap.server.engine.pipeline.warm_up import warm_up_buckets, warm_up_requests
from loraswap.server.engine.rank_buckets import resolve_rank_buckets
from loraswap.server.engine.request_rules import RequestRules
from loraswap.server.engine.types import GeneratedImage, GenerationParams, ImageFormat, StepProgress, Timings

log = logging.getLogger(__name__)

JPEG_QUALITY = 95


def _resolve_device(config: EngineConfig) -> torch.device:
    if config.device:
        return torch.device(config.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _resolve_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    if config.dtype:
        dtype = getattr(torch, config.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown --dtype {config.dtype!r}; use float32, float16 or bfloat16")
        return dtype
    return getattr(torch, default_dtype(config.model, device.type))


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


def _phase_done(phase: str, since: float, detail: str) -> float:
    """Log that a start-up phase ended, with its duration; returns the time now (the next phase's start)."""
    now = time.perf_counter()
    seconds = now - since
    log.info("start-up %s: %.2f s, %s", phase, seconds, detail, extra={"phase": phase, "seconds": round(seconds, 3)})
    return now


class DiffusionRuntime:
    """The warm pipeline with its swap slot. Construct and call only on the worker thread."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = _resolve_device(config)
        self.dtype = _resolve_dtype(config, self.device)
        problem = compile_options_problem(config.compile, config.compile_mode, config.compile_backend)
        if problem is not None:
            raise ValueError(problem)
        self.compile_kind = resolve_compile_kind(config.compile, self.device.type)
        self.compile_mode = effective_compile_mode(config.compile_mode, self.device.type)
        if self.compile_mode != config.compile_mode:
            log.warning(
                "--compile-mode %s captures CUDA graphs, which %s has none of: compiling with mode %s",
                config.compile_mode, self.device, self.compile_mode,
            )  # fmt: skip
        self.compiled = self.compile_kind != "none"
        self._backend: CountingBackend | None = None
        self._graphs_at_ready = 0
        # --torch-threads, or (unset) the usable cores that other processes leave free, followed step by step.
        self.threads = thread_policy(config.torch_threads)
        if isinstance(self.threads, CoreShare) and self.device.type == "cpu":
            from torch._inductor import config as inductor_config

            # inductor's C++ kernels otherwise fix the thread count they were compiled with.
            inductor_config.cpp.dynamic_threads = True

        started = time.perf_counter()
        self.pipe = load_pipeline(config.model, self.dtype, config.layers)
        self.traits = family_of(self.pipe)
        self.family = self.traits.family
        self.defaults = generation_defaults(config.model, self.pipe)
        self.request_rules = RequestRules(
            defaults=self.defaults,
            size_multiple=self.traits.size_multiple(self.pipe),
            min_size=self.traits.min_size(self.pipe),
            max_size=config.max_size,
            max_stack=config.max_stack,
            ignored_negative_prompt=self.traits.ignored_negative_prompt(self.defaults),
        )
        self.pipe.set_progress_bar_config(disable=True)
        for component in self.pipe.components.values():
            if isinstance(component, torch.nn.Module):
                component.requires_grad_(False)
        self.pipe.to(self.device)
        self.previewer = LatentPreviewer(
            latent_rgb(config.model, self.pipe), self.pipe.vae.config.latent_channels, self.device,
            functools.partial(self.traits.spatial_latents, self.pipe),
        )  # fmt: skip
        loaded = f"{config.model} ({self.family.value}, {self.dtype} on {self.device})"
        phase_started = _phase_done("load", started, loaded)
        self.denoiser = self.traits.denoiser(self.pipe)
        patterns = config.target_modules or self.traits.default_target_modules
        self.target_layers = resolve_target_layers(self.denoiser, tuple(patterns))
        self.slot = HotswapSlot.install(
            self.denoiser, self.target_layers, config.max_rank, self.dtype, self.device,
            resolve_rank_buckets(config.rank_buckets, config.max_rank),
        )  # fmt: skip
        quantize_denoiser(self.denoiser, config.quantize)  # base linears only, after the slot, before compile
        self.denoiser_weight_bytes = weight_bytes(self.denoiser)
        # Before compiling: the backend is part of what the graphs are traced from.
        self.attention_backend = apply_attention(self.denoiser, resolve_attention(config.attention, self.device))
        # CUDA only: cached adapters are pinned (SlotSpec.pin_memory) and hot ones kept on the device.
        self.device_adapter_bytes = config.device_adapter_bytes if self.device.type == "cuda" else 0
        if self.device_adapter_bytes:
            self.slot.device_cache = DeviceAdapterCache(self.device_adapter_bytes, self.device)
        elif config.device_adapter_bytes:
            log.info("--device-adapter-bytes: adapters are copied from host memory on %s, no hot set", self.device)
        slot_detail = f"{len(self.target_layers)} layers at rank {config.max_rank}"
        phase_started = _phase_done("slot", phase_started, slot_detail)
        if self.compiled:
            # Each rank bucket (and the base model) is a graph of its own for every class of shapes.
            buckets_limit = RECOMPILE_LIMIT * len(self.slot.graph_buckets)
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, buckets_limit)
            self._backend = compile_counting(
                self.denoiser, config.compile_backend, kind=self.compile_kind, mode=self.compile_mode
            )
            # dynamo compiles lazily: the graphs themselves are built by the warm-up's first calls.
            phase_started = _phase_done("compile", phase_started, f"backend {config.compile_backend}")
        if config.warmup:
            with compile_cache_scope(self._compile_cache_folder()):
                self._warm_up()
        if self._backend is not None:
            self._graphs_at_ready = self._backend.graphs_compiled
        if config.warmup:
            _phase_done("warm-up", phase_started, f"{self._graphs_at_ready} graphs compiled")
        log.info(
            "ready: %s (%s, %s on %s), %d slot layers at rank %d, compiled=%s, in %.1f s",
            config.model, self.family.value, self.dtype, self.device, len(self.target_layers),
            config.max_rank, self.compiled, time.perf_counter() - started,
        )  # fmt: skip

    # -- start-up ---------------------------------------------------------------------------------

    def _compile_cache_folder(self) -> Path | None:
        """The --compile-cache subfolder for this runtime's graphs (see compile_cache.py); None when not caching."""
        if not self.compiled or self.config.compile_cache is None:
            return None
        key = runtime_cache_key(
            model=self.config.model, layers=self.config.layers, dtype=self.dtype, device=self.device,
            max_rank=self.config.max_rank, rank_buckets=tuple(self.slot.graph_buckets),
            target_layers=tuple(self.target_layers), quantize=self.config.quantize,
            compile_kind=self.compile_kind, compile_backend=self.config.compile_backend,
            compile_mode=self.compile_mode,
        )  # fmt: skip
        return key.folder(self.config.compile_cache)

    def _warm_up(self) -> None:
        """Run the pipeline at the shapes that make every later request reuse a compiled graph (see warm_up.py)."""
        requests = warm_up_requests(
            self.request_rules, self.traits.upsample_period(self.pipe), self.traits.warm_up_guidance(self.defaults)
        )
        for bucket in warm_up_buckets(self.slot.graph_buckets, self.compiled):
            with self.slot.computing_at(bucket):
                for request in requests:
                    self.generate(
                        self.request_rules.resolve(request), (), on_step=lambda progress: None,
                        is_cancelled=lambda: False,
                    )  # fmt: skip

    # -- facts --------------------------------------------------------------------------------------

    @property
    def compile_label(self) -> str:
        """How the denoiser is compiled, as GetServerInfo.compile_mode says it: `full/default`, `regional/...`, `none`."""
        return compile_mode_label(self.compile_kind, self.compile_mode)

    @property
    def recompilations(self) -> int:
        """Graphs compiled since warm-up finished (0 when not compiled)."""
        if self._backend is None:
            return 0
        return self._backend.graphs_compiled - self._graphs_at_ready

    def slot_spec(self) -> SlotSpec:
        """What adapters must fit to be swapped into this runtime's slot."""
        return self.slot.spec(self.family, self.dtype, self.device, strict=self.config.strict_adapters)

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
        on_swap: Callable[[float], None] | None = None,
    ) -> GeneratedImage:
        """Swap `stack` in, run the pipeline streaming each step through on_step, encode the image.

        `stack` holds the adapters and their strengths (() for the base model); `params` come from
        `request_rules.resolve`. Raises GenerationCancelledError at the first step boundary after
        is_cancelled() turns true, before the VAE decode.
        """
        timings = timings or Timings()
        conv_guard = conv_backend(
            compiled=self.compiled, convolutional=self.traits.convolutional_denoiser, device=self.device,
            dtype=self.dtype,
        )  # fmt: skip
        with torch.inference_mode(), conv_guard:
            swap_ms = self.slot.load_stack(stack)
            if on_swap is not None:
                on_swap(swap_ms)
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
            timings=Timings(
                queue_ms=timings.queue_ms,
                adapter_load_ms=timings.adapter_load_ms,
                adapter_swap_ms=swap_ms,
                denoise_ms=(last_step_at - started) * 1000.0,
                decode_ms=(finished - last_step_at) * 1000.0,
            ),
            warnings=warnings,
        )

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
