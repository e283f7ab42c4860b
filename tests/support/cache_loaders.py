"""A counting loader for AdapterCache tests: real CanonicalAdapter objects of exact byte sizes, from small tensors."""

from __future__ import annotations

import threading
import time
from collections import Counter

import torch

from loraswap.server.engine.adapters.formats import CanonicalAdapter, CanonicalLayer
from loraswap.server.engine.adapters.residency import AdapterCache
from loraswap.server.engine.errors import AdapterFormatError

WAIT_S = 10


def sized_adapter(name: str, nbytes: int) -> CanonicalAdapter:
    """An adapter of exactly `nbytes` (a multiple of 8): one rank-1 float32 layer."""
    width = nbytes // 8
    layer = CanonicalLayer(a=torch.zeros(1, width), b=torch.zeros(width, 1))
    return CanonicalAdapter(name=name, source=f"test://{name}", layers={"layer": layer}, warnings=(), load_ms=0.0)


class CountingLoader:
    """Builds the adapter of the size given for its name; counts calls; optional delay and failures."""

    def __init__(self, sizes: dict[str, int], delay_s: float = 0.0, failures: int = 0) -> None:
        self.sizes = sizes
        self.delay_s = delay_s
        self.failures_left = failures
        self.calls: Counter[str] = Counter()
        self._lock = threading.Lock()

    def __call__(self, name: str) -> CanonicalAdapter:
        with self._lock:
            self.calls[name] += 1
            fail = self.failures_left > 0
            self.failures_left -= 1
        time.sleep(self.delay_s)
        if fail:
            raise AdapterFormatError(f"{name} is broken this time")
        return sized_adapter(name, self.sizes[name])


def loaded(cache: AdapterCache, name: str):
    """The cache's entry for `name`, loaded first if it is not cached (waits up to WAIT_S)."""
    future, _ = cache.get_or_load(name)
    return future.result(timeout=WAIT_S)


def cached_names(cache: AdapterCache) -> list[str]:
    """The cached adapters' names, in the cache's order."""
    return [entry.adapter.name for entry in cache.entries()]
