"""Start-up of the resident pipeline, in the order its log tells it: load, slot, quantize, compile, warm-up.

Each phase is a function of the config and of what the phases before it made, and returns a
record of its own (runtime.py); `start_runtime` runs them in order, logs each phase with its
duration, and hands the records to DiffusionRuntime. Everything here runs on the engine's
worker thread.

A stop may come at any moment (SIGTERM while warming up). The start-up cannot be interrupted inside
torch, so it checks a `StartupStop` at its stopping points instead: before each phase, before each
warm-up pass and at each warm-up step, like a request's cancel flag.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from loraswap.server.engine.adapters.formats import ModelLayers
from loraswap.server.engine.adapters.residency import (
    AdapterResidency,
    DeviceAdapterCache,
    FusedWeights,
    HotswapSlot,
    PristineWeights,
)
from loraswap.server.engine.compile_options import effective_compile_mode, resolve_compile_kind
from loraswap.server.engine.config import EngineConfig
from loraswap.server.engine.errors import GenerationCancelledError, StartupError, StartupStopped
from loraswap.server.engine.families import family_of
from loraswap.server.engine.fuse_policy import (
    buckets_auto_may_choose,
    device_costs,
    merge_ms,
    unfused_ms,
    warm_up_graphs,
)
from loraswap.server.engine.models import default_dtype, generation_defaults, latent_rgb, load_pipeline
from loraswap.server.engine.pipeline.attention import choose_attention
from loraswap.server.engine.pipeline.compile import RECOMPILE_LIMIT, compile_counting
from loraswap.server.engine.pipeline.compile_cache import compile_cache_scope, runtime_cache_key
from loraswap.server.engine.pipeline.cpu_threads import CoreShare, thread_policy
from loraswap.server.engine.pipeline.lora_work import SMALLEST_BATCH_GUIDANCE, count_lora_work, work_at_guidance
from loraswap.server.engine.pipeline.preflight import preflight
from loraswap.server.engine.pipeline.previews import LatentPreviewer
from loraswap.server.engine.pipeline.quantization import quantize_denoiser, weight_bytes
from loraswap.server.engine.pipeline.records import (
    CompiledDenoiser,
    InstalledSlot,
    LoadedModel,
    StoredWeights,
    WarmedUp,
)
from loraswap.server.engine.pipeline.runner import PipelineRunner
from loraswap.server.engine.pipeline.runtime import DiffusionRuntime
from loraswap.server.engine.pipeline.target_layers import resolve_target_layers
from loraswap.server.engine.pipeline.warm_up_shapes import warm_up_buckets, warm_up_requests
from loraswap.server.engine.rank_buckets import resolve_rank_buckets
from loraswap.server.engine.request_rules import RequestRules
from loraswap.server.engine.types import GenerationParams, GenerationRequest

log = logging.getLogger(__name__)

# The share of a CUDA device's memory (1/N) the pristine copies leave free by default: activations, the allocator.
CUDA_MEMORY_RESERVE = 10


class StartupStop:
    """A stop request the start-up checks at its stopping points; it remembers the phase it came in.

    Set from the event loop, read on the worker thread: each field is one assignment, which needs no lock.
    """

    def __init__(self) -> None:
        self.phase = "load"
        self.requested_in: str | None = None

    def request(self) -> None:
        """Ask the start-up to stop at its next stopping point (a second request changes nothing)."""
        if self.requested_in is None:
            self.requested_in = self.phase

    @property
    def requested(self) -> bool:
        return self.requested_in is not None

    def check(self) -> None:
        """Raise StartupStopped if a stop was requested."""
        if self.requested_in is not None:
            raise StartupStopped(self.requested_in)

    def enter(self, phase: str) -> None:
        """A stopping point: stop here if asked to, else go on into `phase`."""
        self.check()
        self.phase = phase


def start_runtime(config: EngineConfig, stop: StartupStop | None = None) -> DiffusionRuntime:
    """The resident pipeline, loaded, slotted, quantized, compiled and warm; each phase logged with its duration.

    Raises:
        SettingsError: the pre-flight found a setting this process cannot serve (one line).
        StartupStopped: `stop` was requested; raised at the next phase, warm-up pass or warm-up step.
    """
    preflight(config)  # what this process cannot serve is refused before anything loads
    stop = stop or StartupStop()
    clock = _PhaseClock()
    stop.enter("load")
    clock.begin("load", config.model)
    loaded = load(config)
    clock.done("load", f"{config.model} ({loaded.traits.family.value}, {loaded.dtype} on {loaded.device})")
    stop.enter("slot")
    clock.begin("slot", f"rank {config.max_rank}, --fuse {config.fuse}{', pristine copies' if config.fuses else ''}")
    installed = install_slot(config, loaded)
    pristine = f", pristine copies {installed.pristine_bytes} bytes" if installed.pristine_bytes else ""
    clock.done("slot", f"{len(installed.target_layers)} layers at rank {config.max_rank}{pristine}")
    if installed.lora_work is not None:
        _log_auto_rule(loaded, installed)
    # A stop names the phase the log names next: unquantized, what follows the slot is the compile.
    stop.enter("quantize" if config.quantize != "none" else "compile")
    if config.quantize != "none":
        clock.begin("quantize", f"{config.quantize}, the denoiser's base linear layers on {loaded.device}")
    weights = quantize(config, loaded)
    if weights.quantization != "none":
        clock.done("quantize", f"{weights.quantization}, denoiser weights {weights.denoiser_weight_bytes} bytes")
    stop.enter("compile")
    compiling = resolve_compile_kind(config.compile, loaded.device.type)
    if compiling != "none":
        clock.begin("compile", f"{compiling}, backend {config.compile_backend}, the attention backend first")
    compiled = compile_denoiser(config, loaded, installed)
    if compiled.compiled:
        # dynamo compiles lazily: the graphs themselves are built by the warm-up's first calls.
        clock.done("compile", f"backend {config.compile_backend}")
    stop.enter("warm-up")
    if config.warmup:
        clock.begin("warm-up", "each pass's first call compiles" if compiled.compiled else "uncompiled")
    warmed = warm_up(config, loaded, installed, compiled, stop)
    if config.warmup:
        clock.done("warm-up", f"{warmed.graphs_at_ready} graphs compiled")
    stop.check()
    runtime = DiffusionRuntime(config, loaded, installed, weights, compiled, warmed)
    log.info(
        "ready: %s (%s, %s on %s), %d slot layers at rank %d, compiled=%s, in %.1f s",
        config.model, loaded.traits.family.value, loaded.dtype, loaded.device, len(installed.target_layers),
        config.max_rank, compiled.compiled, clock.total_seconds,
    )  # fmt: skip
    return runtime


# -- the phases ---------------------------------------------------------------------------------------


def load(config: EngineConfig) -> LoadedModel:
    """Build the pipeline, put it on its device, and derive the request rules and previews from its family."""
    device = _device(config)
    dtype = _dtype(config, device)
    threads = thread_policy(config.torch_threads)
    if isinstance(threads, CoreShare) and device.type == "cpu":
        from torch._inductor import config as inductor_config

        # inductor's C++ kernels otherwise fix the thread count they were compiled with.
        inductor_config.cpp.dynamic_threads = True
    pipe = load_pipeline(config.model, dtype, config.layers)
    traits = family_of(pipe)
    defaults = generation_defaults(config.model, pipe)
    pipe.set_progress_bar_config(disable=True)
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.requires_grad_(False)
    pipe.to(device)
    return LoadedModel(
        pipe=pipe, traits=traits, device=device, dtype=dtype, threads=threads, defaults=defaults,
        request_rules=RequestRules(
            defaults=defaults,
            size_multiple=traits.size_multiple(pipe),
            min_size=traits.min_size(pipe),
            max_size=config.max_size,
            max_stack=config.max_stack,
            ignored_negative_prompt=traits.ignored_negative_prompt(defaults),
        ),
        previewer=LatentPreviewer(
            latent_rgb(config.model, pipe),
            pipe.vae.config.latent_channels,
            device,
            functools.partial(traits.spatial_latents, pipe),
        ),
    )  # fmt: skip


def install_slot(config: EngineConfig, loaded: LoadedModel) -> InstalledSlot:
    """The swap slot on the target layers at max rank, the writers that merge into base weights from pristine
    copies (the denoiser's when fusing, the text encoders' when their layers are applied) and (CUDA) the device
    hot set of adapters."""
    denoiser = loaded.denoiser
    # Every mergeable layer, read before the slot wraps any: adapter files resolve against these paths.
    model_layers = ModelLayers.of({
        loaded.traits.denoiser_attribute: denoiser,
        **{name: getattr(loaded.pipe, name) for name in loaded.traits.text_encoders
           if isinstance(getattr(loaded.pipe, name, None), torch.nn.Module)},
    })  # fmt: skip
    patterns = config.target_modules or loaded.traits.default_target_modules
    target_layers = resolve_target_layers(denoiser, tuple(patterns))
    slot = HotswapSlot.install(
        denoiser, target_layers, config.max_rank, loaded.dtype, loaded.device,
        resolve_rank_buckets(config.rank_buckets, config.max_rank),
    )  # fmt: skip
    pristine = _keep_pristine_weights(config, loaded, model_layers, target_layers)
    component = loaded.traits.denoiser_attribute
    fused_weights = FusedWeights(pristine, frozenset({component}), component) if config.fuses else None
    encoders = frozenset(model_layers.components) - {component}
    encoder_weights = (
        FusedWeights(pristine, encoders, component) if config.text_encoder_layers == "apply" and encoders else None
    )
    # CUDA only: cached adapters are pinned (SlotSpec.pin_memory) and hot ones kept on the device.
    device_adapter_bytes = config.device_adapter_bytes if loaded.device.type == "cuda" else 0
    device_cache = DeviceAdapterCache(device_adapter_bytes, loaded.device) if device_adapter_bytes else None
    if config.device_adapter_bytes and device_cache is None:
        log.info("--device-adapter-bytes: adapters are copied from host memory on %s, no hot set", loaded.device)
    # --fuse auto weighs the LoRA branch's work per step, counted on the pipeline before anything is compiled.
    lora_work = count_lora_work(loaded, slot.base_layers()) if config.fuses and config.fuse == "auto" else None
    return InstalledSlot(
        residency=AdapterResidency(slot, fused_weights, device_cache, encoder_weights),
        model_layers=model_layers,
        target_layers=tuple(target_layers),
        device_adapter_bytes=device_adapter_bytes,
        pristine_bytes=pristine.nbytes,
        lora_work=lora_work,
    )


def _keep_pristine_weights(
    config: EngineConfig, loaded: LoadedModel, model_layers: ModelLayers, target_layers: list[str]
) -> PristineWeights:
    """The pristine copies merges start from (adapters/residency/fused.py): the slot layers' base weights now when fusing,
    any other layer's at the first merge that changes it, all within one budget.

    Raises:
        StartupError: the slot layers' copies do not fit in --fuse-memory-bytes (or, unset, in what the device has
            free).
    """
    budget = config.fuse_memory_bytes if config.fuse_memory_bytes is not None else _free_bytes(loaded.device)
    if not config.fuses:
        return PristineWeights(model_layers, budget_bytes=budget)
    slot_keys = [(loaded.traits.denoiser_attribute, name) for name in target_layers]
    pristine = PristineWeights(model_layers, budget_bytes=budget)
    needed = pristine.bytes_needed(slot_keys)
    if budget is not None and needed > budget:
        source = "--fuse-memory-bytes" if config.fuse_memory_bytes is not None else f"what {loaded.device} has free"
        raise StartupError(
            f"--fuse {config.fuse} keeps a pristine copy of the {len(slot_keys)} slot layers' base weights, "
            f"{needed} bytes, more than {source} ({budget} bytes); raise --fuse-memory-bytes, cover fewer layers "
            "with --target-modules, or use --fuse never"
        )
    pristine.cover(slot_keys)
    return pristine


def _free_bytes(device: torch.device) -> int | None:
    """What the pristine copies may take when --fuse-memory-bytes is unset: on CUDA the device's free memory less a
    tenth of its total (room for activations and the allocator); on a CPU the memory the host has available (which
    other processes change all the time, so it takes no reserve of its own); None when it cannot be told."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return max(0, free - total // CUDA_MEMORY_RESERVE)
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def quantize(config: EngineConfig, loaded: LoadedModel) -> StoredWeights:
    """Store the denoiser's base linear weights as --quantize says: after the slot is in, before any compile."""
    quantize_denoiser(loaded.denoiser, config.quantize)
    return StoredWeights(quantization=config.quantize, denoiser_weight_bytes=weight_bytes(loaded.denoiser))


