"""grpcurl-style use: a client that knows only server reflection lists the service and calls Generate."""

from __future__ import annotations

import base64
import io
import json

import grpc
import pytest
from google.protobuf import descriptor_pool, json_format, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from PIL import Image

from tests.support.servers import address_of

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_reflection_only_client_lists_and_generates(flux_server):
    def call() -> tuple[list[str], list[dict]]:
        # A sync channel, like grpcurl: no generated code, only reflection and JSON.
        with grpc.insecure_channel(address_of(flux_server)) as channel:
            database = ProtoReflectionDescriptorDatabase(channel)
            services = list(database.get_services())
            pool = descriptor_pool.DescriptorPool(database)
            service = pool.FindServiceByName("loraswap.v1.DiffusionService")
            method = service.methods_by_name["Generate"]
            request_class = message_factory.GetMessageClass(method.input_type)
            response_class = message_factory.GetMessageClass(method.output_type)
            request = json_format.Parse(
                json.dumps({"prompt": "a red circle", "numInferenceSteps": 2, "seed": "9", "adapter": "r4-attn"}),
                request_class(),
            )
            stream = channel.unary_stream(
                f"/{service.full_name}/{method.name}",
                request_serializer=request_class.SerializeToString,
                response_deserializer=response_class.FromString,
            )
            events = [json_format.MessageToDict(response) for response in stream(request, timeout=60)]
            return services, events

    import asyncio

    services, events = await asyncio.to_thread(call)
    assert "loraswap.v1.DiffusionService" in services
    assert "grpc.health.v1.Health" in services
    assert [event["progress"]["step"] for event in events if "progress" in event] == [1, 2]
    image = events[-1]["image"]
    assert image["mimeType"] == "image/png" and image["adapter"] == "r4-attn" and image["seed"] == "9"
    assert Image.open(io.BytesIO(base64.b64decode(image["data"]))).size == (64, 64)


async def test_health_reports_serving(flux_server):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with grpc.aio.insecure_channel(address_of(flux_server)) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "loraswap.v1.DiffusionService"):
            response = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert response.status == health_pb2.HealthCheckResponse.SERVING
