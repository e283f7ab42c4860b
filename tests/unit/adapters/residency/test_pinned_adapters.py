"""Pinned adapters (--pin) in the AdapterCache: LRU passes them over, Evict refuses them, their bytes count.

The loader is injected (tests/support/cache_loaders.py): real CanonicalAdapter objects of exact byte sizes.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from loraswap.server.engine.adapters.residency import AdapterCache
from loraswap.server.engine.errors import AdapterPinnedError, AdapterTooLargeError, ErrorReason
from tests.support.cache_loaders import CountingLoader, cached_names, loaded


@pytest.fixture
def executor():
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield pool


def test_lru_eviction_passes_over_a_pinned_adapter(executor) -> None:
    cache = AdapterCache(100, CountingLoader({"pinned": 40, "a": 40, "b": 40}), executor)
    cache.pin("pinned")
    for name in ("pinned", "a", "b"):  # b pushes out the least recently used unpinned one: a, not pinned
        loaded(cache, name)
    assert cached_names(cache) == ["b", "pinned"]
    assert cache.is_pinned("pinned") and not cache.is_pinned("b")


def test_evict_refuses_a_pinned_adapter_and_keeps_it(executor) -> None:
    cache = AdapterCache(100, CountingLoader({"pinned": 40, "a": 40}), executor)
    cache.pin("pinned")
    loaded(cache, "pinned")
    loaded(cache, "a")
    with pytest.raises(AdapterPinnedError) as refused:
        cache.evict("pinned")
    assert refused.value.reason is ErrorReason.ADAPTER_PINNED
    assert refused.value.metadata == {"adapter": "pinned"} and "--pin" in refused.value.message
    assert set(cached_names(cache)) == {"pinned", "a"}
    assert cache.evict("a") == 40


def test_pinned_bytes_count_against_the_budget(executor) -> None:
    cache = AdapterCache(100, CountingLoader({"pinned": 64, "fits": 32, "too-big": 48}), executor)
    cache.pin("pinned")
    loaded(cache, "pinned")
    with pytest.raises(AdapterTooLargeError) as refused:  # 48 <= 100, but only 36 are left beside the pin
        loaded(cache, "too-big")
    assert refused.value.metadata["budget_bytes"] == "36" and "--pin" in refused.value.message
    loaded(cache, "fits")
    assert set(cached_names(cache)) == {"pinned", "fits"} and cache.total_bytes == 96