def compile_denoiser(config: EngineConfig, loaded: LoadedModel, installed: InstalledSlot) -> CompiledDenoiser:
    """Set the attention backend (the graphs are traced from it), then torch.compile the denoiser as --compile says."""
    started = time.perf_counter()
    attention_backend = choose_attention(config.attention, loaded)  # measured on Hopper when unset
    kind = resolve_compile_kind(config.compile, loaded.device.type)
    if kind != "none":
        _log_step("compile", started, f"attention {attention_backend}; wrapping the denoiser in torch.compile")
    mode = effective_compile_mode(config.compile_mode, loaded.device.type)
    if mode != config.compile_mode:
        log.warning(
            "--compile-mode %s captures CUDA graphs, which %s has none of: compiling with mode %s",
            config.compile_mode, loaded.device, mode,
        )  # fmt: skip
    backend = None
    if kind != "none":
        # Each rank bucket (and the base model) is a graph of its own for every class of shapes.
        buckets_limit = RECOMPILE_LIMIT * len(installed.residency.slot.graph_buckets)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, buckets_limit)
        backend = compile_counting(loaded.denoiser, config.compile_backend, kind=kind, mode=mode)
    return CompiledDenoiser(kind=kind, mode=mode, attention_backend=attention_backend, backend=backend)


