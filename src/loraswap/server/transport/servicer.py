"""DiffusionService over grpc.aio: convert the proto, call the engine, convert back."""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator

import grpc

from loraswap.engine.diffusion_engine import DiffusionEngine
from loraswap.engine.errors import EngineError, InvalidRequestError
from loraswap.server.transport import convert
from loraswap.server.transport.errors import INTERNAL_ERROR, to_rpc_status
from loraswap.v1 import diffusion_service_pb2 as pb
from loraswap.v1 import diffusion_service_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


async def _abort(context: grpc.aio.ServicerContext, error: EngineError) -> None:
    await context.abort_with_status(to_rpc_status(error))


def _unary_errors_mapped(method):
    """Turn engine errors (and anything unexpected) into statuses from the one error table."""

    @functools.wraps(method)
    async def mapped(self, request, context: grpc.aio.ServicerContext):
        try:
            return await method(self, request, context)
        except EngineError as error:
            await _abort(context, error)
        except Exception:
            log.exception("%s failed", method.__name__)
            await _abort(context, INTERNAL_ERROR)

    return mapped


def _required_adapter(name: str) -> str:
    if not name:
        raise InvalidRequestError("adapter is empty; name the adapter to act on", field="adapter")
    return name


class DiffusionServicer(pb_grpc.DiffusionServiceServicer):
    """Thin transport: every method maps engine errors through the one error table."""

    def __init__(self, engine: DiffusionEngine) -> None:
        self.engine = engine

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        try:
            events = self.engine.generate(convert.generation_request_from_pb(request))
            async for event in events:
                yield convert.generation_event_to_pb(event)
        except EngineError as error:
            await _abort(context, error)
        except Exception:
            log.exception("Generate failed")
            await _abort(context, INTERNAL_ERROR)

    @_unary_errors_mapped
    async def PreloadAdapter(
        self, request: pb.PreloadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.PreloadAdapterResponse:
        return convert.preload_to_pb(await self.engine.preload(_required_adapter(request.adapter)))

    @_unary_errors_mapped
    async def Evict(self, request: pb.EvictRequest, context: grpc.aio.ServicerContext) -> pb.EvictResponse:
        return pb.EvictResponse(freed_bytes=self.engine.evict(_required_adapter(request.adapter)))

    @_unary_errors_mapped
    async def ListAdapters(
        self, request: pb.ListAdaptersRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListAdaptersResponse:
        return convert.adapter_list_to_pb(self.engine.list_adapters())

    @_unary_errors_mapped
    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetServerInfoResponse:
        return convert.server_description_to_pb(self.engine.describe())
