"""Host-memory cache of canonical adapters under a byte budget, least recently used out first.

Loading is single-flight: concurrent requests for the same uncached adapter
share one load. Evicting only drops the cache's reference, so a generation
that already holds the adapter keeps using it until it ends.

An entry owns its bytes: they were read from the file once, validated, and are
never read from the file again. A file changed or removed on disk does not
touch the cached adapter; it is served as validated until it leaves the cache
(Evict, or the byte budget), and the next use reads and validates the file anew.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field

from loraswap.server.engine.adapters.canonical import CanonicalAdapter
from loraswap.server.engine.errors import AdapterNotFoundError, AdapterTooLargeError, shorten


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

    def __init__(self, budget_bytes: int, loader: Callable[[str], CanonicalAdapter], executor: Executor) -> None:
        self.budget_bytes = budget_bytes
        self._loader = loader
        self._executor = executor
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, CacheEntry] = OrderedDict()
        self._loading: dict[str, Future] = {}

    def get_or_load(self, name: str) -> tuple[Future, bool]:
        """A future of the entry for `name`, and whether it was already cached (no load needed)."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is not None:
                self._entries.move_to_end(name)
                entry.touch()
                done: Future = Future()
                done.set_result(entry)
                return done, True
            pending = self._loading.get(name)
            if pending is None:
                pending = self._executor.submit(self._load, name)
                self._loading[name] = pending
            return pending, False

    def _load(self, name: str) -> CacheEntry:
        try:
            adapter = self._loader(name)
            if self.budget_bytes and adapter.nbytes > self.budget_bytes:
                raise AdapterTooLargeError(
                    f"adapter {shorten(name)!r} takes {adapter.nbytes} bytes in canonical form, more than the whole "
                    f"adapter cache ({self.budget_bytes} bytes, --adapter-cache-bytes)",
                    adapter_bytes=adapter.nbytes,
                    budget_bytes=self.budget_bytes,
                )
            entry = CacheEntry(adapter)
            with self._lock:
                self._entries[name] = entry
                self._entries.move_to_end(name)
                self._shrink_to_budget(keep=name)
            return entry
        finally:
            with self._lock:
                self._loading.pop(name, None)

    def _shrink_to_budget(self, keep: str) -> None:
        total = sum(entry.adapter.nbytes for entry in self._entries.values())
        for name in list(self._entries):
            if not self.budget_bytes or total <= self.budget_bytes:
                break
            if name == keep:
                continue
            total -= self._entries.pop(name).adapter.nbytes

    def record_use(self, name: str) -> None:
        """Count a generation that used `name`."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is not None:
                entry.hits += 1
                entry.touch()
                self._entries.move_to_end(name)

    def evict(self, name: str) -> int:
        """Drop `name`; returns the bytes freed. AdapterNotFoundError when it is not cached."""
        with self._lock:
            entry = self._entries.pop(name, None)
        if entry is None:
            raise AdapterNotFoundError(
                f"adapter {shorten(name)!r} is not in the cache; ListAdapters shows what is cached", adapter=name
            )
        return entry.adapter.nbytes

    def entries(self) -> list[CacheEntry]:
        """Cached entries, most recently used first."""
        with self._lock:
            return list(reversed(self._entries.values()))

    @property
    def total_bytes(self) -> int:
        with self._lock:
            return sum(entry.adapter.nbytes for entry in self._entries.values())
