"""Start-up of the resident pipeline, in the order its log tells it: load, slot, quantize, compile, warm-up.

Each phase is a function of the config and of what the phases before it made, and returns a
record of its own (runtime.py); `start_runtime` runs them in order, logs each phase with its
duration, and hands the records to DiffusionRuntime. Everything here runs on the engine's
worker thread.
"""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path

import torch

from loraswap.server.engine.adapters.device_cache import DeviceAdapterCache
from loraswap.server.engine.adapters.slot import HotswapSlot
from loraswap.server.engine.compile_options import effective_compile_mode, resolve_compile_kind
from loraswap.server.engine.config import EngineConfig
from loraswap.server.engine.families import family_of
from loraswap.server.engine.models import default_dtype, generation_defaults, latent_rgb, load_pipeline
from loraswap.server.engine.pipeline.attention import apply_attention, resolve_attention
from loraswap.server.engine.pipeline.compile import RECOMPILE_LIMIT, compile_counting
from loraswap.server.engine.pipeline.compile_cache import compile_cache_scope, runtime_cache_key
from loraswap.server.engine.pipeline.cpu_threads import CoreShare, thread_policy
from loraswap.server.engine.pipeline.previews import LatentPreviewer
from loraswap.server.engine.pipeline.quantization import quantize_denoiser, weight_bytes
from loraswap.server.engine.pipeline.runtime import (
    CompiledDenoiser,
    DiffusionRuntime,
    InstalledSlot,
    LoadedModel,
    StoredWeights,
)
from loraswap.server.engine.pipeline.target_layers import resolve_target_layers
from loraswap.server.engine.pipeline.warm_up import warm_up_buckets, warm_up_requests
from loraswap.server.engine.rank_buckets import resolve_rank_buckets
from loraswap.server.engine.request_rules import RequestRules

log = logging.getLogger(__name__)


def start_runtime(config: EngineConfig) -> DiffusionRuntime:
    """The resident pipeline, loaded, slotted, quantized, compiled and warm; each phase logged with its duration."""
    clock = _PhaseClock()
    loaded = load(config)
    clock.done("load", f"{config.model} ({loaded.traits.family.value}, {loaded.dtype} on {loaded.device})")
    installed = install_slot(config, loaded)
    clock.done("slot", f"{len(installed.target_layers)} layers at rank {config.max_rank}")
    weights = quantize(config, loaded)
    if weights.quantization != "none":
        clock.done("quantize", f"{weights.quantization}, denoiser weights {weights.denoiser_weight_bytes} bytes")
    compiled = compile_denoiser(config, loaded, installed)
    if compiled.compiled:
        # dynamo compiles lazily: the graphs themselves are built by the warm-up's first calls.
        clock.done("compile", f"backend {config.compile_backend}")
    runtime = DiffusionRuntime(config, loaded, installed, weights, compiled)
    if config.warmup:
        warm_up(runtime, _compile_cache_folder(config, loaded, installed, compiled))
        clock.done("warm-up", f"{runtime.graphs_compiled} graphs compiled")
    runtime.count_recompilations_from_now()
    log.info(
        "ready: %s (%s, %s on %s), %d slot layers at rank %d, compiled=%s, in %.1f s",
        config.model, runtime.family.value, runtime.dtype, runtime.device, len(runtime.target_layers),
        config.max_rank, runtime.compiled, clock.total_seconds,
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
        pipe=pipe,
        traits=traits,
        device=device,
        dtype=dtype,
        threads=threads,
        defaults=defaults,
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
    )


def install_slot(config: EngineConfig, loaded: LoadedModel) -> InstalledSlot:
    """The swap slot on the target layers at max rank, and (CUDA) the device hot set of adapters."""
    denoiser = loaded.denoiser
    patterns = config.target_modules or loaded.traits.default_target_modules
    target_layers = resolve_target_layers(denoiser, tuple(patterns))
    slot = HotswapSlot.install(
        denoiser, target_layers, config.max_rank, loaded.dtype, loaded.device,
        resolve_rank_buckets(config.rank_buckets, config.max_rank),
    )  # fmt: skip
    # CUDA only: cached adapters are pinned (SlotSpec.pin_memory) and hot ones kept on the device.
    device_adapter_bytes = config.device_adapter_bytes if loaded.device.type == "cuda" else 0
    if device_adapter_bytes:
        slot.device_cache = DeviceAdapterCache(device_adapter_bytes, loaded.device)
    elif config.device_adapter_bytes:
        log.info("--device-adapter-bytes: adapters are copied from host memory on %s, no hot set", loaded.device)
    return InstalledSlot(slot=slot, target_layers=tuple(target_layers), device_adapter_bytes=device_adapter_bytes)


