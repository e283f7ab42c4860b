"""The adapter travels as `lora` call metadata too, so a proxy can route on it without parsing protobuf.

Raw stubs send exactly the metadata and fields each case needs, to a real server:
metadata alone names the adapter (a stack: comma-separated); metadata and fields
together must agree (a stack's members in any order), else INVALID_ARGUMENT with
reason ADAPTER_MISMATCH. The Python client sends `lora` on every call naming an
adapter (tests/client/test_lora_metadata_sent.py).
"""

from __future__ import annotations

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from loraswap.v1 import diffusion_service_pb2 as pb
from loraswap.v1 import diffusion_service_pb2_grpc as pb_grpc
from tests.support.servers import address_of

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROMPT = "a lighthouse on a cliff at dusk"


def _request(**fields) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=PROMPT, seed=5, num_inference_steps=2, width=64, height=64, **fields)


async def _image(stub, request: pb.GenerateRequest, lora: str | None) -> pb.Image:
    metadata = [("lora", lora)] if lora is not None else None
    responses = [response async for response in stub.Generate(request, metadata=metadata, timeout=120)]
    image = pb.Image()
    for response in responses:
        if response.WhichOneof("event") == "image":
            image = response.image
    assert image.data, "the stream ended without an image"
    return image


def _reason(error: grpc.aio.AioRpcError) -> str:
    status = rpc_status.from_call(error)
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return info.reason
    return ""


@pytest.fixture
async def stub(flux_server):
    async with grpc.aio.insecure_channel(address_of(flux_server)) as channel:
        yield pb_grpc.DiffusionServiceStub(channel)


async def test_metadata_alone_names_the_adapter(stub) -> None:
    by_field = await _image(stub, _request(adapter="r4-attn"), None)
    by_metadata = await _image(stub, _request(), "r4-attn")
    assert by_metadata.adapter == "r4-attn" and by_metadata.data == by_field.data


async def test_metadata_alone_names_a_stack(stub) -> None:
    stacked = _request(adapters=[pb.StackedAdapter(adapter="r4-attn"), pb.StackedAdapter(adapter="r8-context")])
    by_field = await _image(stub, stacked, None)
    by_metadata = await _image(stub, _request(), "r8-context, r4-attn")
    assert sorted(member.adapter for member in by_metadata.adapters) == ["r4-attn", "r8-context"]
    assert by_metadata.data == by_field.data


@pytest.mark.parametrize(
    ("fields", "lora"),
    [
        ({"adapter": "r4-attn"}, "r4-attn"),
        ({"adapters": [pb.StackedAdapter(adapter="r4-attn"), pb.StackedAdapter(adapter="r8-context")]},
         "r8-context,r4-attn"),
    ],
    ids=["single", "stack-any-order"],
)  # fmt: skip
async def test_field_and_metadata_that_agree_are_served(stub, fields, lora) -> None:
    assert (await _image(stub, _request(**fields), lora)).data


@pytest.mark.parametrize(
    ("fields", "lora"),
    [
        ({"adapter": "r4-attn"}, "r8-context"),
        ({"adapter": "r4-attn"}, "r4-attn,r8-context"),
        ({"adapters": [pb.StackedAdapter(adapter="r4-attn"), pb.StackedAdapter(adapter="r8-context")]}, "r4-attn"),
    ],
    ids=["other-adapter", "metadata-stack-field-single", "field-stack-metadata-single"],
)
async def test_field_and_metadata_that_disagree_are_refused(stub, fields, lora) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _image(stub, _request(**fields), lora)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert _reason(refused.value) == "ADAPTER_MISMATCH"
    assert "lora metadata" in refused.value.details()


async def test_preload_and_evict_take_the_adapter_from_metadata(stub) -> None:
    preloaded = await stub.PreloadAdapter(pb.PreloadAdapterRequest(), metadata=[("lora", "r16-mlp")], timeout=60)
    assert preloaded.adapter.id == "r16-mlp"
    evicted = await stub.Evict(pb.EvictRequest(), metadata=[("lora", "r16-mlp")], timeout=60)
    assert evicted.freed_bytes > 0
    for call, request in ((stub.PreloadAdapter, pb.PreloadAdapterRequest(adapter="r16-mlp")),
                          (stub.Evict, pb.EvictRequest(adapter="r16-mlp"))):  # fmt: skip
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call(request, metadata=[("lora", "r4-attn")], timeout=60)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert _reason(refused.value) == "ADAPTER_MISMATCH"
