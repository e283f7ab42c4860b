"""The client's tests run against test doubles of DiffusionService; only the client distribution is needed here.

Each test module defines a `service` fixture (its double); `target` serves it on a port the OS picks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from loraswap.v1 import diffusion_service_pb2_grpc as pb_grpc


@pytest.fixture
async def target(service: pb_grpc.DiffusionServiceServicer) -> AsyncIterator[str]:
    """The module's `service` served on a real grpc.aio server on port 0: the address to connect to."""
    server = grpc.aio.server()
    pb_grpc.add_DiffusionServiceServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{port}"
    await server.stop(None)
