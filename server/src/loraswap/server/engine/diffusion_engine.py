"""The engine's face to any front end: plain domain types in, async iterators of events out.

Nothing here runs torch on the caller's event loop: the pipeline lives on the
scheduler's worker thread and adapter files are read and converted on loader
threads, a few at once, so that one slow or huge adapter does not hold up the
loads of others.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future, ThreadPoolExecutor

from loraswap.server.engine.adapters.formats import (
    CanonicalAdapter,
    SlotSpec,
    StackMember,
    load_canonical,
    refuse_strengths,
)
from loraswap.server.engine.adapters.residency import AdapterCache, CacheEntry, check_stack_fits, slot_can_hold
from loraswap.server.engine.adapters.sources import (
    AdapterSources,
    BaseModelPolicy,
    HubAdapterSource,
    LocalAdapterDirectory,
    check_name,
    is_url_name,
    public_name,
)
from loraswap.server.engine.config import EngineConfig
from loraswap.server.engine.errors import (
    EngineError,
    ErrorReason,
    FuseChoiceError,
    InvalidRequestError,
    NotServingError,
    StartupError,
    shorten,
)
from loraswap.server.engine.models import BUILTINS, model_name, served_base_model
from loraswap.server.engine.observer import NO_OBSERVER, EngineGauges, EngineObserver
from loraswap.server.engine.pipeline.runtime import DiffusionRuntime
from loraswap.server.engine.pipeline.startup import start_runtime
from loraswap.server.engine.scheduler import GenerationJob, GenerationScheduler
from loraswap.server.engine.types import (
    AdapterCacheSummary,
    AdapterSummary,
    FuseChoice,
    GeneratedImage,
    GenerationEvent,
    GenerationParams,
    GenerationRequest,
    PreloadResult,
    Queued,
    ServerDescription,
)

log = logging.getLogger(__name__)

# Adapter loads that may run at once, so that a slow or huge one does not hold up the others. Each holds its file
# (at most --max-adapter-bytes) in memory a few times over while it decodes it: this also bounds what cold loads take.
ADAPTER_LOAD_THREADS = 4
# URL adapters download (then read and convert) on threads of their own, so that slow hosts hold up no local load.
URL_LOAD_THREADS = 4
# How often a Generate waiting on a URL adapter's download reports its bytes (a Queued event when they changed).
DOWNLOAD_PROGRESS_EVERY_S = 0.5


class DiffusionEngine:
    """One resident pipeline, its adapter cache and its request queue."""

    def __init__(
        self, config: EngineConfig, observer: EngineObserver = NO_OBSERVER, *, sources: AdapterSources | None = None
    ) -> None:
        """`observer` hears of cache lookups, loads, evictions, swaps, steps and images as they happen; `sources`
        replaces the adapter directory and Hub that `config` names (another store, or a test's slow one)."""
        self.config = config
        self._sources = sources or AdapterSources(
            LocalAdapterDirectory(config.adapter_dir or _shipped_adapter_dir(config.model), config.max_adapter_bytes),
            HubAdapterSource(config.allow_hub, config.max_adapter_bytes),
            url_adapter_source(config, observer),
        )
        # Adapters declaring another base are refused before their tensors are read.
        self._base_models = BaseModelPolicy(served_base_model(config.model), config.allow_base)
        self._loader_pool = ThreadPoolExecutor(max_workers=ADAPTER_LOAD_THREADS, thread_name_prefix="loraswap-loader")
        self._url_pool = ThreadPoolExecutor(max_workers=URL_LOAD_THREADS, thread_name_prefix="loraswap-url-loader")
        self._cache = AdapterCache(
            config.adapter_cache_bytes,
            self._load_adapter,
            self._loader_pool,
            observer,
            executor_for=lambda name: self._url_pool if is_url_name(name) else self._loader_pool,
        )
        self._scheduler = GenerationScheduler(
            functools.partial(start_runtime, config), config.max_queue, config.max_bypass, observer
        )
        self._runtime: DiffusionRuntime | None = None
        self._slot_spec: SlotSpec | None = None
        self._configured_links: dict[str, str] = {}  # --pin/--preload URLs: identity -> link

    # -- life cycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        """Load, prepare, compile and warm up the pipeline on the worker thread, then preload; returns when serving.

        Raises:
            StartupError: what it cannot start with (one line).
            StartupStopped: stop() came first; it names the phase the stop came in.
        """
        self._scheduler.start()
        runtime = await asyncio.wrap_future(self._scheduler.ready)
        self._slot_spec = runtime.slot_spec()
        stop = self._scheduler.startup_stop
        stop.enter("preload")
        await self._preload_configured()
        stop.check()
        self._runtime = runtime

    async def _preload_configured(self) -> None:
        """Load --pin and --preload adapters (pins first, and pinned before they load); fail start-up otherwise.

        A server that was told to have these adapters ready must not turn SERVING without them: an unusable name,
        pins beyond the cache budget, or preloads that push each other out raise StartupError (one line).
        """
        try:
            # URL adapters by their identities (a link's query is a secret: never in a log line or the cache).
            pins = tuple(self._public(name) for name in self.config.pin)
            names = tuple(dict.fromkeys(pins + tuple(self._public(name) for name in self.config.preload)))
        except EngineError as error:
            await self.stop(timeout=5.0)
            raise StartupError(f"--pin/--preload: {error.message}") from error
        for name in pins:
            self._cache.pin(name)
        try:
            for name in names:
                self._scheduler.startup_stop.check()
                flag = "--pin" if name in pins else "--preload"
                try:
                    self._sources.check(name)
                    entry, load_ms = await self._cached(name, self._configured_links.get(name))
                except EngineError as error:
                    raise StartupError(f"{flag} {shorten(name)!r}: {error.message}") from error
                log.info("%s %s: %d bytes, loaded in %.0f ms", flag, name, entry.adapter.nbytes, load_ms)
            cached = {entry.adapter.name for entry in self._cache.entries()}
            pushed_out = [name for name in names if name not in cached]
            if pushed_out:
                raise StartupError(
                    f"--preload {shorten(','.join(pushed_out))!r}: the preloaded adapters do not fit in the adapter "
                    f"cache together ({self._cache.budget_bytes} bytes, --adapter-cache-bytes); preload fewer or "
                    "raise the budget"
                )
        except StartupError:
            await self.stop(timeout=5.0)
            raise

    def _public(self, name: str) -> str:
        """A configured adapter's public name; a URL's link is kept for the fetcher (`_configured_links`)."""
        identity = public_name(name)
        if is_url_name(name):
            self._configured_links[identity] = name
        return identity

    def reload_url_tokens(self) -> bool:
        """Re-read --url-token-file (on SIGHUP); False when the server has none. ValueError or OSError for a file it
        cannot use: the tokens read before stay."""
        urls = self._sources.urls
        if urls is None or urls.policy.tokens.path is None:
            return False
        urls.policy.tokens.reload()
        return True

    @property
    def sources(self) -> AdapterSources:
        """Where adapter names are resolved (the adapter directory and the Hub, or what the constructor was given)."""
        return self._sources

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
        while not self._scheduler.is_idle() or self._cache.loads_under_way:
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
        entries = self._cache.entries()
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
        # Loads under way finish on their threads (they end then; a download at its next read); those not begun
        # are dropped.
        self._sources.close()
        self._loader_pool.shutdown(wait=False, cancel_futures=True)
        self._url_pool.shutdown(wait=False, cancel_futures=True)
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
        loads = self._start_loads(params, request.adapter_links)
        if not all(future.done() for future, _ in loads):
            # The first event comes at once, not when a slow read, conversion or download is over.
            yield Queued(position=0, loading_adapter=True)
        downloading = [
            applied.adapter
            for applied, (future, _) in zip(params.adapters, loads)
            if is_url_name(applied.adapter) and not future.done()
        ]
        if downloading:
            stacking = asyncio.ensure_future(self._stack(params, loads))
            try:
                async for event in self._download_progress(downloading, stacking):
                    yield event
                stack, load_ms, warnings = await stacking
            finally:
                stacking.cancel()
                if stacking.done() and not stacking.cancelled():
                    stacking.exception()  # retrieved: a failure the caller no longer waits for is not lost in a log
        else:
            # Awaited in place: a request that loads nothing is queued in the order it arrived.
            stack, load_ms, warnings = await self._stack(params, loads)
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

    def _start_loads(self, params: GenerationParams, links) -> list[tuple[Future, bool]]:
        """For each of the request's adapters, its cache entry's future and whether it was cached; loads start now.

        Names are checked first (a URL against the hosts this server may fetch from), so that a malformed or
        refused one is refused before anything says "loading". `links`: the full URLs of URL adapters.
        """
        for applied in params.adapters:
            self._sources.check(applied.adapter)
        return [self._cache.get_or_load(applied.adapter, links.get(applied.adapter)) for applied in params.adapters]

    async def _download_progress(self, urls: list[str], stacking: asyncio.Future) -> AsyncIterator[Queued]:
        """Queued events with the bytes of these URL adapters' downloads, each time they changed, until the stack is
        loaded."""
        last = None
        while urls:
            done, _ = await asyncio.wait((stacking,), timeout=DOWNLOAD_PROGRESS_EVERY_S)
            if done:
                return
            downloads = [progress for progress in map(self._sources.download_progress, urls) if progress is not None]
            if not downloads:
                continue
            now = (sum(download.done for download in downloads), sum(download.total for download in downloads))
            if now != last:
                last = now
                yield Queued(position=0, loading_adapter=True, downloaded_bytes=now[0], download_total_bytes=now[1])

    async def _stack(
        self, params: GenerationParams, loads: list[tuple[Future, bool]]
    ) -> tuple[tuple[StackMember, ...], float, tuple[str, ...]]:
        """The request's adapters from the cache (loaded if need be) with their strengths, the load ms, warnings.

        Refuses, before anything is queued, two names for one file and, when the server does not fuse, a stack
        whose ranks exceed the slot on some layer (STACK_RANK_EXCEEDED).
        """
        stack: list[StackMember] = []
        load_ms = 0.0
        warnings: tuple[str, ...] = ()
        names_by_source: dict[str, str] = {}
        # A stack's uncached members load side by side on the loader threads.
        entries = await asyncio.gather(*(_entry(future, hit) for future, hit in loads))
        for applied, (entry, entry_load_ms) in zip(params.adapters, entries):
            adapter = entry.adapter
            if adapter.source in names_by_source:
                raise InvalidRequestError(
                    f"adapters {names_by_source[adapter.source]!r} and {applied.adapter!r} are the same file "
                    f"({adapter.source}); list each adapter once",
                    field="adapters",
                )
            names_by_source[adapter.source] = applied.adapter
            stack.append((adapter, applied.scale))
            load_ms += entry_load_ms
            # In a stack, each warning says which member it is about.
            prefix = f"{applied.adapter}: " if len(params.adapters) > 1 else ""
            warnings += tuple(prefix + warning for warning in adapter.warnings)
        if len(stack) > 1 and not self.config.fuses:  # a fused stack is not bounded by the slot's width
            check_stack_fits((adapter for adapter, _ in stack), self.config.max_rank)
        # Each adapter fits the model's range at strength 1 (checked when it loaded); these strengths may not.
        refuse_strengths([(adapter.effects, scale) for adapter, scale in stack], self._slot_spec.dtype)
        if len(stack) > 1:
            # The members' content keys order the stack (residency.stack_order): digests of torch tensors, made on
            # a loader thread (once per adapter) rather than on the event loop that queues the job.
            await asyncio.get_running_loop().run_in_executor(
                self._loader_pool, lambda: [adapter.content_key for adapter, _ in stack]
            )
        for applied in params.adapters:
            self._cache.record_use(applied.adapter)
        return tuple(stack), load_ms, warnings

    # -- adapters -------------------------------------------------------------------------------------

    def _load_adapter(self, name: str, link: str | None = None) -> CanonicalAdapter:
        """Resolve (a URL adapter from `link`, its full URL), read, convert and validate; runs on a loader thread."""
        if self._slot_spec is None:
            raise NotServingError("the server is still starting; retry")
        found = self._sources.resolve(name, link)
        with self._sources.holding(found):  # a downloaded file that is no usable adapter does not stay on disk
            return load_canonical(found, self._slot_spec, self._base_models)

    async def _cached(self, name: str, link: str | None = None) -> tuple[CacheEntry, float]:
        return await _entry(*self._cache.get_or_load(name, link))

    async def preload(self, name: str, link: str | None = None) -> PreloadResult:
        """Make an adapter ready in the cache; idempotent. `link`: a URL adapter's full URL (`name` its identity)."""
        self._require_runtime()
        self._sources.check(name)
        entry, load_ms = await self._cached(name, link)
        loaded = load_ms != 0.0
        adapter = entry.adapter
        return PreloadResult(
            adapter=self._summary(name, entry),
            already_cached=not loaded,
            download_ms=adapter.download_ms if loaded else 0.0,
            download_bytes=adapter.download_bytes if loaded else 0,
        )

    def evict(self, name: str) -> int:
        """Drop an adapter from the cache; returns the bytes freed."""
        check_name(name)
        return self._cache.evict(name)

    def list_adapters(self) -> AdapterCacheSummary:
        """The cached adapters, most recently used first."""
        return AdapterCacheSummary(
            adapters=tuple(self._summary(entry.adapter.name, entry) for entry in self._cache.entries()),
            cache_bytes=self._cache.total_bytes,
            cache_budget_bytes=self._cache.budget_bytes,
        )

    def _summary(self, name: str, entry: CacheEntry) -> AdapterSummary:
        adapter = entry.adapter
        # The worker's last snapshot: the event loop never reads the slot itself.
        resident = self._runtime is not None and any(adapter is member for member in self._runtime.snapshot.resident)
        denoiser = self._slot_spec.denoiser if self._slot_spec is not None else ""
        return AdapterSummary(
            id=name,
            rank=adapter.rank,
            target_layers=tuple(adapter.layers) + tuple(sorted(module for _, module in adapter.changes_in({denoiser}))),
            bytes=adapter.nbytes,
            source=adapter.source,
            hits=entry.hits,
            last_used_unix_ms=entry.last_used_unix_ms,
            resident=resident,
            load_ms=adapter.load_ms,
            warnings=adapter.warnings,
            pinned=self._cache.is_pinned(name),
            kinds=adapter.kinds,
            component_layers=adapter.layers_per_component(denoiser),
            must_fuse=not adapter.fits_slot,
        )

    # -- facts ------------------------------------------------------------------------------------------

    def describe(self) -> ServerDescription:
        """The resident model, its slot and its compile state: the runtime's facts, and the engine's own."""
        facts = self._require_runtime().snapshot.facts  # the worker's last snapshot: nothing here reads the slot itself
        # The model's name, never the server's folder path (any generate-role caller may ask).
        return ServerDescription.of(facts, model=model_name(self.config.model), base_model=self._base_models.served.id)

    @property
    def runtime(self) -> DiffusionRuntime:
        """The resident runtime, once serving (NotServingError before). Its state belongs to the worker thread:
        read it off that thread only while no generation runs (tests, benchmarks); `snapshot` is safe anywhere."""
        return self._require_runtime()

    def _require_runtime(self) -> DiffusionRuntime:
        if self._runtime is None:
            raise NotServingError("the server is still loading and warming up its model; retry shortly")
        return self._runtime


async def _entry(future: Future, hit: bool) -> tuple[CacheEntry, float]:
    """The cache entry a get_or_load future gives, and the ms its load took (0 when it was cached)."""
    # Shielded: a caller that goes away (a cancelled Generate) must not cancel a load that others share; the
    # failure of a load nobody waits for any more is retrieved, not logged as lost.
    shared = asyncio.wrap_future(future)
    shared.add_done_callback(lambda done: done.cancelled() or done.exception())
    entry = await asyncio.shield(shared)
    return entry, 0.0 if hit else entry.adapter.download_ms + entry.adapter.load_ms


def url_adapter_source(config: EngineConfig, observer: EngineObserver):
    """The fetcher of URL adapters under the config's --allow-url-host rules, or None when no host is allowed."""
    from loraswap.server.engine.adapters.sources import (
        DownloadCache,
        UrlAdapterSource,
        UrlPolicy,
        UrlTimeouts,
        UrlTokens,
    )

    if not (config.allow_url_host or config.allow_insecure_url_host):
        return None
    policy = UrlPolicy(
        allowed_hosts=config.allow_url_host,
        insecure_hosts=config.allow_insecure_url_host,
        allow_private_addresses=config.allow_url_private_addresses,
        tokens=UrlTokens(config.url_token_file),
    )
    try:
        cache = DownloadCache(config.download_cache_dir, config.adapter_cache_dir_bytes)
    except OSError as error:
        raise StartupError(
            f"--adapter-cache-dir {config.download_cache_dir}: cannot be made or written ({error.strerror}); give a "
            "writable folder"
        ) from None
    return UrlAdapterSource(
        policy,
        cache,
        max_adapter_bytes=config.max_adapter_bytes,
        ca_file=config.url_ca_file,
        timeouts=UrlTimeouts(io_s=config.url_timeout_seconds, deadline_s=config.url_deadline_seconds),
        observer=observer,
    )


def _shipped_adapter_dir(model: str):
    """The demo adapters that ship with a built-in model, served when no --adapter-dir is given."""
    builtin = BUILTINS.get(model)
    return builtin.adapter_dir if builtin is not None else None


def _with_total(image: GeneratedImage, total_ms: float) -> GeneratedImage:
    from dataclasses import replace

    return replace(image, timings=replace(image.timings, total_ms=total_ms))