def warm_up(
    config: EngineConfig,
    loaded: LoadedModel,
    installed: InstalledSlot,
    compiled: CompiledDenoiser,
    stop: StartupStop | None = None,
) -> WarmedUp:
    """Run the pipeline at the shapes and rank buckets that make every later request reuse a compiled graph: under
    --fuse auto only the buckets its rule may choose (auto_buckets).

    Raises StartupStopped at the first pass or step after `stop` is requested."""
    stop = stop or StartupStop()
    slot = installed.residency.slot
    if not config.warmup:
        return WarmedUp(frozenset(slot.rank_buckets), compiled.graphs_compiled)
    runner = PipelineRunner(loaded, compiled)
    traits = loaded.traits
    requests = warm_up_requests(
        loaded.request_rules, traits.upsample_period(loaded.pipe), traits.warm_up_guidance(loaded.defaults)
    )
    graphs = warm_up_graphs(config.fuse, config.fuses, slot.graph_buckets, auto_buckets(loaded, installed))
    buckets = warm_up_buckets(graphs, compiled.compiled)
    started, passes = time.perf_counter(), itertools.count(1)

    def announce(bucket: int, params: GenerationParams) -> None:
        _log_step(
            "warm-up", started,
            f"pass {next(passes)} of {len(buckets) * len(requests)} begins: rank bucket {bucket}, "
            f"{params.width}x{params.height}, {params.num_inference_steps} steps, guidance {params.guidance_scale:g}",
        )  # fmt: skip

    with compile_cache_scope(_compile_cache_folder(config, loaded, installed, compiled)):
        for bucket in buckets:
            _run_at(loaded, runner, installed.residency, bucket, requests=requests, stop=stop, announce=announce)
    unfused = frozenset(graphs) - {0} if compiled.compiled else frozenset(slot.rank_buckets)
    return WarmedUp(unfused, compiled.graphs_compiled)