def quantize(config: EngineConfig, loaded: LoadedModel) -> StoredWeights:
    """Store the denoiser's base linear weights as --quantize says: after the slot is in, before any compile."""
    quantize_denoiser(loaded.denoiser, config.quantize)
    return StoredWeights(quantization=config.quantize, denoiser_weight_bytes=weight_bytes(loaded.denoiser))


def compile_denoiser(config: EngineConfig, loaded: LoadedModel, installed: InstalledSlot) -> CompiledDenoiser:
    """Set the attention backend (the graphs are traced from it), then torch.compile the denoiser as --compile says."""
    attention_backend = apply_attention(loaded.denoiser, resolve_attention(config.attention, loaded.device))
    kind = resolve_compile_kind(config.compile, loaded.device.type)
    mode = effective_compile_mode(config.compile_mode, loaded.device.type)
    if mode != config.compile_mode:
        log.warning(
            "--compile-mode %s captures CUDA graphs, which %s has none of: compiling with mode %s",
            config.compile_mode, loaded.device, mode,
        )  # fmt: skip
    backend = None
    if kind != "none":
        # Each rank bucket (and the base model) is a graph of its own for every class of shapes.
        buckets_limit = RECOMPILE_LIMIT * len(installed.slot.graph_buckets)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, buckets_limit)
        backend = compile_counting(loaded.denoiser, config.compile_backend, kind=kind, mode=mode)
    return CompiledDenoiser(kind=kind, mode=mode, attention_backend=attention_backend, backend=backend)


def warm_up(runtime: DiffusionRuntime, compile_cache_folder: Path | None) -> None:
    """Run the pipeline at the shapes and rank buckets that make every later request reuse a compiled graph."""
    requests = warm_up_requests(
        runtime.request_rules,
        runtime.traits.upsample_period(runtime.pipe),
        runtime.traits.warm_up_guidance(runtime.defaults),
    )
    with compile_cache_scope(compile_cache_folder):
        for bucket in warm_up_buckets(runtime.slot.graph_buckets, runtime.compiled):
            with runtime.slot.computing_at(bucket):
                for request in requests:
                    runtime.generate(
                        runtime.request_rules.resolve(request), (), on_step=lambda progress: None,
                        is_cancelled=lambda: False,
                    )  # fmt: skip


# -- what the phases share ------------------------------------------------------------------------------


class _PhaseClock:
    """Logs each start-up phase as it ends, with its duration."""

    def __init__(self) -> None:
        self.started = self._phase_started = time.perf_counter()

    def done(self, phase: str, detail: str) -> None:
        now = time.perf_counter()
        seconds = now - self._phase_started
        log.info(
            "start-up %s: %.2f s, %s", phase, seconds, detail, extra={"phase": phase, "seconds": round(seconds, 3)}
        )
        self._phase_started = now

    @property
    def total_seconds(self) -> float:
        return time.perf_counter() - self.started


def _device(config: EngineConfig) -> torch.device:
    if config.device:
        return torch.device(config.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    name = config.dtype or default_dtype(config.model, device.type)
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown --dtype {config.dtype!r}; use float32, float16 or bfloat16")
    return dtype


def _compile_cache_folder(
    config: EngineConfig, loaded: LoadedModel, installed: InstalledSlot, compiled: CompiledDenoiser
) -> Path | None:
    """The --compile-cache subfolder for this runtime's graphs (see compile_cache.py); None when not caching."""
    if not compiled.compiled or config.compile_cache is None:
        return None
    key = runtime_cache_key(
        model=config.model, layers=config.layers, dtype=loaded.dtype, device=loaded.device,
        max_rank=config.max_rank, rank_buckets=tuple(installed.slot.graph_buckets),
        target_layers=installed.target_layers, quantize=config.quantize, compile_kind=compiled.kind,
        compile_backend=config.compile_backend, compile_mode=compiled.mode,
    )  # fmt: skip
    return key.folder(config.compile_cache)
