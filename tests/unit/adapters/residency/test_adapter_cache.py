"""AdapterCache: byte-budget LRU, single-flight loading, and what happens when a load fails.

The loader is injected (tests/support/cache_loaders.py), so the adapters here are real CanonicalAdapter objects
of exact byte sizes built from small tensors, handed out by a counting loader.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from loraswap.server.engine.adapters.formats import CanonicalAdapter
from loraswap.server.engine.adapters.residency import AdapterCache
from loraswap.server.engine.errors import AdapterFormatError, AdapterNotFoundError, AdapterTooLargeError
from tests.support.cache_loaders import WAIT_S, CountingLoader, cached_names, loaded, sized_adapter

torch.set_num_threads(1)


@pytest.fixture
def executor():
    with ThreadPoolExecutor(max_workers=4) as pool:
        yield pool


@pytest.mark.parametrize(
    ("budget", "sizes", "steps", "expected"),
    [
        # load a, b, c at 40 bytes each in 100: the least recently used (a) goes
        (100, {"a": 40, "b": 40, "c": 40}, ["a", "b", "c"], ["c", "b"]),
        # a hit touches a, so b is the least recently used when c arrives
        (100, {"a": 40, "b": 40, "c": 40}, ["a", "b", "a", "c"], ["c", "a"]),
        # record_use touches too
        (100, {"a": 40, "b": 40, "c": 40}, ["a", "b", "use:a", "c"], ["c", "a"]),
        # a big newcomer evicts as many as it takes, oldest first
        (100, {"a": 40, "b": 40, "c": 80}, ["a", "b", "c"], ["c"]),
        (100, {"a": 16, "b": 40, "c": 40, "d": 56}, ["a", "b", "c", "d"], ["d", "c"]),
        # exactly at the budget is within it
        (80, {"a": 40, "b": 40}, ["a", "b"], ["b", "a"]),
        # an evicted adapter comes back as the most recent, pushing out the oldest
        (100, {"a": 40, "b": 40, "c": 40}, ["a", "b", "c", "a"], ["a", "c"]),
        # budget 0: no limit
        (0, {"a": 4000, "b": 4000, "c": 4000}, ["a", "b", "c"], ["c", "b", "a"]),
    ],
)
def test_lru_under_byte_budget(executor, budget: int, sizes: dict, steps: list[str], expected: list[str]) -> None:
    cache = AdapterCache(budget, CountingLoader(sizes), executor)
    for step in steps:
        if step.startswith("use:"):
            cache.record_use(step.removeprefix("use:"))
        else:
            assert loaded(cache, step).adapter.name == step
    assert cached_names(cache) == expected
    assert cache.total_bytes == sum(sizes[name] for name in expected)


def test_hit_needs_no_load_and_counts_use(executor) -> None:
    loader = CountingLoader({"a": 40})
    cache = AdapterCache(100, loader, executor)
    first, cached = cache.get_or_load("a")
    assert cached is False
    entry = first.result(timeout=WAIT_S)
    again, cached = cache.get_or_load("a")
    assert cached is True
    assert again.result(timeout=0) is entry
    cache.record_use("a")
    cache.record_use("a")
    cache.record_use("never-loaded")  # no entry: ignored, not created
    assert loader.calls == {"a": 1}
    assert entry.hits == 2
    assert cached_names(cache) == ["a"]


def test_evict_returns_bytes_and_refuses_absent(executor) -> None:
    loader = CountingLoader({"a": 40, "b": 24})
    cache = AdapterCache(100, loader, executor)
    held = loaded(cache, "a")
    loaded(cache, "b")
    assert cache.evict("a") == 40
    assert cached_names(cache) == ["b"]
    assert cache.total_bytes == 24
    assert held.adapter.nbytes == 40  # whoever holds the entry keeps a usable adapter
    with pytest.raises(AdapterNotFoundError) as raised:
        cache.evict("a")
    assert raised.value.reason == "ADAPTER_NOT_FOUND"
    assert raised.value.metadata == {"adapter": "a"}
    with pytest.raises(AdapterNotFoundError):
        cache.evict("never-loaded")
    loaded(cache, "a")
    assert loader.calls == {"a": 2, "b": 1}  # evicted means loaded again next time


def test_adapter_bigger_than_the_budget_is_refused_and_evicts_nothing(executor) -> None:
    loader = CountingLoader({"small": 40, "huge": 104})
    cache = AdapterCache(100, loader, executor)
    loaded(cache, "small")
    future, _ = cache.get_or_load("huge")
    error = future.exception(timeout=WAIT_S)
    assert type(error) is AdapterTooLargeError
    assert error.reason == "ADAPTER_TOO_LARGE"
    assert error.metadata == {"adapter_bytes": "104", "budget_bytes": "100"}
    assert cached_names(cache) == ["small"]
    with pytest.raises(AdapterTooLargeError):
        loaded(cache, "huge")
    assert loader.calls["huge"] == 2  # refused, not cached: each ask loads again


def test_single_flight(executor) -> None:
    loader = CountingLoader({"shared": 40}, delay_s=0.2)
    cache = AdapterCache(100, loader, executor)
    barrier = threading.Barrier(8)
    results = []
    results_lock = threading.Lock()

    def ask() -> None:
        barrier.wait()
        future, cached = cache.get_or_load("shared")
        entry = future.result(timeout=WAIT_S)
        with results_lock:
            results.append((entry, cached))

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=WAIT_S)
    assert len(results) == 8
    assert loader.calls == {"shared": 1}
    assert len({id(entry) for entry, _ in results}) == 1
    assert [cached for _, cached in results] == [False] * 8  # all asked while the one load ran


def test_different_names_load_concurrently(executor) -> None:
    """Single-flight is per name: three names load side by side (each load waits for the other two)."""
    together = threading.Barrier(3, timeout=WAIT_S)

    def loader(name: str) -> CanonicalAdapter:
        together.wait()  # BrokenBarrierError unless all three loads are in flight at once
        return sized_adapter(name, 8)

    cache = AdapterCache(100, loader, executor)
    futures = [cache.get_or_load(name)[0] for name in ("a", "b", "c")]
    assert {future.result(timeout=WAIT_S).adapter.name for future in futures} == {"a", "b", "c"}


def test_failed_load_is_not_cached_and_is_retried(executor) -> None:
    loader = CountingLoader({"flaky": 40}, delay_s=0.05, failures=1)
    cache = AdapterCache(100, loader, executor)
    first, _ = cache.get_or_load("flaky")
    second, _ = cache.get_or_load("flaky")  # joins the same failing load
    assert second is first
    assert type(first.exception(timeout=WAIT_S)) is AdapterFormatError
    assert cached_names(cache) == []
    entry = loaded(cache, "flaky")
    assert entry.adapter.name == "flaky"
    assert loader.calls == {"flaky": 2}
    assert cached_names(cache) == ["flaky"]
