"""Every DiffusionService call, watched: a request id in its trailing metadata, and a CallRecord for the observers.

A grpc.aio server interceptor, outermost, so that calls the token check refuses are counted and logged too.
It wraps each handler: before the call it picks the request id (the caller's `x-request-id`, or a new one)
and notes what was asked; it reads the Generate stream as it passes (steps, the image's size, timings and
adapters); when the call ends, however it ends, it hands the record to ServerObservers (metrics, access
log, traces). Health and reflection calls are not watched. A call to a method path the service does not have
(which only the token check's refusal answers) is recorded as UNKNOWN_METHOD.

It also keeps call metadata out of gRPC's own log (see MetadataValueRedaction).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import inspect
import logging
from collections.abc import Awaitable, Callable, Iterator

import grpc
from google.rpc import error_details_pb2, status_pb2

from loraswap.server.engine.adapters.sources import loggable_name
from loraswap.server.engine.types import Timings
from loraswap.server.observability.calls import REQUEST_ID_KEY, CallRecord, method_name, request_id_from
from loraswap.server.observability.observers import ServerObservers
from loraswap.server.transport import convert
from loraswap.server.transport.servicer import DIFFUSION_SERVICE, UndecodableRequest
from loraswap.v1 import diffusion_service_pb2 as pb

TRACE_HEADERS = ("traceparent", "tracestate")
# A call the client abandons this close to its deadline ended by the deadline: the server's deadline starts when
# the request arrives, so when the client's fires and it cancels the stream, the server still sees a few
# milliseconds left (on a loaded machine, tens of them).
DEADLINE_SLACK_S = 0.25
STATUS_DETAILS_KEY = "grpc-status-details-bin"
# gRPC's Python logger. A metadata value (or method path) that is not UTF-8 is logged there whole, with a
# traceback, as "Invalid encoding on b'...'", before any interceptor sees the call: `Bearer <token>` and one
# stray byte put the token in the server's log.
GRPC_LOGGER = "grpc._cython.cygrpc"


class MetadataValueRedaction(logging.Filter):
    """Keeps gRPC's lines about undecodable bytes, but not the bytes (a credential, perhaps) or the traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        if any(isinstance(arg, (bytes, bytearray)) for arg in args):
            record.args = tuple(
                f"<{len(arg)} bytes, not logged>" if isinstance(arg, (bytes, bytearray)) else arg for arg in args
            )
            if record.exc_info is not None and isinstance(record.exc_info[1], UnicodeError):
                record.exc_info = None
                record.exc_text = None
        return True


def redact_metadata_in_grpc_log() -> None:
    """Install MetadataValueRedaction on gRPC's logger, once per process."""
    grpc_log = logging.getLogger(GRPC_LOGGER)
    if not any(isinstance(existing, MetadataValueRedaction) for existing in grpc_log.filters):
        grpc_log.addFilter(MetadataValueRedaction())


class _WatchedContext:
    """The call's context as its handler sees it: an abort keeps the request id in the trailing metadata
    (an abort replaces what was set before) and is remembered, with its ErrorInfo reason."""

    def __init__(self, context: grpc.aio.ServicerContext, record: CallRecord) -> None:
        self._context = context
        self._request_id = record.request_id
        self.record = record
        self.aborted_code: grpc.StatusCode | None = None
        self.aborted_reason = ""

    def __getattr__(self, name: str):
        return getattr(self._context, name)

    def set_trailing_metadata(self, trailing_metadata) -> None:
        self._context.set_trailing_metadata(tuple(trailing_metadata) + ((REQUEST_ID_KEY, self._request_id),))

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()) -> None:
        self.aborted_code = code
        self.aborted_reason = _error_reason(trailing_metadata)
        await self._context.abort(code, details, tuple(trailing_metadata) + ((REQUEST_ID_KEY, self._request_id),))

    async def abort_with_status(self, status: grpc.Status) -> None:
        await self.abort(status.code, status.details, status.trailing_metadata)


def _error_reason(trailing_metadata) -> str:
    """The ErrorInfo reason in a status's details, or "" when it carries none."""
    for key, value in trailing_metadata or ():
        if key == STATUS_DETAILS_KEY and isinstance(value, bytes):
            for detail in status_pb2.Status.FromString(value).details:
                if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                    info = error_details_pb2.ErrorInfo()
                    detail.Unpack(info)
                    return info.reason
    return ""


def _metadata_value(metadata, key: str) -> str | None:
    for name, value in metadata or ():
        if name == key and isinstance(value, str):
            return value
    return None


