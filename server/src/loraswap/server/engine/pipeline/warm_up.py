"""The warm-up phase: run the pipeline at every shape and rank bucket a later request may need a graph for.

Which requests and buckets that is, warm_up_shapes.py and fuse_policy.py decide; here they run, each pass logged as
it begins (its first call compiles), inside the --compile-cache folder of this runtime's graphs.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from pathlib import Path

from loraswap.server.engine.adapters.residency import AdapterResidency
from loraswap.server.engine.config import EngineConfig
from loraswap.server.engine.errors import GenerationCancelledError
from loraswap.server.engine.fuse_policy import warm_up_graphs
from loraswap.server.engine.pipeline.auto_fuse import auto_buckets
from loraswap.server.engine.pipeline.compile_cache import compile_cache_scope, runtime_cache_key
from loraswap.server.engine.pipeline.phase_clock import log_step
from loraswap.server.engine.pipeline.records import CompiledDenoiser, InstalledSlot, LoadedModel, WarmedUp
from loraswap.server.engine.pipeline.runner import PipelineRunner
from loraswap.server.engine.pipeline.startup_stop import StartupStop
from loraswap.server.engine.pipeline.warm_up_shapes import warm_up_buckets, warm_up_requests
from loraswap.server.engine.types import GenerationParams, GenerationRequest


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
        loaded.request_rules,
        traits.upsample_period(loaded.pipe),
        traits.warm_up_guidance(loaded.pipe, loaded.defaults),
        traits.text_length_varies,
        traits.token_padding(loaded.pipe),
    )
    graphs = warm_up_graphs(config.fuse, config.fuses, slot.graph_buckets, auto_buckets(loaded, installed))
    buckets = warm_up_buckets(graphs, compiled.compiled)
    started, passes = time.perf_counter(), itertools.count(1)

    def announce(bucket: int, params: GenerationParams) -> None:
        log_step(
            "warm-up", started,
            f"pass {next(passes)} of {len(buckets) * len(requests)} begins: rank bucket {bucket}, "
            f"{params.width}x{params.height}, {params.num_inference_steps} steps, guidance {params.guidance_scale:g}",
        )  # fmt: skip

    with compile_cache_scope(_compile_cache_folder(config, loaded, installed, compiled)):
        for bucket in buckets:
            _run_at(loaded, runner, installed.residency, bucket, requests=requests, stop=stop, announce=announce)
    unfused = frozenset(graphs) - {0} if compiled.compiled else frozenset(slot.rank_buckets)
    return WarmedUp(unfused, compiled.graphs_compiled)


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