def _log_auto_rule(loaded: LoadedModel, installed: InstalledSlot) -> None:
    """The figures --fuse auto decides by (fuse_policy.py): the device type's constants and the LoRA work counted."""
    costs = device_costs(loaded.device.type)
    work = installed.lora_work
    defaults = loaded.defaults
    pixels = defaults.width * defaults.height
    buckets = installed.residency.slot.rank_buckets
    fused = installed.residency.fused_weights
    log.info(
        "--fuse auto: cost model for %s %s; LoRA work per step and rank: %d calls, %.4g MACs/pixel + %.4g MACs; at "
        "%dx%d one step unfused costs %s, a merge of every slot layer %s; buckets it may run unfused: %s",
        loaded.device.type, costs, work.calls, work.macs_per_pixel, work.fixed_macs, defaults.width, defaults.height,
        ", ".join(f"{unfused_ms(costs, work, b, 1, pixels):.3g} ms at {b}" for b in buckets),
        ", ".join(f"{merge_ms(costs, fused.full_merge_work(b)):.3g} ms at rank {b}" for b in buckets),
        ",".join(map(str, auto_buckets(loaded, installed))) or "none",
    )  # fmt: skip


def auto_buckets(loaded: LoadedModel, installed: InstalledSlot) -> tuple[int, ...]:
    """The rank buckets --fuse auto may run a stack at unfused (fuse_policy.buckets_auto_may_choose, with the
    cheapest step a request can ask for: the smallest image, the smallest batch); () when the server does not run
    auto."""
    if installed.lora_work is None:
        return ()
    work = work_at_guidance(loaded, installed.lora_work, SMALLEST_BATCH_GUIDANCE)
    fused = installed.residency.fused_weights
    buckets = installed.residency.slot.rank_buckets
    return buckets_auto_may_choose(
        device_costs(loaded.device.type), work, buckets, loaded.request_rules.min_size**2,
        {bucket: fused.full_merge_work(bucket) for bucket in buckets},
    )  # fmt: skip


