"""DiffusionService over grpc.aio: convert the proto, call the engine, convert back."""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import AsyncIterator

import grpc

from loraswap.server.engine.diffusion_engine import DiffusionEngine
from loraswap.server.engine.errors import EngineError, InvalidRequestError
from loraswap.server.transport import convert
from loraswap.server.transport.errors import INTERNAL_ERROR, to_rpc_status
from loraswap.v1 import diffusion_service_pb2 as pb
from loraswap.v1 import diffusion_service_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


async def _abort(context: grpc.aio.ServicerContext, error: EngineError) -> None:
    await context.abort_with_status(to_rpc_status(error))


@contextlib.asynccontextmanager
async def _statuses_from_errors(context: grpc.aio.ServicerContext, method_name: str) -> AsyncIterator[None]:
    """End the call with the status the one error table gives what was raised; tracebacks go to the log only."""
    try:
        yield
    except grpc.aio.AbortError:
        raise  # the handler already chose its status
    except EngineError as error:
        await _abort(context, error)
    except Exception:
        log.exception("%s failed", method_name)
        await _abort(context, INTERNAL_ERROR)


def _errors_mapped(method):
    """Map engine errors (and anything unexpected) to statuses, for unary and server-streaming handlers alike.

    A unary handler is a coroutine; a server-streaming one is an async
    generator, wrapped so that errors raised between messages are mapped too.
    Cancellation is a BaseException and passes through untouched, so a client
    going away still stops the generation.
    """
    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def streamed(self, request, context: grpc.aio.ServicerContext):
            # aclosing: when gRPC closes the stream early, the handler's cleanup runs now, not at GC.
            async with (
                _statuses_from_errors(context, method.__name__),
                contextlib.aclosing(method(self, request, context)) as responses,
            ):
                async for response in responses:
                    yield response

        return streamed

    @functools.wraps(method)
    async def unary(self, request, context: grpc.aio.ServicerContext):
        async with _statuses_from_errors(context, method.__name__):
            return await method(self, request, context)

    return unary


def _required_adapter(name: str) -> str:
    if not name:
        raise InvalidRequestError("adapter is empty; name the adapter to act on", field="adapter")
    return name


class DiffusionServicer(pb_grpc.DiffusionServiceServicer):
    """Thin transport: every method maps engine errors through the one error table."""

    def __init__(self, engine: DiffusionEngine) -> None:
        self.engine = engine

    @_errors_mapped
    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        generation = convert.generation_request_from_pb(request)
        async with contextlib.aclosing(self.engine.generate(generation)) as events:
            async for event in events:
                yield convert.generation_event_to_pb(event)

    @_errors_mapped
    async def PreloadAdapter(
        self, request: pb.PreloadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.PreloadAdapterResponse:
        return convert.preload_to_pb(await self.engine.preload(_required_adapter(request.adapter)))

    @_errors_mapped
    async def Evict(self, request: pb.EvictRequest, context: grpc.aio.ServicerContext) -> pb.EvictResponse:
        return pb.EvictResponse(freed_bytes=self.engine.evict(_required_adapter(request.adapter)))

    @_errors_mapped
    async def ListAdapters(
        self, request: pb.ListAdaptersRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListAdaptersResponse:
        return convert.adapter_list_to_pb(self.engine.list_adapters())

    @_errors_mapped
    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetServerInfoResponse:
        return convert.server_description_to_pb(self.engine.describe())
