"""The Python client names the adapter in the `lora` call metadata on every call that names one.

A recording server stands in for loraswap (only the client is under test here):
it keeps each call's metadata and answers the smallest valid response.
"""

from __future__ import annotations

import pytest

from loraswap.client import AsyncLoraswapClient
from loraswap.v1 import diffusion_service_pb2 as pb
from loraswap.v1 import diffusion_service_pb2_grpc as pb_grpc


class RecordingService(pb_grpc.DiffusionServiceServicer):
    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, str]]] = []

    def _record(self, method: str, context) -> None:
        self.seen.append((method, dict(context.invocation_metadata())))

    async def Generate(self, request, context):
        self._record("Generate", context)
        yield pb.GenerateResponse(image=pb.Image(data=b"\x89PNG", mime_type="image/png", width=1, height=1))

    async def PreloadAdapter(self, request, context):
        self._record("PreloadAdapter", context)
        return pb.PreloadAdapterResponse(adapter=pb.AdapterInfo(id=request.adapter))

    async def Evict(self, request, context):
        self._record("Evict", context)
        return pb.EvictResponse(freed_bytes=1)

    async def ListAdapters(self, request, context):
        self._record("ListAdapters", context)
        return pb.ListAdaptersResponse()


@pytest.fixture
async def service() -> RecordingService:
    return RecordingService()


async def test_every_call_naming_an_adapter_sends_lora(target: str, service: RecordingService) -> None:
    async with AsyncLoraswapClient(target, default_timeout=10, token="t" * 20) as client:
        await client.generate_image("p", adapter="ink")
        await client.generate_image("p", adapters=[("ink", 0.8), ("paper", 0.5)])
        await client.generate_image("p")
        # A stack entry naming no adapter: no lora at all (a partial one would disagree with the request's fields,
        # and the server should refuse the empty entry itself).
        await client.generate_image("p", adapters=[("ink", 0.8), ("", 0.5)])
        await client.preload_adapter("ink")
        await client.evict("ink")
        await client.list_adapters()
    lora = [(method, metadata.get("lora")) for method, metadata in service.seen]
    assert lora == [
        ("Generate", "ink"),
        ("Generate", "ink,paper"),
        ("Generate", None),
        ("Generate", None),
        ("PreloadAdapter", "ink"),
        ("Evict", "ink"),
        ("ListAdapters", None),
    ]
    assert all(metadata.get("authorization") == "Bearer " + "t" * 20 for _, metadata in service.seen)
