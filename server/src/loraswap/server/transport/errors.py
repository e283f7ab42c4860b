"""The one table from domain errors to gRPC status codes, with a google.rpc.ErrorInfo per error."""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from loraswap.server.engine import errors as engine_errors

ERROR_DOMAIN = "loraswap"

STATUS_FOR_ERROR: dict[type[engine_errors.EngineError], grpc.StatusCode] = {
    engine_errors.InvalidRequestError: grpc.StatusCode.INVALID_ARGUMENT,
    engine_errors.AdapterNameError: grpc.StatusCode.INVALID_ARGUMENT,
    engine_errors.AdapterFormatError: grpc.StatusCode.INVALID_ARGUMENT,
    engine_errors.AdapterIncompatibleError: grpc.StatusCode.FAILED_PRECONDITION,
    engine_errors.AdapterNotFoundError: grpc.StatusCode.NOT_FOUND,
    engine_errors.AdapterTooLargeError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    engine_errors.HubDisabledError: grpc.StatusCode.FAILED_PRECONDITION,
    engine_errors.QueueFullError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    engine_errors.NotServingError: grpc.StatusCode.UNAVAILABLE,
    engine_errors.GenerationCancelledError: grpc.StatusCode.CANCELLED,
    engine_errors.GenerationFailedError: grpc.StatusCode.INTERNAL,
}


def status_code_for(error: engine_errors.EngineError) -> grpc.StatusCode:
    """The status code of the nearest class in the table (INTERNAL when none)."""
    for cls in type(error).__mro__:
        if cls in STATUS_FOR_ERROR:
            return STATUS_FOR_ERROR[cls]
    return grpc.StatusCode.INTERNAL


def to_rpc_status(error: engine_errors.EngineError) -> grpc.Status:
    """A grpc.Status carrying the message and exactly one ErrorInfo detail."""
    code = status_code_for(error)
    info = error_details_pb2.ErrorInfo(reason=str(error.reason), domain=ERROR_DOMAIN, metadata=error.metadata)
    detail = any_pb2.Any()
    detail.Pack(info)
    status = status_pb2.Status(code=getattr(code_pb2, code.name), message=error.message, details=[detail])
    return rpc_status.to_status(status)


# What a client sees for anything that is not an EngineError; the traceback stays in the server's log.
INTERNAL_ERROR = engine_errors.EngineError(
    "the server hit an unexpected error; it keeps serving, retry or report it",
    reason=engine_errors.ErrorReason.INTERNAL,
)
