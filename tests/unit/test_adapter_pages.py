"""ListAdapters pages (transport/convert.py): page sizes, the 4 MiB a response may be, and page tokens."""

from __future__ import annotations

import base64

import pytest

from loraswap.server.engine.errors import InvalidRequestError
from loraswap.server.engine.types import AdapterCacheSummary, AdapterSummary
from loraswap.server.transport.convert import ADAPTER_PAGE_DEFAULT, ADAPTER_PAGE_MAX, adapter_page_to_pb

MAX_SEND_MESSAGE_BYTES = 4 * 1024 * 1024  # loraswap.server.app's cap on any response
# Like a full-depth Flux adapter on all its default layers: some 420 module paths of about 40 characters.
FLUX_LAYERS = tuple(f"single_transformer_blocks.{block}.attn.to_{p}" for block in range(38) for p in "qkv") + tuple(
    f"transformer_blocks.{block}.ff_context.net.{i}.proj" for block in range(19) for i in range(16)
)


def _cache(count: int, layers: tuple[str, ...] = ("to_q",)) -> AdapterCacheSummary:
    adapters = tuple(
        AdapterSummary(f"user/style-{i:05d}", 4, layers, 1000, f"user/style-{i:05d}.safetensors", i, i, False, 1.0)
        for i in range(count)
    )
    return AdapterCacheSummary(adapters=adapters, cache_bytes=1000 * count, cache_budget_bytes=10**12)


def _all_pages(cache: AdapterCacheSummary, page_size: int) -> list:
    pages = [adapter_page_to_pb(cache, page_size, "")]
    while pages[-1].next_page_token:
        pages.append(adapter_page_to_pb(cache, page_size, pages[-1].next_page_token))
        assert len(pages) <= len(cache.adapters) + 1, "the pages do not end"
    return pages


def test_pages_stay_under_the_send_cap_where_one_response_would_not() -> None:
    """600 cached Flux adapters listed in one message would be ~11 MiB, past the 4 MiB cap: each page stays
    under it, whatever page_size asks, and the pages list every adapter once, in order."""
    cache = _cache(600, FLUX_LAYERS)
    assert len(FLUX_LAYERS) == 418
    whole = adapter_page_to_pb(cache, ADAPTER_PAGE_MAX, "")
    pages = _all_pages(cache, ADAPTER_PAGE_MAX)
    assert len(pages) > 3
    assert all(page.ByteSize() < MAX_SEND_MESSAGE_BYTES for page in pages)
    assert sum(len(page.adapters) for page in pages) * whole.adapters[0].ByteSize() > 2 * MAX_SEND_MESSAGE_BYTES
    assert [a.id for page in pages for a in page.adapters] == [a.id for a in cache.adapters]
    assert all(page.cache_bytes == cache.cache_bytes for page in pages)
    assert pages[-1].next_page_token == ""


@pytest.mark.parametrize(("page_size", "expected"), [(0, ADAPTER_PAGE_DEFAULT), (7, 7), (5000, ADAPTER_PAGE_MAX)])
def test_page_size_zero_means_as_many_as_a_page_holds_and_large_ones_are_capped(page_size: int, expected: int) -> None:
    cache = _cache(1500)
    first = adapter_page_to_pb(cache, page_size, "")
    assert len(first.adapters) == expected
    assert ADAPTER_PAGE_DEFAULT == ADAPTER_PAGE_MAX == 1000  # a client that sends no page_size loses nothing small
    assert [a.id for page in _all_pages(cache, page_size) for a in page.adapters] == [a.id for a in cache.adapters]


def test_a_small_cache_is_one_page_without_a_token() -> None:
    page = adapter_page_to_pb(_cache(3), 0, "")
    assert len(page.adapters) == 3 and page.next_page_token == ""


def test_a_token_past_the_end_of_a_cache_that_shrank_gives_an_empty_last_page() -> None:
    token = adapter_page_to_pb(_cache(10), 5, "").next_page_token
    page = adapter_page_to_pb(_cache(3), 5, token)
    assert list(page.adapters) == [] and page.next_page_token == ""


def test_a_negative_page_size_is_refused_naming_the_field() -> None:
    with pytest.raises(InvalidRequestError, match="page_size -1 is negative") as refused:
        adapter_page_to_pb(_cache(3), -1, "")
    assert refused.value.metadata == {"field": "page_size"}


@pytest.mark.parametrize(
    "token",
    [
        "not base64 at all!",
        base64.urlsafe_b64encode(b"adapters:-1").decode(),
        base64.urlsafe_b64encode(b"adapters:12345678901").decode(),
        base64.urlsafe_b64encode(b"something:3").decode(),
        base64.urlsafe_b64encode("adapters:３".encode()).decode(),
        "é",
    ],
)
def test_a_token_the_server_did_not_make_is_refused_naming_the_field(token: str) -> None:
    with pytest.raises(InvalidRequestError, match="is not one this server made") as refused:
        adapter_page_to_pb(_cache(3), 0, token)
    assert refused.value.metadata == {"field": "page_token"}
