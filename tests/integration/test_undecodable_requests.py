"""Bytes that are not a valid request message end as INVALID_ARGUMENT (reason INVALID_REQUEST), not UNKNOWN from
the gRPC layer, and the server keeps serving. Raw bytes go over a real channel with no serializer at all."""

from __future__ import annotations

import grpc
import pytest

from loraswap.client import error_from_rpc
from loraswap.v1 import diffusion_service_pb2 as pb
from tests.support.servers import address_of

pytestmark = pytest.mark.asyncio(loop_scope="session")

# field 1 (prompt / adapter) as a length-delimited string
NOT_UTF8 = b"\x0a\x04a\xff\xfeb"
TRUNCATED = b"\x0a\x09ab"  # says 9 bytes follow; 2 do
BAD_WIRE_TYPE = b"\x0f"  # field 1 with wire type 7, which does not exist

CASES = [
    ("Generate", "GenerateRequest", NOT_UTF8, "UTF-8"),
    ("Generate", "GenerateRequest", TRUNCATED, "GenerateRequest"),
    ("Generate", "GenerateRequest", BAD_WIRE_TYPE, "GenerateRequest"),
    ("PreloadAdapter", "PreloadAdapterRequest", NOT_UTF8, "UTF-8"),
    ("Evict", "EvictRequest", TRUNCATED, "EvictRequest"),
]


@pytest.mark.parametrize(("rpc", "message", "raw", "hint"), CASES, ids=lambda value: str(value)[:20])
async def test_undecodable_bytes_are_invalid_argument(flux_server, rpc: str, message: str, raw: bytes, hint: str):
    async with grpc.aio.insecure_channel(address_of(flux_server)) as channel:
        method = f"/loraswap.v1.DiffusionService/{rpc}"
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            if rpc == "Generate":
                async for _ in channel.unary_stream(method)(raw, timeout=30):
                    pass
            else:
                await channel.unary_unary(method)(raw, timeout=30)
        error = error_from_rpc(raised.value)
        assert (error.code, error.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST")
        assert f"loraswap.v1.{message}" in error.message and hint in error.message

        # The server keeps serving, on the same connection.
        info = await channel.unary_unary(
            "/loraswap.v1.DiffusionService/GetServerInfo",
            request_serializer=pb.GetServerInfoRequest.SerializeToString,
            response_deserializer=pb.GetServerInfoResponse.FromString,
        )(pb.GetServerInfoRequest(), timeout=30)
        assert info.model == "tiny-flux"
