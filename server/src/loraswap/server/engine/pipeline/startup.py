"""Start-up of the resident pipeline, in the order its log tells it: load, slot, quantize, compile, warm-up.

Each phase is a function of the config and of what the phases before it made, and returns a
record of its own (records.py); `start_runtime` runs them in order, logs each phase with its
duration (phase_clock.py), and hands the records to DiffusionRuntime. The warm-up, the longest
phase, is a module of its own (warm_up.py). Everything here runs on the engine's worker thread.

A stop may come at any moment (SIGTERM while warming up). The start-up cannot be interrupted inside
torch, so it checks a `StartupStop` (startup_stop.py) at its stopping points instead: before each
phase, before each warm-up pass and at each warm-up step, like a request's cancel flag.
"""

from __future__ import annotations

import functools
import time
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
from loraswap.server.engine.errors import StartupError
from loraswap.server.engine.families import family_of
from loraswap.server.engine.models import default_dtype, generation_defaults, latent_rgb, load_pipeline
from loraswap.server.engine.pipeline.attention import choose_attention
from loraswap.server.engine.pipeline.auto_fuse import log_auto_rule
from loraswap.server.engine.pipeline.compile import RECOMPILE_LIMIT, compile_counting
from loraswap.server.engine.pipeline.cpu_threads import CoreShare, thread_policy
from loraswap.server.engine.pipeline.lora_work import count_lora_work
from loraswap.server.engine.pipeline.phase_clock import STARTUP_LOG, PhaseClock, log_step
from loraswap.server.engine.pipeline.preflight import preflight
from loraswap.server.engine.pipeline.previews import LatentPreviewer
from loraswap.server.engine.pipeline.quantization import quantize_denoiser, weight_bytes
from loraswap.server.engine.pipeline.records import (
    CompiledDenoiser,
    InstalledSlot,
    LoadedModel,
    StoredWeights,
)
from loraswap.server.engine.pipeline.runtime import DiffusionRuntime
from loraswap.server.engine.pipeline.startup_stop import StartupStop
from loraswap.server.engine.pipeline.target_layers import resolve_target_layers
from loraswap.server.engine.pipeline.warm_up import warm_up
from loraswap.server.engine.rank_buckets import resolve_rank_buckets
from loraswap.server.engine.request_rules import RequestRules

log = STARTUP_LOG

# The share of a CUDA device's memory (1/N) the pristine copies leave free by default: activations, the allocator.
CUDA_MEMORY_RESERVE = 10


def start_runtime(config: EngineConfig, stop: StartupStop | None = None) -> DiffusionRuntime:
    """The resident pipeline, loaded, slotted, quantized, compiled and warm; each phase logged with its duration.

    Raises:
        SettingsError: the pre-flight found a setting this process cannot serve (one line).
        StartupStopped: `stop` was requested; raised at the next phase, warm-up pass or warm-up step.
    """
    preflight(config)  # what this process cannot serve is refused before anything loads
    stop = stop or StartupStop()
    clock = PhaseClock()
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
        log_auto_rule(loaded, installed)
    # A stop names the phase the log names next: unquantized, what follows the slot is the compile.
    stop.enter("quantize" if config.quantize != "none" else "compile")
    if config.quantize != "none":
        clock.begin("quantize", f"{config.quantize}, the denoiser's base linear layers on {loaded.device}")
    weights = quantize(config, loaded)
    if weights.quantization != "none":
        clock.done("quantize", f"{weights.quantization}, denoiser weights {weights.denoiser_weight_bytes} bytes")
    stop.enter("compile")
    compiling = resolve_compile_kind(config.compile, loaded.device.type, loaded.traits.compile_kind)
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
            negative_prompt_read_above=traits.classifier_free_guidance_above(pipe),
            min_steps=traits.min_steps(pipe),
        ),
        previewer=LatentPreviewer(
            latent_rgb(config.model, pipe),
            traits.latent_channels(pipe),
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
    """The pristine copies merges start from (adapters/residency/pristine_weights.py): the slot layers' base
    weights now when fusing, any other layer's at the first merge that changes it, all within one budget.

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
    kind = resolve_compile_kind(config.compile, loaded.device.type, loaded.traits.compile_kind)
    if kind != "none":
        log_step("compile", started, f"attention {attention_backend}; wrapping the denoiser in torch.compile")
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


# -- what the phases share ------------------------------------------------------------------------------


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
