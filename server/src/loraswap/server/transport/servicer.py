"""DiffusionService over grpc.aio: convert the proto, call the engine, convert back."""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError, Message

from loraswap.server.engine.errors import EngineError, InvalidRequestError
from loraswap.server.engine.interface import Engine
from loraswap.server.transport import convert
from loraswap.server.transport.errors import INTERNAL_ERROR, to_rpc_status
from loraswap.v1 import diffusion_service_pb2 as pb
from loraswap.v1 import diffusion_service_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

DIFFUSION_SERVICE = pb.DESCRIPTOR.services_by_name["DiffusionService"]


@dataclass(frozen=True)
class UndecodableRequest:
    """What a handler receives in place of a request whose bytes are not its message (see add_diffusion_service)."""

    message_name: str
    problem: str

    def error(self) -> InvalidRequestError:
        """The INVALID_ARGUMENT error that answers it."""
        return InvalidRequestError(
            f"the request is not a valid {self.message_name} ({self.problem}); send a serialized "
            f"{self.message_name}, with every string field in UTF-8"
        )


def _tolerant_deserializer(message_class: type[Message]) -> Callable[[bytes], Message | UndecodableRequest]:
    def deserialize(data: bytes) -> Message | UndecodableRequest:
        try:
            return message_class.FromString(data)
        except DecodeError as error:
            # protobuf says "Error parsing message with type 'X': <what>"; the <what> is the useful part.
            problem = str(error).rpartition(": ")[2] or "malformed bytes"
            return UndecodableRequest(message_class.DESCRIPTOR.full_name, problem[:200])

    return deserialize


def add_diffusion_service(servicer: DiffusionServicer, server: grpc.aio.Server) -> None:
    """Register DiffusionService on `server`, as the generated add_DiffusionServiceServicer_to_server does, except
    that a request whose bytes do not decode (a string that is not UTF-8, a corrupt message) reaches its handler
    as an UndecodableRequest and is answered INVALID_ARGUMENT, where gRPC itself would fail the call as UNKNOWN."""
    handlers = {}
    for method in DIFFUSION_SERVICE.methods:
        request_class = getattr(pb, method.input_type.name)
        response_class = getattr(pb, method.output_type.name)
        make_handler = (
            grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        )
        handlers[method.name] = make_handler(
            getattr(servicer, method.name),
            request_deserializer=_tolerant_deserializer(request_class),
            response_serializer=response_class.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(DIFFUSION_SERVICE.full_name, handlers),))
    server.add_registered_method_handlers(DIFFUSION_SERVICE.full_name, handlers)


def _refuse_undecodable(request: object) -> None:
    if isinstance(request, UndecodableRequest):
        raise request.error()


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
            async with _statuses_from_errors(context, method.__name__):
                _refuse_undecodable(request)
                # aclosing: when gRPC closes the stream early, the handler's cleanup runs now, not at GC.
                async with contextlib.aclosing(method(self, request, context)) as responses:
                    async for response in responses:
                        yield response

        return streamed

    @functools.wraps(method)
    async def unary(self, request, context: grpc.aio.ServicerContext):
        async with _statuses_from_errors(context, method.__name__):
            _refuse_undecodable(request)
            return await method(self, request, context)

    return unary


def _adapter_named(field: str, context: grpc.aio.ServicerContext) -> str:
    """The adapter a Preload or Evict acts on: its field, or the `lora` metadata's one name."""
    name = convert.adapter_with_lora_metadata(field, convert.lora_names(context.invocation_metadata()))
    if not name:
        raise InvalidRequestError("adapter is empty; name the adapter to act on", field="adapter")
    return name


class DiffusionServicer(pb_grpc.DiffusionServiceServicer):
    """Thin transport: every method maps engine errors through the one error table."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @_errors_mapped
    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        generation = convert.with_lora_metadata(
            convert.generation_request_from_pb(request), convert.lora_names(context.invocation_metadata())
        )
        async with contextlib.aclosing(self.engine.generate(generation)) as events:
            async for event in events:
                for response in convert.generate_responses(event):
                    yield response

    @_errors_mapped
    async def PreloadAdapter(
        self, request: pb.PreloadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.PreloadAdapterResponse:
        name, link = convert.adapter_and_link(_adapter_named(request.adapter, context))
        return convert.to_pb(await self.engine.preload(name, link))

    @_errors_mapped
    async def Evict(self, request: pb.EvictRequest, context: grpc.aio.ServicerContext) -> pb.EvictResponse:
        name, _ = convert.adapter_and_link(_adapter_named(request.adapter, context))
        return pb.EvictResponse(freed_bytes=self.engine.evict(name))

    @_errors_mapped
    async def ListAdapters(
        self, request: pb.ListAdaptersRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListAdaptersResponse:
        return convert.adapter_page_to_pb(self.engine.list_adapters(), request.page_size, request.page_token)

    @_errors_mapped
    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetServerInfoResponse:
        return convert.to_pb(self.engine.describe())
