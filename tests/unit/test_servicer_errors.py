"""Every RPC, unary or streaming, maps errors through the one table; tracebacks go to the log, never to clients.

A real grpc.aio server on port 0 serves DiffusionServicer over an engine double
whose every method raises what the test chose, so each RPC's error path is
exercised without a pipeline.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import pytest

from loraswap.client.errors import error_from_rpc
from loraswap.server.engine.errors import EngineError, ErrorReason, QueueFullError
from loraswap.server.engine.types import GenerationRequest, StepProgress
from loraswap.server.transport.servicer import DiffusionServicer
from loraswap.v1 import diffusion_service_pb2 as pb
from loraswap.v1 import diffusion_service_pb2_grpc as pb_grpc

SECRET = "secret-internal-detail"


class RaisingEngine:
    """Stands in for DiffusionEngine: each method raises `error`; generate first yields `steps_before_error` steps."""

    def __init__(self) -> None:
        self.error: Exception = RuntimeError(SECRET)
        self.steps_before_error = 0

    async def generate(self, request: GenerationRequest) -> AsyncIterator[StepProgress]:
        for step in range(1, self.steps_before_error + 1):
            yield StepProgress(step=step, total_steps=10, elapsed_ms=float(step))
        raise self.error

    async def preload(self, name: str, link: str | None = None):
        raise self.error

    def evict(self, name: str) -> int:
        raise self.error

    def list_adapters(self):
        raise self.error

    def describe(self):
        raise self.error


@pytest.fixture(scope="module")
def engine() -> RaisingEngine:
    return RaisingEngine()


@pytest.fixture(scope="module")
async def stub(engine: RaisingEngine) -> AsyncIterator[pb_grpc.DiffusionServiceStub]:
    server = grpc.aio.server()
    pb_grpc.add_DiffusionServiceServicer_to_server(DiffusionServicer(engine), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield pb_grpc.DiffusionServiceStub(channel)
    await server.stop(None)


async def _generate(stub: pb_grpc.DiffusionServiceStub) -> list[pb.GenerateResponse]:
    return [response async for response in stub.Generate(pb.GenerateRequest(prompt="a boat"), timeout=10)]


RPCS: dict[str, Callable[[pb_grpc.DiffusionServiceStub], Awaitable[object]]] = {
    "Generate": _generate,
    "PreloadAdapter": lambda stub: stub.PreloadAdapter(pb.PreloadAdapterRequest(adapter="ink"), timeout=10),
    "Evict": lambda stub: stub.Evict(pb.EvictRequest(adapter="ink"), timeout=10),
    "ListAdapters": lambda stub: stub.ListAdapters(pb.ListAdaptersRequest(), timeout=10),
    "GetServerInfo": lambda stub: stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10),
}


def test_every_rpc_is_covered() -> None:
    assert set(RPCS) == set(pb.DESCRIPTOR.services_by_name["DiffusionService"].methods_by_name)


@pytest.mark.parametrize("rpc", RPCS)
async def test_engine_error_keeps_its_status_and_reason(stub, engine: RaisingEngine, rpc: str) -> None:
    engine.error, engine.steps_before_error = QueueFullError("the queue is full; retry", retry_after_s=1.0), 0

    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await RPCS[rpc](stub)

    error = error_from_rpc(raised.value)
    assert (error.code, error.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, ErrorReason.QUEUE_FULL.value)
    assert (error.message, error.metadata) == ("the queue is full; retry", {"retry_after_s": "1.0"})


@pytest.mark.parametrize("rpc", RPCS)
async def test_unexpected_error_is_internal_and_its_traceback_stays_in_the_log(
    stub, engine: RaisingEngine, rpc: str, caplog: pytest.LogCaptureFixture
) -> None:
    engine.error, engine.steps_before_error = RuntimeError(SECRET), 0

    with (
        caplog.at_level(logging.ERROR, logger="loraswap.server.transport.servicer"),
        pytest.raises(grpc.aio.AioRpcError) as raised,
    ):
        await RPCS[rpc](stub)

    error = error_from_rpc(raised.value)
    assert (error.code, error.reason) == (grpc.StatusCode.INTERNAL, ErrorReason.INTERNAL.value)
    sent = repr((raised.value.details(), raised.value.trailing_metadata()))
    assert SECRET not in sent and "Traceback" not in sent
    (record,) = [r for r in caplog.records if r.name == "loraswap.server.transport.servicer"]
    assert record.message == f"{rpc} failed"
    assert record.exc_info is not None and str(record.exc_info[1]) == SECRET


@pytest.mark.parametrize("error", [QueueFullError("full"), RuntimeError(SECRET)], ids=["engine", "unexpected"])
async def test_stream_error_after_events_ends_the_stream_with_a_status(
    stub, engine: RaisingEngine, error: Exception
) -> None:
    engine.error, engine.steps_before_error = error, 3
    received: list[pb.GenerateResponse] = []

    with pytest.raises(grpc.aio.AioRpcError) as raised:
        async for response in stub.Generate(pb.GenerateRequest(prompt="a boat"), timeout=10):
            received.append(response)

    assert [response.progress.step for response in received] == [1, 2, 3]
    expected = error.reason if isinstance(error, EngineError) else ErrorReason.INTERNAL
    assert error_from_rpc(raised.value).reason == expected.value