def _run_at(
    loaded: LoadedModel,
    runner: PipelineRunner,
    residency: AdapterResidency,
    bucket: int,
    *,
    requests: list[GenerationRequest],
    stop: StartupStop,
    announce: Callable[[int, GenerationParams], None] = lambda bucket, params: None,
) -> None:
    """Run the warm-up requests with the base model resident, computing at `bucket` (compiling its graphs); each
    announced as it begins."""
    with residency.computing_at(bucket):
        for request in requests:
            stop.check()
            params = loaded.request_rules.resolve(request)
            announce(bucket, params)
            try:
                with runner.session():
                    runner.run(params, on_step=lambda progress: None, is_cancelled=lambda: stop.requested)
            except GenerationCancelledError:  # the stop, seen at a step boundary: a pass may take a compile per step
                stop.check()
                raise
    stop.check()


# -- what the phases share ------------------------------------------------------------------------------


class _PhaseClock:
    """Logs each start-up phase as it begins and as it ends, with its duration.

    Every line names its phase in the record's extra: `phase`, `event` (begins, step or done: see _log_step) and
    `seconds`, how long the phase had run when the line was written (0 as it begins, its duration when done), so
    that the last line of a start-up that never finishes says where it stopped and for how long it had been there.
    """

    def __init__(self) -> None:
        self.started = self._phase_started = time.perf_counter()

    def begin(self, phase: str, detail: str) -> None:
        self._phase_started = time.perf_counter()
        log.info("start-up %s: begins, %s", phase, detail, extra={"phase": phase, "event": "begins", "seconds": 0.0})

    def done(self, phase: str, detail: str) -> None:
        now = time.perf_counter()
        seconds = now - self._phase_started
        log.info(
            "start-up %s: %.2f s, %s", phase, seconds, detail,
            extra={"phase": phase, "event": "done", "seconds": round(seconds, 3)},
        )  # fmt: skip
        self._phase_started = now

    @property
    def total_seconds(self) -> float:
        return time.perf_counter() - self.started


def _log_step(phase: str, phase_started: float, detail: str) -> None:
    """A step within a phase that may take long (a warm-up pass: its first call compiles), logged as it begins."""
    seconds = time.perf_counter() - phase_started
    log.info(
        "start-up %s: %s, %.1f s into the phase", phase, detail, seconds,
        extra={"phase": phase, "event": "step", "seconds": round(seconds, 3)},
    )  # fmt: skip


def _device(config: EngineConfig) -> torch.device:
    if config.device:
        return torch.device(config.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    name = config.dtype or default_dtype(config.model, device.type)
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown --dtype {config.dtype!r}; use float32, float16 or bfloat16")  # noqa: TRY004
    return dtype


def _compile_cache_folder(
    config: EngineConfig, loaded: LoadedModel, installed: InstalledSlot, compiled: CompiledDenoiser
) -> Path | None:
    """The --compile-cache subfolder for this runtime's graphs (see compile_cache.py); None when not caching."""
    if not compiled.compiled or config.compile_cache is None:
        return None
    key = runtime_cache_key(
        model=config.model, layers=config.layers, dtype=loaded.dtype, device=loaded.device,
        max_rank=config.max_rank, rank_buckets=tuple(installed.residency.slot.graph_buckets),
        target_layers=installed.target_layers, quantize=config.quantize, compile_kind=compiled.kind,
        compile_backend=config.compile_backend, compile_mode=compiled.mode,
    )  # fmt: skip
    return key.folder(config.compile_cache)