def _note_request(record: CallRecord, request: object, metadata) -> None:
    """What the request asks for, as far as the observers care."""
    if isinstance(request, UndecodableRequest):
        return
    # URL adapters by their public identity: a link's query (a presigned signature, a token) is never recorded.
    lora = tuple(map(loggable_name, convert.lora_names(metadata)))
    if isinstance(request, pb.GenerateRequest):
        named = tuple(entry.adapter for entry in request.adapters) or ((request.adapter,) if request.adapter else ())
        record.adapters = tuple(map(loggable_name, named)) or lora
        record.prompt = request.prompt
        if request.HasField("num_inference_steps"):
            record.steps = request.num_inference_steps
        if request.HasField("width") and request.HasField("height"):
            record.width, record.height = request.width, request.height
    elif isinstance(request, (pb.PreloadAdapterRequest, pb.EvictRequest)):
        record.adapters = (loggable_name(request.adapter),) if request.adapter else lora


def _note_response(record: CallRecord, response: pb.GenerateResponse) -> None:
    event = response.WhichOneof("event")
    if event == "progress":
        record.steps = response.progress.total_steps
    elif event == "image":
        image = response.image
        record.width, record.height = image.width, image.height
        record.adapters = tuple(entry.adapter for entry in image.adapters)
        record.fused = image.fused
        # Timings' fields are the message's, name for name (tests/unit/test_field_maps.py).
        record.timings = Timings(
            **{item.name: getattr(image.timings, item.name) for item in dataclasses.fields(Timings)}
        )


def _ending_code(error: BaseException, context: grpc.aio.ServicerContext) -> str:
    if isinstance(error, (asyncio.CancelledError, GeneratorExit)):
        remaining = context.time_remaining()
        return "DEADLINE_EXCEEDED" if remaining is not None and remaining <= DEADLINE_SLACK_S else "CANCELLED"
    return "UNKNOWN"


class CallWatchInterceptor(grpc.aio.ServerInterceptor):
    """Gives every DiffusionService call a request id and reports it to `observers` when it ends."""

    def __init__(self, observers: ServerObservers) -> None:
        self.observers = observers
        # Here because every server has this interceptor, with or without tokens: a client may send its token
        # to a server that does not ask for one.
        redact_metadata_in_grpc_log()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        service, _, rpc = handler_call_details.method.lstrip("/").rpartition("/")
        if handler is None or service != DIFFUSION_SERVICE.full_name:
            return handler
        method = method_name(rpc)
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._unary(method, handler.unary_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._streamed(method, handler.unary_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler

    def _begin(self, method: str, request: object, context: grpc.aio.ServicerContext) -> _WatchedContext:
        metadata = context.invocation_metadata() or ()
        record = CallRecord(method=method, request_id=request_id_from(_metadata_value(metadata, REQUEST_ID_KEY)))
        record.trace_headers = {
            key: value for key in TRACE_HEADERS if (value := _metadata_value(metadata, key)) is not None
        }
        _note_request(record, request, metadata)
        watched = _WatchedContext(context, record)
        watched.set_trailing_metadata(())
        return watched

    def _end(self, watched: _WatchedContext, error: BaseException | None) -> None:
        record = watched.record
        if watched.aborted_code is not None:
            record.finish(watched.aborted_code.name, watched.aborted_reason)
        elif error is not None:
            record.finish(_ending_code(error, watched))
        else:
            code = watched.code()
            record.finish(code.name if isinstance(code, grpc.StatusCode) else "OK")
        self.observers.call_ended(record)

    @contextlib.contextmanager
    def _watching(self, method: str, request: object, context: grpc.aio.ServicerContext) -> Iterator[_WatchedContext]:
        """The context a handler runs with; leaving the block, however it is left, ends the call's record."""
        watched = self._begin(method, request, context)
        error: BaseException | None = None
        try:
            yield watched
        except BaseException as raised:  # CancelledError and GeneratorExit too: the record says how the call ended
            error = raised
            raise
        finally:
            self._end(watched, error)

    def _unary(self, method: str, behavior):
        @functools.wraps(behavior)
        async def watched_unary(request, context):
            with self._watching(method, request, context) as watched:
                return await behavior(request, watched)

        return watched_unary

    def _streamed(self, method: str, behavior):
        @functools.wraps(behavior)
        async def watched_stream(request, context):
            with self._watching(method, request, context) as watched:
                if not inspect.isasyncgenfunction(behavior):
                    # A coroutine handler (the token check's refusal) writes through the context, if at all.
                    await behavior(request, watched)
                    return
                # aclosing: when gRPC closes the stream early, the handler's cleanup runs now, not at GC.
                async with contextlib.aclosing(behavior(request, watched)) as responses:
                    async for response in responses:
                        if isinstance(response, pb.GenerateResponse):
                            _note_response(watched.record, response)
                        yield response

        return watched_stream
