"""The engine's face to any front end: plain domain types in, async iterators of events out.

Nothing here runs torch on the caller's event loop: the pipeline lives on the scheduler's worker thread, and the
adapters a request names load on loader threads (served_adapters.py), so that one slow or huge adapter does not hold
up the loads of others.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator
from dataclasses import replace

from loraswap.server.engine.adapters.formats import CanonicalAdapter, StackMember
from loraswap.server.engine.adapters.residency import slot_can_hold
from loraswap.server.engine.adapters.sources import AdapterSources, is_url_name
from loraswap.server.engine.config import EngineConfig
from loraswap.server.engine.configured_sources import configured_sources
from loraswap.server.engine.errors import (
    EngineError,
    ErrorReason,
    FuseChoiceError,
    NotServingError,
    StartupError,
)
from loraswap.server.engine.models import model_name
from loraswap.server.engine.observer import NO_OBSERVER, EngineGauges, EngineObserver
from loraswap.server.engine.pipeline.runtime import DiffusionRuntime
from loraswap.server.engine.pipeline.startup import start_runtime
from loraswap.server.engine.scheduler import GenerationJob, GenerationScheduler
from loraswap.server.engine.served_adapters import ServedAdapters
from loraswap.server.engine.types import (
    AdapterCacheSummary,
    FuseChoice,
    GeneratedImage,
    GenerationEvent,
    GenerationParams,
    GenerationRequest,
    PreloadResult,
    Queued,
    ServerDescription,
)


class DiffusionEngine:
    """One resident pipeline, its adapter cache and its request queue."""

    def __init__(
        self, config: EngineConfig, observer: EngineObserver = NO_OBSERVER, *, sources: AdapterSources | None = None
    ) -> None:
        """`observer` hears of cache lookups, loads, evictions, swaps, steps and images as they happen; `sources`
        replaces the adapter directory and Hub that `config` names (another store, or a test's slow one)."""
        self.config = config
        self._adapters = ServedAdapters(
            config, observer, sources or configured_sources(config, observer), resident=self._resident_adapters
        )
        self._scheduler = GenerationScheduler(
            functools.partial(start_runtime, config), config.max_queue, config.max_bypass, observer
        )
        self._runtime: DiffusionRuntime | None = None

    # -- life cycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        """Load, prepare, compile and warm up the pipeline on the worker thread, then preload; returns when serving.

        Raises:
            StartupError: what it cannot start with (one line).
            StartupStopped: stop() came first; it names the phase the stop came in.
        """
        self._scheduler.start()
        runtime = await asyncio.wrap_future(self._scheduler.ready)
        self._adapters.use_slot(runtime.slot_spec())
        stop = self._scheduler.startup_stop
        stop.enter("preload")
        try:
            await self._adapters.load_configured(stop.check)  # --pin and --preload
        except StartupError:
            await self.stop(timeout=5.0)
            raise
        stop.check()
        self._runtime = runtime

    def reload_url_tokens(self) -> bool:
        """Re-read --url-token-file (on SIGHUP); False when the server has none. ValueError or OSError for a file it
        cannot use: the tokens read before stay."""
        urls = self._adapters.sources.urls
        if urls is None or urls.policy.tokens.path is None:
            return False
        urls.policy.tokens.reload()
        return True

    @property
    def sources(self) -> AdapterSources:
        """Where adapter names are resolved (the adapter directory and the Hub, or what the constructor was given)."""
        return self._adapters.sources

    @property
    def serving(self) -> bool:
        return self._runtime is not None

    def stop_accepting(self) -> None:
        """New generations are refused with NotServingError; queued ones still run."""
        self._scheduler.stop_accepting()

    async def drain(self, timeout: float) -> bool:
        """Wait up to `timeout` s for queued and running generations, and adapter loads, to finish; True if they did."""
        loop = asyncio.get_running_loop()
        ends_at = loop.time() + timeout
        # Loads count too: a Generate waiting on a download is in no queue yet.
        while not self._scheduler.is_idle() or self._adapters.cache.loads_under_way:
            if loop.time() >= ends_at:
                return False
            await asyncio.sleep(0.05)
        return True

    def abort_all(self, message: str) -> None:
        """Fail every queued and running generation with NotServingError(message)."""
        self._scheduler.abort_all(NotServingError(message, reason=ErrorReason.SHUTTING_DOWN))

    @property
    def swaps(self) -> int:
        """Adapter changes the worker has made since start-up."""
        return self._scheduler.swaps

    def gauges(self) -> EngineGauges:
        """The engine's levels now; cheap, and safe from any thread while the worker runs a step."""
        runtime = self._runtime
        entries = self._adapters.cache.entries()
        return EngineGauges(
            queue_depth=self._scheduler.queue_length,
            cache_bytes=sum(entry.adapter.nbytes for entry in entries),
            cache_entries=len(entries),
            recompilations=runtime.snapshot.facts.recompilations if runtime is not None else 0,
            swaps=self._scheduler.swaps,
        )

    async def stop(self, timeout: float | None = None) -> None:
        """Finish the queued work (up to timeout seconds), stop a start-up still under way at its next stopping
        point (a phase's end, a warm-up step), and end the worker and loader threads.

        Raises:
            TimeoutError: the worker is still busy after `timeout` s (one from_pretrained, one long compile or
                step); it ends at its next stopping point, and the interpreter must not finalize before then
                (scheduler.py says why).
        """
        self._scheduler.stop()
        self._adapters.close()
        loop = asyncio.get_running_loop()
        ends_at = None if timeout is None else loop.time() + timeout
        while self._scheduler.worker_alive:  # polled, not joined: the caller may stop waiting (a second signal)
            if ends_at is not None and loop.time() >= ends_at:
                if self._scheduler.ready.done():
                    busy = "with a generation"
                else:
                    busy = f"in start-up phase {self._scheduler.startup_stop.phase}"
                raise TimeoutError(f"its worker was still busy {busy} after {timeout:g} s")
            await asyncio.sleep(0.05)

    # -- generation ---------------------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        """Validate, load the adapter if needed, queue, and yield Queued/StepProgress events then the image."""
        arrived = time.perf_counter()
        runtime = self._require_runtime()
        rules = runtime.request_rules
        params = rules.resolve(request)
        loads = self._adapters.start_loads(params, request.adapter_links)
        if not all(future.done() for future, _ in loads):
            # The first event comes at once, not when a slow read, conversion or download is over.
            yield Queued(position=0, loading_adapter=True)
        downloading = [
            applied.adapter
            for applied, (future, _) in zip(params.adapters, loads)
            if is_url_name(applied.adapter) and not future.done()
        ]
        if downloading:
            stacking = asyncio.ensure_future(self._adapters.stack(params, loads))
            try:
                async for event in self._adapters.download_progress(downloading, stacking):
                    yield event
                stack, load_ms, warnings = await stacking
            finally:
                stacking.cancel()
                if stacking.done() and not stacking.cancelled():
                    stacking.exception()  # retrieved: a failure the caller no longer waits for is not lost in a log
        else:
            # Awaited in place: a request that loads nothing is queued in the order it arrived.
            stack, load_ms, warnings = await self._adapters.stack(params, loads)
        self._check_fuse_choice(params, stack)
        warnings += rules.warnings(params)

        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def emit(event: object) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

        job = GenerationJob(params=params, stack=stack, emit=emit, adapter_load_ms=load_ms, warnings=warnings)
        self._scheduler.submit(job)
        try:
            while True:
                event = await events.get()
                if isinstance(event, EngineError):
                    raise event
                if isinstance(event, GeneratedImage):
                    total_ms = (time.perf_counter() - arrived) * 1000.0
                    yield _with_total(event, total_ms)
                    return
                yield event
        finally:
            self._scheduler.cancel(job)

    def _check_fuse_choice(self, params: GenerationParams, stack: tuple[StackMember, ...]) -> None:
        """Refuse, before anything is queued, a pinned path (GenerateRequest.fuse) this server cannot take for the
        stack: fused on a server that does not fuse, unfused for adapters the slot cannot hold."""
        if not stack or params.fuse is None:
            return
        config = self.config
        if params.fuse is FuseChoice.FUSED and not config.fuses:
            why = ("runs with --fuse never" if config.fuse == "never"
                   else f"serves --quantize {config.quantize} weights (int8 weight-only), which it serves unfused only")  # fmt: skip
            raise FuseChoiceError(
                f"fuse is FUSE_CHOICE_FUSED but this server {why}; leave fuse unset, or ask for FUSE_CHOICE_UNFUSED",
                fuse="FUSE_CHOICE_FUSED",
            )
        if params.fuse is not FuseChoice.UNFUSED:
            return
        if not slot_can_hold((adapter for adapter, _ in stack), config.max_rank):
            raise FuseChoiceError(
                "fuse is FUSE_CHOICE_UNFUSED but the swap slot cannot hold "
                f"{'this stack' if len(stack) > 1 else 'this adapter'} (a kind, layer, DoRA, bias or rank only a "
                f"fused swap applies, or ranks adding up to more than --max-rank {config.max_rank}: ListAdapters' "
                "must_fuse); leave fuse unset, or ask for FUSE_CHOICE_FUSED",
                fuse="FUSE_CHOICE_UNFUSED",
            )
        runtime = self._require_runtime()
        if runtime.unfused_bucket(stack) is None:
            bucket = runtime.residency.unfused_bucket(stack)
            raise FuseChoiceError(
                f"fuse is FUSE_CHOICE_UNFUSED but this server compiled no graph for the swap slot at rank bucket "
                f"{bucket} (a compiled server warms up only the graphs its --fuse policy runs: always the base "
                "model's, auto the buckets its cost model may choose; a compile now would stall the queue); leave "
                "fuse unset, or send unfused requests to a server started with --fuse never or --no-compile",
                fuse="FUSE_CHOICE_UNFUSED",
            )

    # -- adapters -------------------------------------------------------------------------------------

    async def preload(self, name: str, link: str | None = None) -> PreloadResult:
        """Make an adapter ready in the cache; idempotent. `link`: a URL adapter's full URL (`name` its identity)."""
        self._require_runtime()
        return await self._adapters.preload(name, link)

    def evict(self, name: str) -> int:
        """Drop an adapter from the cache; returns the bytes freed."""
        return self._adapters.evict(name)

    def list_adapters(self) -> AdapterCacheSummary:
        """The cached adapters, most recently used first."""
        return self._adapters.summary()

    def _resident_adapters(self) -> tuple[CanonicalAdapter, ...]:
        """The adapters in the resident model, as the worker's last snapshot has them (none before serving)."""
        return self._runtime.snapshot.resident if self._runtime is not None else ()

    # -- facts ------------------------------------------------------------------------------------------

    def describe(self) -> ServerDescription:
        """The resident model, its slot and its compile state: the runtime's facts, and the engine's own."""
        facts = self._require_runtime().snapshot.facts  # the worker's last snapshot: nothing here reads the slot itself
        # The model's name, never the server's folder path (any generate-role caller may ask).
        return ServerDescription.of(
            facts, model=model_name(self.config.model), base_model=self._adapters.base_models.served.id
        )

    @property
    def runtime(self) -> DiffusionRuntime:
        """The resident runtime, once serving (NotServingError before). Its state belongs to the worker thread:
        read it off that thread only while no generation runs (tests, benchmarks); `snapshot` is safe anywhere."""
        return self._require_runtime()

    def _require_runtime(self) -> DiffusionRuntime:
        if self._runtime is None:
            raise NotServingError("the server is still loading and warming up its model; retry shortly")
        return self._runtime


def _with_total(image: GeneratedImage, total_ms: float) -> GeneratedImage:
    return replace(image, timings=replace(image.timings, total_ms=total_ms))
