"""The resident pipeline: load it, put the swap slot in place, compile, warm up, run one job.

Everything here runs on the engine's single worker thread (start-up included),
always under `torch.inference_mode()`: compiled graphs are specialised on the
grad mode, so warming up and serving in the same mode keeps them valid.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from loraswap.engine.adapters.canonical import MAX_ADAPTER_SCALE, CanonicalAdapter, SlotSpec
from loraswap.engine.adapters.slot import HotswapSlot
from loraswap.engine.config import EngineConfig
from loraswap.engine.errors import GenerationCancelledError, InvalidRequestError
from loraswap.engine.types import (
    GeneratedImage,
    GenerationParams,
    GenerationRequest,
    ImageFormat,
    ModelFamily,
    StepProgress,
    Timings,
)

log = logging.getLogger(__name__)

# Layers an adapter may change, as module-name suffixes; the union of what the
# common trainers (diffusers' dreambooth scripts, kohya, ai-toolkit) target on
# linear layers.
DEFAULT_TARGET_MODULES = {
    ModelFamily.FLUX: (
        "to_q", "to_k", "to_v", "to_out.0",
        "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
        "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2",
        "proj_mlp", "proj_out",
    ),
    ModelFamily.SDXL: (
        "to_q", "to_k", "to_v", "to_out.0",
        "ff.net.0.proj", "ff.net.2", "proj_in", "proj_out",
    ),
}  # fmt: skip

MAX_STEPS = 200
RECOMPILE_LIMIT = 32
WARM_UP_GUIDANCE = 5.0  # the warm-up's guidance-on runs, when the model's default is off
MAX_GUIDANCE = 50.0
MAX_PROMPT_CHARS = 4000
JPEG_QUALITY = 95


@dataclass(frozen=True)
class ModelDefaults:
    """Generation settings that fit a model when a request leaves them unset."""

    width: int
    height: int
    num_inference_steps: int
    guidance_scale: float
    max_sequence_length: int | None = None
    # Flux: > 1 runs true classifier-free guidance against the negative prompt ("" when unset).
    true_cfg_scale: float = 1.0


def _defaults_for(model: str, pipe) -> ModelDefaults:
    """The built-in's defaults, a model folder's loraswap_generation.json, or the family's published ones."""
    from loraswap.engine.models import BUILTIN_MODELS, GENERATION_DEFAULTS_FILE, builtin_defaults
    from loraswap.engine.models.random_full import RANDOM_FULL_MODELS, random_full_defaults

    if model in BUILTIN_MODELS:
        values = builtin_defaults(model)
    elif model in RANDOM_FULL_MODELS:
        values = random_full_defaults(model)
    elif (Path(model) / GENERATION_DEFAULTS_FILE).is_file():
        values = json.loads((Path(model) / GENERATION_DEFAULTS_FILE).read_text())
    elif hasattr(pipe, "transformer"):
        if getattr(pipe.transformer.config, "guidance_embeds", False):
            return ModelDefaults(1024, 1024, 28, 3.5, 512)  # Flux.1 [dev]
        return ModelDefaults(1024, 1024, 4, 0.0, 256)  # Flux.1 [schnell]
    else:
        return ModelDefaults(1024, 1024, 30, 5.0)  # SDXL base
    return ModelDefaults(
        width=values["width"],
        height=values["height"],
        num_inference_steps=values["num_inference_steps"],
        guidance_scale=values["guidance_scale"],
        max_sequence_length=values.get("max_sequence_length"),
        true_cfg_scale=values.get("true_cfg_scale", 1.0),
    )


