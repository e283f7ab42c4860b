"""ListAdapters a page at a time on a real server (tiny Flux, its test adapters preloaded), through raw stubs
as any gRPC stack would call it, and through the Python client, which follows the pages."""

from __future__ import annotations

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from loraswap.v1 import diffusion_service_pb2 as pb
from loraswap.v1 import diffusion_service_pb2_grpc as pb_grpc
from tests.support.adapters import FLUX_ADAPTERS
from tests.support.servers import address_of, client_of

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest.fixture
async def stub(flux_server):
    async with grpc.aio.insecure_channel(address_of(flux_server)) as channel:
        stub = pb_grpc.DiffusionServiceStub(channel)
        for name in FLUX_ADAPTERS:
            await stub.PreloadAdapter(pb.PreloadAdapterRequest(adapter=name), timeout=60)
        yield stub


def _field_and_reason(error: grpc.aio.AioRpcError) -> tuple[str, str]:
    for detail in rpc_status.from_call(error).details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return info.metadata.get("field", ""), info.reason
    return "", ""


async def test_pages_of_one_list_the_whole_cache_in_order(stub) -> None:
    whole = await stub.ListAdapters(pb.ListAdaptersRequest(), timeout=30)
    assert whole.next_page_token == "" and set(FLUX_ADAPTERS) <= {a.id for a in whole.adapters}
    pages = [await stub.ListAdapters(pb.ListAdaptersRequest(page_size=1), timeout=30)]
    while pages[-1].next_page_token:
        request = pb.ListAdaptersRequest(page_size=1, page_token=pages[-1].next_page_token)
        pages.append(await stub.ListAdapters(request, timeout=30))
    assert all(len(page.adapters) == 1 for page in pages)
    assert [page.adapters[0].id for page in pages] == [a.id for a in whole.adapters]
    assert all(page.cache_bytes == whole.cache_bytes for page in pages)


async def test_the_client_follows_the_pages(flux_server, stub, monkeypatch) -> None:
    """With pages made to hold one adapter each (the byte cap lowered in this in-process server), the client
    still lists the whole cache, in order."""
    from loraswap.server.transport import convert

    whole = await stub.ListAdapters(pb.ListAdaptersRequest(), timeout=30)
    monkeypatch.setattr(convert, "ADAPTER_PAGE_BYTES", 1)
    first = await stub.ListAdapters(pb.ListAdaptersRequest(), timeout=30)
    assert len(first.adapters) == 1 and first.next_page_token, "pages should hold one adapter each here"
    async with client_of(flux_server) as client:
        listing = await client.list_adapters()
    assert [a.id for a in listing.adapters] == [a.id for a in whole.adapters]


@pytest.mark.parametrize(
    ("request_fields", "field", "hint"),
    [
        ({"page_size": -3}, "page_size", "page_size -3 is negative"),
        ({"page_token": "bm90IG91cnM="}, "page_token", "is not one this server process made"),
    ],
)
async def test_bad_paging_is_invalid_argument_naming_the_field(stub, request_fields, field, hint) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.ListAdapters(pb.ListAdaptersRequest(**request_fields), timeout=30)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert hint in refused.value.details()
    assert _field_and_reason(refused.value) == (field, "INVALID_REQUEST")
    assert (await stub.ListAdapters(pb.ListAdaptersRequest(), timeout=30)).adapters  # still serving
