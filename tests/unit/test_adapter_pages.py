"""ListAdapters pages (transport/convert.py): page sizes, the 4 MiB a response may be, and page tokens."""

from __future__ import annotations

import base64

import pytest

from loraswap.client.events import AdapterList
from loraswap.server.engine.errors import InvalidRequestError
from loraswap.server.engine.types import AdapterCacheSummary, AdapterSummary
from loraswap.server.transport.convert import adapter_page_to_pb
from loraswap.v1 import diffusion_service_pb2 as pb

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
    under it, and the pages list every adapter once, in order."""
    cache = _cache(600, FLUX_LAYERS)
    assert len(FLUX_LAYERS) == 418
    pages = _all_pages(cache, 0)
    assert len(pages) == 3
    assert all(page.ByteSize() < MAX_SEND_MESSAGE_BYTES for page in pages)
    assert sum(page.ByteSize() for page in pages) > 2 * MAX_SEND_MESSAGE_BYTES
    assert [a.id for page in pages for a in page.adapters] == [a.id for a in cache.adapters]
    assert all(page.cache_bytes == cache.cache_bytes for page in pages)
    assert pages[-1].next_page_token == ""


def test_without_a_page_size_everything_that_fits_one_response_comes_in_one_page() -> None:
    """A client that knows nothing of pages (page_size 0, the token ignored) loses nothing that one response
    could hold: 5000 small adapters in one page."""
    page = adapter_page_to_pb(_cache(5000), 0, "")
    assert len(page.adapters) == 5000 and page.next_page_token == ""


@pytest.mark.parametrize("page_size", [1, 7, 100])
def test_a_page_size_is_followed_to_the_end(page_size: int) -> None:
    cache = _cache(250)
    pages = _all_pages(cache, page_size)
    assert [len(page.adapters) for page in pages[:-1]] == [page_size] * (len(pages) - 1)
    assert [a.id for page in pages for a in page.adapters] == [a.id for a in cache.adapters]


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
        base64.urlsafe_b64encode(b"adapters:3").decode(),
        base64.urlsafe_b64encode(b"adapters:0123456789abcdef:3").decode(),  # another process's
        base64.urlsafe_b64encode(b"something:3").decode(),
        base64.urlsafe_b64encode("adapters:３".encode()).decode(),
        "é",
    ],
)
def test_a_token_the_server_did_not_make_is_refused_naming_the_field(token: str) -> None:
    with pytest.raises(InvalidRequestError, match="is not one this server process made") as refused:
        adapter_page_to_pb(_cache(3), 0, token)
    assert refused.value.metadata == {"field": "page_token"}


def test_a_token_of_this_process_with_a_bad_offset_is_refused() -> None:
    token = adapter_page_to_pb(_cache(10), 5, "").next_page_token
    made = base64.urlsafe_b64decode(token).decode()
    for offset in ("-1", "1234567890"):
        forged = base64.urlsafe_b64encode(made.rsplit(":", 1)[0].encode() + f":{offset}".encode()).decode()
        with pytest.raises(InvalidRequestError, match="is not one this server process made"):
            adapter_page_to_pb(_cache(10), 5, forged)


def test_the_client_joins_pages_keeping_an_adapter_that_moved_where_it_came_first() -> None:
    """What the Python client does with the pages: b was used between two calls and moved to the front, so the
    second page lists it again; it stays where it came first, and the cache's figures are the newest page's."""

    def page(*ids: str, cache_bytes: int) -> pb.ListAdaptersResponse:
        return pb.ListAdaptersResponse(
            adapters=[pb.AdapterInfo(id=i) for i in ids], cache_bytes=cache_bytes, cache_budget_bytes=9
        )

    joined = AdapterList.from_pages([page("a", "b", cache_bytes=1), page("b", "c", cache_bytes=2)])
    assert [a.id for a in joined.adapters] == ["a", "b", "c"]
    assert (joined.cache_bytes, joined.cache_budget_bytes) == (2, 9)
