"""Host-memory cache of canonical adapters under a byte budget, least recently used out first.

Loading is single-flight: concurrent requests for the same uncached adapter
share one load. Evicting only drops the cache's reference, so a generation
that already holds the adapter keeps using it until it ends.

An entry owns its bytes: they were read from the file once, validated, and are
never read from the file again. A file changed or removed on disk does not
touch the cached adapter; it is served as validated until it leaves the cache
(Evict, or the byte budget), and the next use reads and validates the file anew.

Pinned names (--pin) never leave: LRU eviction passes them over and Evict
refuses them. Their bytes count against the budget, so what they hold is not
there for the rest.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field

from loraswap.server.engine.adapters.formats import CanonicalAdapter
from loraswap.server.engine.errors import AdapterNotFoundError, AdapterPinnedError, AdapterTooLargeError, shorten
from loraswap.server.engine.observer import NO_OBSERVER, EngineObserver


@dataclass
class CacheEntry:
    """A cached adapter and its usage."""

    adapter: CanonicalAdapter
    hits: int = 0
    last_used_unix_ms: int = field(default_factory=lambda: int(time.time() * 1000))

    def touch(self) -> None:
        self.last_used_unix_ms = int(time.time() * 1000)


class AdapterCache:
    """Byte-budgeted LRU of canonical adapters with single-flight loading. Thread-safe."""

    def __init__(
        self,
        budget_bytes: int,
        loader: Callable[[str], CanonicalAdapter],
        executor: Executor,
        observer: EngineObserver = NO_OBSERVER,
        *,
        executor_for: Callable[[str], Executor] | None = None,
    ) -> None:
        """`executor_for(name)`, when given, picks the executor each name loads on (URL downloads apart)."""
        self.budget_bytes = budget_bytes
        self._observer = observer
        self._loader = loader
        self._executor_for = executor_for or (lambda name: executor)
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, CacheEntry] = OrderedDict()
        self._loading: dict[str, Future] = {}
        self._pinned: set[str] = set()

    def pin(self, name: str) -> None:
        """Keep `name` out of eviction from now on (load it with get_or_load); pins last for the cache's life."""
        with self._lock:
            self._pinned.add(name)

    def is_pinned(self, name: str) -> bool:
        with self._lock:
            return name in self._pinned

    def _pinned_bytes(self, besides: str) -> int:
        return sum(
            entry.adapter.nbytes for name, entry in self._entries.items() if name in self._pinned and name != besides
        )

    def get_or_load(self, name: str, link: str | None = None) -> tuple[Future, bool]:
        """A future of the entry for `name`, and whether it was already cached (no load needed). `link`: what the
        loader is given beside the name when a load starts (a URL adapter's full URL); a load joined ignores it."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                pending = self._loading.get(name)
                if pending is None:
                    pending = self._executor_for(name).submit(self._load, name, link)
                    # A load cancelled before it began (its callers gone, a shutdown) must not stay the name's load.
                    pending.add_done_callback(lambda done, name=name: self._forget_cancelled(name, done))
                    self._loading[name] = pending
            else:
                self._entries.move_to_end(name)
                entry.touch()
                pending = Future()
                pending.set_result(entry)
        self._observer.cache_lookup(hit=entry is not None)
        return pending, entry is not None

    def _forget_cancelled(self, name: str, done: Future) -> None:
        if done.cancelled():
            with self._lock:
                if self._loading.get(name) is done:
                    del self._loading[name]

    def _load(self, name: str, link: str | None = None) -> CacheEntry:
        try:
            adapter = self._loader(name) if link is None else self._loader(name, link)
            if self.budget_bytes and adapter.nbytes > self.budget_bytes:
                raise AdapterTooLargeError(
                    f"adapter {shorten(name)!r} takes {adapter.nbytes} bytes in canonical form, more than the whole "
                    f"adapter cache ({self.budget_bytes} bytes, --adapter-cache-bytes)",
                    adapter_bytes=adapter.nbytes,
                    budget_bytes=self.budget_bytes,
                )
            with self._lock:
                room = self.budget_bytes - self._pinned_bytes(besides=name)
            if self.budget_bytes and adapter.nbytes > room:
                raise AdapterTooLargeError(
                    f"adapter {shorten(name)!r} takes {adapter.nbytes} bytes in canonical form, more than the "
                    f"{room} bytes that pinned adapters (--pin) leave of the adapter cache ({self.budget_bytes} "
                    "bytes, --adapter-cache-bytes); pin fewer adapters or raise the budget",
                    adapter_bytes=adapter.nbytes,
                    budget_bytes=room,
                )
            entry = CacheEntry(adapter)
            with self._lock:
                self._entries[name] = entry
                self._entries.move_to_end(name)
                evicted = self._shrink_to_budget(keep=name)
            self._observer.adapter_loaded(adapter.load_ms / 1000.0)
            if evicted:
                self._observer.adapters_evicted(evicted)
            return entry
        finally:
            with self._lock:
                self._loading.pop(name, None)

    def _shrink_to_budget(self, keep: str) -> int:
        """Drop the least recently used entries (never `keep` or a pinned one) to fit the budget; how many went."""
        total = sum(entry.adapter.nbytes for entry in self._entries.values())
        evicted = 0
        for name in list(self._entries):
            if not self.budget_bytes or total <= self.budget_bytes:
                break
            if name == keep or name in self._pinned:
                continue
            total -= self._entries.pop(name).adapter.nbytes
            evicted += 1
        return evicted

    @property
    def loads_under_way(self) -> int:
        """Loads begun or queued and not yet ended (a download among them)."""
        with self._lock:
            return len(self._loading)

    def record_use(self, name: str) -> None:
        """Count a generation that used `name`."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is not None:
                entry.hits += 1
                entry.touch()
                self._entries.move_to_end(name)

    def evict(self, name: str) -> int:
        """Drop `name`; returns the bytes freed. AdapterNotFoundError when it is not cached, AdapterPinnedError when
        it is pinned (it stays)."""
        with self._lock:
            if name in self._pinned:
                raise AdapterPinnedError(
                    f"adapter {shorten(name)!r} is pinned (--pin) and stays cached; restart the server without "
                    "pinning it to make it evictable",
                    adapter=name,
                )
            entry = self._entries.pop(name, None)
        if entry is None:
            raise AdapterNotFoundError(
                f"adapter {shorten(name)!r} is not in the cache; ListAdapters shows what is cached", adapter=name
            )
        self._observer.adapters_evicted(1)
        return entry.adapter.nbytes

    def entries(self) -> list[CacheEntry]:
        """Cached entries, most recently used first."""
        with self._lock:
            return list(reversed(self._entries.values()))

    @property
    def total_bytes(self) -> int:
        with self._lock:
            return sum(entry.adapter.nbytes for entry in self._entries.values())