def _resolve_device(config: EngineConfig) -> torch.device:
    if config.device:
        return torch.device(config.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _resolve_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    from loraswap.engine.models.random_full import RANDOM_FULL_MODELS

    if config.dtype:
        dtype = getattr(torch, config.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown --dtype {config.dtype!r}; use float32, float16 or bfloat16")
        return dtype
    # Full-size random models only fit this machine's memory in bf16, and they exist to measure bf16 serving.
    if device.type == "cuda" or config.model in RANDOM_FULL_MODELS:
        return torch.bfloat16
    return torch.float32


def load_pipeline(model: str, dtype: torch.dtype, layers: int | None = None):
    """A built-in model by name (tiny, trained or full-size random), or a diffusers folder / Hub id."""
    from diffusers import DiffusionPipeline

    from loraswap.engine.models import BUILTIN_MODELS, build_builtin_pipeline
    from loraswap.engine.models.random_full import RANDOM_FULL_MODELS, build_random_pipeline

    if model in RANDOM_FULL_MODELS:
        return build_random_pipeline(model, torch_dtype=dtype, layers=layers)
    if layers is not None:
        raise ValueError(f"--layers applies to random-flux only, not to {model!r}")
    if model in BUILTIN_MODELS:
        return build_builtin_pipeline(model, torch_dtype=dtype)
    return DiffusionPipeline.from_pretrained(model, torch_dtype=dtype)


def family_of(pipe) -> ModelFamily:
    """Flux or SDXL, from the pipeline's classes."""
    from diffusers import FluxPipeline, StableDiffusionXLPipeline

    if isinstance(pipe, FluxPipeline):
        return ModelFamily.FLUX
    if isinstance(pipe, StableDiffusionXLPipeline):
        return ModelFamily.SDXL
    raise ValueError(f"{type(pipe).__name__} is not supported; loraswap serves FluxPipeline and StableDiffusionXLPipeline")


def resolve_target_layers(denoiser: torch.nn.Module, patterns: tuple[str, ...]) -> list[str]:
    """Names of the Linear layers whose name is, or ends with '.' + , one of the patterns."""
    names = [
        name
        for name, module in denoiser.named_modules()
        if isinstance(module, torch.nn.Linear)
        and any(name == pattern or name.endswith("." + pattern) for pattern in patterns)
    ]
    if not names:
        raise ValueError(f"--target-modules {', '.join(patterns)} match no linear layer of the model")
    return names


class _CountingBackend:
    """A torch.compile backend that counts the graphs it compiles, then defers to the real one."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.graphs_compiled = 0

    def __call__(self, graph_module, example_inputs):
        import torch._dynamo

        self.graphs_compiled += 1
        return torch._dynamo.lookup_backend(self.name)(graph_module, example_inputs)


class _OneDnnOff:
    """torch.backends.mkldnn.enabled = False while any runtime is inside; restored when the last one leaves.

    The flag is process-wide, so runtimes on different worker threads share one count
    instead of each saving and restoring it (which could leave it off for good).
    """

    _lock = threading.Lock()
    _inside = 0
    _previous = True

    def __enter__(self) -> None:
        with self._lock:
            if _OneDnnOff._inside == 0:
                _OneDnnOff._previous = torch.backends.mkldnn.enabled
                torch.backends.mkldnn.enabled = False
            _OneDnnOff._inside += 1

    def __exit__(self, *exc_info) -> None:
        with self._lock:
            _OneDnnOff._inside -= 1
            if _OneDnnOff._inside == 0:
                torch.backends.mkldnn.enabled = _OneDnnOff._previous


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


def warm_up_sizes(
    default: tuple[int, int], multiple: int, min_size: int, max_size: int, upsample_period: int | None
) -> list[tuple[int, int]]:
    """The (width, height) sizes, besides the default, that a warm-up runs so no allowed size compiles later.

    Each size differs from the default in both sides, and its width from its height, so dynamo
    marks both sides dynamic without tying them together. `upsample_period` (SDXL only: the VAE
    factor times 2**num_upsamplers, in pixels) splits sizes into three graph classes, because
    diffusers' UNet passes explicit upsample sizes when the latent's height or width is not a
    multiple of 2**num_upsamplers (`if dim % default_overall_up_factor != 0`, checking height
    first, then `break`): height not divisible; height divisible but width not; both divisible.
    One size per class that an allowed size can fall in.
    """

    def side_near(default_side: int, divisible: bool, upward: bool, avoid: int | None = None) -> int | None:
        for step in range(1, max_size // multiple + 1):
            offsets = (step, -step) if upward else (-step, step)
            for side in (default_side + offset * multiple for offset in offsets):
                in_class = upsample_period is None or (side % upsample_period == 0) == divisible
                if min_size <= side <= max_size and in_class and side != avoid:
                    return side
        return None

    classes = [(True, True)]
    if upsample_period is not None and multiple % upsample_period != 0:
        classes = [(False, True), (True, False), (True, True)]  # (height divisible, width divisible)
    sizes = []
    for height_divisible, width_divisible in classes:
        width = side_near(default[0], width_divisible, upward=True)
        height = side_near(default[1], height_divisible, upward=False, avoid=width)
        if width is not None and height is not None:
            sizes.append((width, height))
    return sizes


class DiffusionRuntime:
    """The warm pipeline with its swap slot. Construct and call only on the worker thread."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = _resolve_device(config)
        self.dtype = _resolve_dtype(config, self.device)
        self.compiled = config.compile if config.compile is not None else self.device.type == "cuda"
        self._backend: _CountingBackend | None = None
        self._graphs_at_ready = 0
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        elif hasattr(os, "sched_getaffinity"):
            torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))

        started = time.perf_counter()
        self.pipe = load_pipeline(config.model, self.dtype, config.layers)
        self.family = family_of(self.pipe)
        self.defaults = _defaults_for(config.model, self.pipe)
        self.pipe.set_progress_bar_config(disable=True)
        for component in self.pipe.components.values():
            if isinstance(component, torch.nn.Module):
                component.requires_grad_(False)
        self.pipe.to(self.device)
        self.denoiser = self.pipe.transformer if self.family is ModelFamily.FLUX else self.pipe.unet
        patterns = config.target_modules or DEFAULT_TARGET_MODULES[self.family]
        self.target_layers = resolve_target_layers(self.denoiser, tuple(patterns))
        self.slot = HotswapSlot.install(self.denoiser, self.target_layers, config.max_rank, self.dtype, self.device)
        if self.compiled:
            self._backend = _CountingBackend(config.compile_backend)
            # Past this many graphs per frame dynamo silently runs the model uncompiled (and nothing
            # would count it); SDXL's warm-up alone makes 7, so leave room.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
            self.denoiser.compile(backend=self._backend)
        if config.warmup:
            self._warm_up()
        if self._backend is not None:
            self._graphs_at_ready = self._backend.graphs_compiled
        log.info(
            "ready: %s (%s, %s on %s), %d slot layers at rank %d, compiled=%s, in %.1f s",
            config.model, self.family.value, self.dtype, self.device, len(self.target_layers),
            config.max_rank, self.compiled, time.perf_counter() - started,
        )  # fmt: skip

    # -- start-up ---------------------------------------------------------------------------------

    def _warm_up(self) -> None:
        """Run the pipeline at the shapes that make every later request reuse a compiled graph.

        dynamo compiles the first call for its exact shapes; a call with other shapes marks the
        changed dimensions dynamic. Past that, guards split requests into classes that each need
        a graph (see `warm_up_sizes`); and SDXL runs classifier-free guidance as batch 2 and
        guidance <= 1 as batch 1, a size-1 dimension torch specialises, so on SDXL each size
        runs with guidance on and off.
        """
        period = None
        if self.family is ModelFamily.SDXL:
            period = self.pipe.vae_scale_factor * 2**self.denoiser.num_upsamplers
        sizes = warm_up_sizes(
            (self.defaults.width, self.defaults.height), self.size_multiple, self.min_size, self.config.max_size, period
        )
        guidance_on = self.defaults.guidance_scale if self.defaults.guidance_scale > 1.0 else WARM_UP_GUIDANCE
        requests = [GenerationRequest(prompt="warm-up", seed=0, num_inference_steps=2)]
        for width, height in sizes:
            if self.family is ModelFamily.SDXL:
                requests += [
                    GenerationRequest(
                        prompt="warm-up", seed=0, num_inference_steps=2, width=width, height=height,
                        guidance_scale=guidance,
                    )
                    for guidance in (guidance_on, 1.0)
                ]  # fmt: skip
            else:
                requests.append(
                    GenerationRequest(prompt="warm-up", seed=0, num_inference_steps=2, width=width, height=height)
                )
        for request in requests:
            self.generate(self.resolve(request), None, on_step=lambda progress: None, is_cancelled=lambda: False)

    # -- facts --------------------------------------------------------------------------------------

    @property
    def size_multiple(self) -> int:
        if self.family is ModelFamily.FLUX:
            return self.pipe.vae_scale_factor * 2
        return 8

    @property
    def min_size(self) -> int:
        """Smallest width or height accepted.

        Below it some dimension inside the denoiser is 1, which torch specialises, so each
        such request would compile its own graph. SDXL: every UNet level at least 2 latent
        pixels wide. Flux: more than one packed token (a one-multiple square is one token).
        """
        multiple = self.size_multiple
        if self.family is ModelFamily.SDXL:
            latent = 2**self.denoiser.num_upsamplers + 1
            return -(-latent * self.pipe.vae_scale_factor // multiple) * multiple
        return 2 * multiple

    @property
    def uses_true_cfg(self) -> bool:
        """Whether this Flux model runs true classifier-free guidance (and so reads negative prompts)."""
        return self.family is ModelFamily.FLUX and self.defaults.true_cfg_scale > 1.0

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

    def resolve(self, request: GenerationRequest) -> GenerationParams:
        """Validate a request against this model and fill in its defaults."""
        if not request.prompt.strip():
            raise InvalidRequestError("prompt is empty; describe the image to generate", field="prompt")
        if len(request.prompt) > MAX_PROMPT_CHARS or len(request.negative_prompt) > MAX_PROMPT_CHARS:
            raise InvalidRequestError(f"prompts are limited to {MAX_PROMPT_CHARS} characters", field="prompt")
        steps = self.defaults.num_inference_steps if request.num_inference_steps is None else request.num_inference_steps
        if not 1 <= steps <= MAX_STEPS:
            raise InvalidRequestError(
                f"num_inference_steps is {steps}; use 1 to {MAX_STEPS}, or leave it unset for the model's "
                f"default ({self.defaults.num_inference_steps})",
                field="num_inference_steps",
            )
        guidance = self.defaults.guidance_scale if request.guidance_scale is None else request.guidance_scale
        if not 0.0 <= guidance <= MAX_GUIDANCE:
            raise InvalidRequestError(
                f"guidance_scale is {guidance}; use 0 to {MAX_GUIDANCE}", field="guidance_scale"
            )
        scale = 1.0 if request.adapter_scale is None else float(request.adapter_scale)
        if not -MAX_ADAPTER_SCALE <= scale <= MAX_ADAPTER_SCALE:
            raise InvalidRequestError(
                f"adapter_scale is {scale}; use -{MAX_ADAPTER_SCALE} to {MAX_ADAPTER_SCALE}", field="adapter_scale"
            )
        width = self._check_size("width", request.width, self.defaults.width)
        height = self._check_size("height", request.height, self.defaults.height)
        seed = secrets.randbits(63) if request.seed is None else request.seed
        if not 0 <= seed < 2**64:
            raise InvalidRequestError("seed must lie in [0, 2^64)", field="seed")
        return GenerationParams(
            prompt=request.prompt,
            negative_prompt=request.negative_prompt,
            adapter=request.adapter,
            adapter_scale=scale if request.adapter else 1.0,
            num_inference_steps=steps,
            guidance_scale=guidance,
            width=width,
            height=height,
            seed=seed,
            image_format=request.image_format,
        )

    def _check_size(self, field: str, value: int | None, default: int) -> int:
        if value is None:
            return default
        multiple, smallest = self.size_multiple, self.min_size
        if not smallest <= value <= self.config.max_size or value % multiple:
            nearest = min(max(smallest, round(value / multiple) * multiple), self.config.max_size)
            raise InvalidRequestError(
                f"{field} is {value}; it must be a multiple of {multiple} between {smallest} and "
                f"{self.config.max_size} for this model (nearest valid: {nearest})",
                field=field,
                multiple=multiple,
            )
        return value

    def generate(
        self,
        params: GenerationParams,
        adapter: CanonicalAdapter | None,
        *,
        on_step: Callable[[StepProgress], None],
        is_cancelled: Callable[[], bool],
        timings: Timings | None = None,
        warnings: tuple[str, ...] = (),
    ) -> GeneratedImage:
        """Swap `adapter` in, run the pipeline streaming each step through on_step, encode the image.

        Raises GenerationCancelledError at the first step boundary after is_cancelled() turns true,
        before the VAE decode.
        """
        timings = timings or Timings()
        with torch.inference_mode(), self._conv_backend():
            swap_ms = self.slot.load(adapter, params.adapter_scale)
            started = time.perf_counter()
            last_step_at = started

            def step_end(pipe, index, timestep, callback_kwargs):
                nonlocal last_step_at
                last_step_at = time.perf_counter()
                on_step(StepProgress(index + 1, params.num_inference_steps, (last_step_at - started) * 1000.0))
                if is_cancelled():
                    raise GenerationCancelledError("the caller cancelled; generation stopped at a step boundary")
                return callback_kwargs

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
            timings=Timings(
                queue_ms=timings.queue_ms,
                adapter_load_ms=timings.adapter_load_ms,
                adapter_swap_ms=swap_ms,
                denoise_ms=(last_step_at - started) * 1000.0,
                decode_ms=(finished - last_step_at) * 1000.0,
            ),
            warnings=warnings,
        )

    def _conv_backend(self):
        """oneDNN off for a compiled float32 SDXL UNet on CPU; otherwise nothing.

        For a float32 CPU convolution at batch 1, torch picks oneDNN or its native kernel by
        `input.numel() > 20480` (aten use_mkldnn, asked by the fake-tensor conv in
        torch/_subclasses/fake_impls.py via torch._C._select_conv_backend), so each conv
        guards its C*H*W against 20480 and guidance-off requests at a new side of any such
        threshold compile again. With oneDNN off the question is never asked. (It also covers the
        VAE and text encoders, which run a little slower without oneDNN: a test-sized set-up only,
        since served models run in bfloat16 or float16.)
        """
        on_cpu_in_float32 = self.device.type == "cpu" and self.dtype == torch.float32
        if self.compiled and self.family is ModelFamily.SDXL and on_cpu_in_float32:
            return _OneDnnOff()
        return contextlib.nullcontext()

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
        if self.family is ModelFamily.SDXL:
            kwargs["negative_prompt"] = params.negative_prompt or None
        elif self.uses_true_cfg:
            kwargs["true_cfg_scale"] = self.defaults.true_cfg_scale
            kwargs["negative_prompt"] = params.negative_prompt
        if self.defaults.max_sequence_length is not None:
            kwargs["max_sequence_length"] = self.defaults.max_sequence_length
        return kwargs
