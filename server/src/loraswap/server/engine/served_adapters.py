"""The adapters an engine serves: where their names resolve, the threads that read and convert them, the cache that
holds them, and a request's stack taken from that cache.

Adapter files are read and converted on loader threads, a few at once, so that one slow or huge adapter does not
hold up the loads of others; URL adapters download on threads of their own. Nothing here runs torch on the event
loop or touches the resident model: a load converts against the swap slot's spec, known once start-up made it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor

from loraswap.server.engine.adapters.formats import (
    CanonicalAdapter,
    SlotSpec,
    StackMember,
    load_canonical,
    refuse_strengths,
)
from loraswap.server.engine.adapters.residency import AdapterCache, CacheEntry, check_stack_fits
from loraswap.server.engine.adapters.sources import (
    AdapterSources,
    BaseModelPolicy,
    check_name,
    is_url_name,
    public_name,
)
from loraswap.server.engine.config import EngineConfig
from loraswap.server.engine.errors import (
    EngineError,
    InvalidRequestError,
    NotServingError,
    StartupError,
    shorten,
)
from loraswap.server.engine.models import served_base_model
from loraswap.server.engine.observer import EngineObserver
from loraswap.server.engine.types import (
    AdapterCacheSummary,
    AdapterSummary,
    GenerationParams,
    PreloadResult,
    Queued,
)

log = logging.getLogger(__name__)

# Adapter loads that may run at once, so that a slow or huge one does not hold up the others. Each holds its file
# (at most --max-adapter-bytes) in memory a few times over while it decodes it: this also bounds what cold loads take.
ADAPTER_LOAD_THREADS = 4
# URL adapters download (then read and convert) on threads of their own, so that slow hosts hold up no local load.
URL_LOAD_THREADS = 4
# How often a Generate waiting on a URL adapter's download reports its bytes (a Queued event when they changed).
DOWNLOAD_PROGRESS_EVERY_S = 0.5

# A cache entry's future and whether the entry was cached when asked for (AdapterCache.get_or_load).
Load = tuple[Future, bool]


class ServedAdapters:
    """An engine's adapter sources, loader threads and cache; called on the event loop, loading on its threads."""

    def __init__(
        self,
        config: EngineConfig,
        observer: EngineObserver,
        sources: AdapterSources,
        resident: Callable[[], Iterable[CanonicalAdapter]],
    ) -> None:
        """`resident`: the adapters in the resident model now, as the worker's last snapshot has them (none before
        serving)."""
        self._config = config
        self._sources = sources
        self._resident = resident
        # Adapters declaring another base are refused before their tensors are read.
        self.base_models = BaseModelPolicy(served_base_model(config.model), config.allow_base)
        self._loader_pool = ThreadPoolExecutor(max_workers=ADAPTER_LOAD_THREADS, thread_name_prefix="loraswap-loader")
        self._url_pool = ThreadPoolExecutor(max_workers=URL_LOAD_THREADS, thread_name_prefix="loraswap-url-loader")
        self.cache = AdapterCache(
            config.adapter_cache_bytes,
            self._load_adapter,
            self._loader_pool,
            observer,
            executor_for=lambda name: self._url_pool if is_url_name(name) else self._loader_pool,
        )
        self._slot_spec: SlotSpec | None = None
        self._configured_links: dict[str, str] = {}  # --pin/--preload URLs: identity -> link

    @property
    def sources(self) -> AdapterSources:
        """Where adapter names are resolved."""
        return self._sources

    def use_slot(self, slot_spec: SlotSpec) -> None:
        """Load adapters for the resident model's swap slot from now on (before it, a load is NotServingError)."""
        self._slot_spec = slot_spec

    def close(self) -> None:
        """Stop loading: loads under way finish on their threads (they end then; a download at its next read); those
        not begun are dropped."""
        self._sources.close()
        self._loader_pool.shutdown(wait=False, cancel_futures=True)
        self._url_pool.shutdown(wait=False, cancel_futures=True)

    # -- the adapters a server is started with ----------------------------------------------------------

    async def load_configured(self, check_stop: Callable[[], None]) -> None:
        """Load --pin and --preload adapters (pins first, and pinned before they load); `check_stop` is called
        before each (a start-up stopped meanwhile raises there).

        A server that was told to have these adapters ready must not turn SERVING without them: an unusable name,
        pins beyond the cache budget, or preloads that push each other out raise StartupError (one line).
        """
        try:
            # URL adapters by their identities (a link's query is a secret: never in a log line or the cache).
            pins = tuple(self._public(name) for name in self._config.pin)
            names = tuple(dict.fromkeys(pins + tuple(self._public(name) for name in self._config.preload)))
        except EngineError as error:
            raise StartupError(f"--pin/--preload: {error.message}") from error
        for name in pins:
            self.cache.pin(name)
        for name in names:
            check_stop()
            flag = "--pin" if name in pins else "--preload"
            try:
                self._sources.check(name)
                entry, load_ms = await self._cached(name, self._configured_links.get(name))
            except EngineError as error:
                raise StartupError(f"{flag} {shorten(name)!r}: {error.message}") from error
            log.info("%s %s: %d bytes, loaded in %.0f ms", flag, name, entry.adapter.nbytes, load_ms)
        cached = {entry.adapter.name for entry in self.cache.entries()}
        pushed_out = [name for name in names if name not in cached]
        if pushed_out:
            raise StartupError(
                f"--preload {shorten(','.join(pushed_out))!r}: the preloaded adapters do not fit in the adapter "
                f"cache together ({self.cache.budget_bytes} bytes, --adapter-cache-bytes); preload fewer or "
                "raise the budget"
            )

    def _public(self, name: str) -> str:
        """A configured adapter's public name; a URL's link is kept for the fetcher (`_configured_links`)."""
        identity = public_name(name)
        if is_url_name(name):
            self._configured_links[identity] = name
        return identity

    # -- a request's stack ------------------------------------------------------------------------------

    def start_loads(self, params: GenerationParams, links: Mapping[str, str]) -> list[Load]:
        """For each of the request's adapters, its cache entry's future and whether it was cached; loads start now.

        Names are checked first (a URL against the hosts this server may fetch from), so that a malformed or
        refused one is refused before anything says "loading". `links`: the full URLs of URL adapters.
        """
        for applied in params.adapters:
            self._sources.check(applied.adapter)
        return [self.cache.get_or_load(applied.adapter, links.get(applied.adapter)) for applied in params.adapters]

    async def download_progress(self, urls: list[str], stacking: asyncio.Future) -> AsyncIterator[Queued]:
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

    async def stack(
        self, params: GenerationParams, loads: list[Load]
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
        if len(stack) > 1 and not self._config.fuses:  # a fused stack is not bounded by the slot's width
            check_stack_fits((adapter for adapter, _ in stack), self._config.max_rank)
        # Each adapter fits the model's range at strength 1 (checked when it loaded); these strengths may not.
        refuse_strengths([(adapter.effects, scale) for adapter, scale in stack], self._slot_spec.dtype)
        if len(stack) > 1:
            # The members' content keys order the stack (residency.stack_order): digests of torch tensors, made on
            # a loader thread (once per adapter) rather than on the event loop that queues the job.
            await asyncio.get_running_loop().run_in_executor(
                self._loader_pool, lambda: [adapter.content_key for adapter, _ in stack]
            )
        for applied in params.adapters:
            self.cache.record_use(applied.adapter)
        return tuple(stack), load_ms, warnings

    # -- one adapter ------------------------------------------------------------------------------------

    def _load_adapter(self, name: str, link: str | None = None) -> CanonicalAdapter:
        """Resolve (a URL adapter from `link`, its full URL), read, convert and validate; runs on a loader thread."""
        if self._slot_spec is None:
            raise NotServingError("the server is still starting; retry")
        found = self._sources.resolve(name, link)
        with self._sources.holding(found):  # a downloaded file that is no usable adapter does not stay on disk
            return load_canonical(found, self._slot_spec, self.base_models)

    async def _cached(self, name: str, link: str | None = None) -> tuple[CacheEntry, float]:
        return await _entry(*self.cache.get_or_load(name, link))

    async def preload(self, name: str, link: str | None = None) -> PreloadResult:
        """Make an adapter ready in the cache; idempotent. `link`: a URL adapter's full URL (`name` its identity)."""
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
        return self.cache.evict(name)

    def summary(self) -> AdapterCacheSummary:
        """The cached adapters, most recently used first."""
        return AdapterCacheSummary(
            adapters=tuple(self._summary(entry.adapter.name, entry) for entry in self.cache.entries()),
            cache_bytes=self.cache.total_bytes,
            cache_budget_bytes=self.cache.budget_bytes,
        )

    def _summary(self, name: str, entry: CacheEntry) -> AdapterSummary:
        adapter = entry.adapter
        # The worker's last snapshot: the event loop never reads the slot itself.
        resident = any(adapter is member for member in self._resident())
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
            pinned=self.cache.is_pinned(name),
            kinds=adapter.kinds,
            component_layers=adapter.layers_per_component(denoiser),
            must_fuse=not adapter.fits_slot,
        )


async def _entry(future: Future, hit: bool) -> tuple[CacheEntry, float]:
    """The cache entry a get_or_load future gives, and the ms its load took (0 when it was cached)."""
    # Shielded: a caller that goes away (a cancelled Generate) must not cancel a load that others share; the
    # failure of a load nobody waits for any more is retrieved, not logged as lost.
    shared = asyncio.wrap_future(future)
    shared.add_done_callback(lambda done: done.cancelled() or done.exception())
    entry = await asyncio.shield(shared)
    return entry, 0.0 if hit else entry.adapter.download_ms + entry.adapter.load_ms
