"""DiffusionService over grpc.aio: convert the proto, call the engine, convert back."""

from __future__ import annotations

import logging
from typing import AsyncIterator

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

    async def PreloadAdapter(
        self, request: pb.PreloadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.PreloadAdapterResponse:
        try:
            return convert.preload_to_pb(await self.engine.preload(_required_adapter(request.adapter)))
        except EngineError as error:
            await _abort(context, error)
        except Exception:
            log.exception("PreloadAdapter failed")
            await _abort(context, INTERNAL_ERROR)

    async def Evict(self, request: pb.EvictRequest, context: grpc.aio.ServicerContext) -> pb.EvictResponse:
        try:
            return pb.EvictResponse(freed_bytes=self.engine.evict(_required_adapter(request.adapter)))
        except EngineError as error:
            await _abort(context, error)

    async def ListAdapters(
        self, request: pb.ListAdaptersRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListAdaptersResponse:
        return convert.adapter_list_to_pb(self.engine.list_adapters())

    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetServerInfoResponse:
        try:
            return convert.server_description_to_pb(self.engine.describe())
        except EngineError as error:
            await _abort(context, error)
