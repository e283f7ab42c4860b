"""The one table from domain errors to gRPC status codes, with a google.rpc.ErrorInfo per error.

Beside the ErrorInfo, a status carries google.rpc.RetryInfo for errors worth retrying after a pause and
google.rpc.BadRequest for errors about one request field (those raised with a `field` metadata key).
"""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from loraswap.server import access
from loraswap.server.engine import errors as engine_errors
from loraswap.server.engine.errors import ErrorReason

ERROR_DOMAIN = "loraswap"

STATUS_FOR_ERROR: dict[type[engine_errors.EngineError], grpc.StatusCode] = {
    engine_errors.InvalidRequestError: grpc.StatusCode.INVALID_ARGUMENT,
    engine_errors.AdapterNameError: grpc.StatusCode.INVALID_ARGUMENT,
    engine_errors.AdapterFormatError: grpc.StatusCode.INVALID_ARGUMENT,
    engine_errors.AdapterIncompatibleError: grpc.StatusCode.FAILED_PRECONDITION,
    engine_errors.BaseModelMismatchError: grpc.StatusCode.FAILED_PRECONDITION,
    engine_errors.FuseChoiceError: grpc.StatusCode.FAILED_PRECONDITION,
    engine_errors.AdapterNotFoundError: grpc.StatusCode.NOT_FOUND,
    engine_errors.AdapterPinnedError: grpc.StatusCode.FAILED_PRECONDITION,
    engine_errors.AdapterTooLargeError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    engine_errors.HubDisabledError: grpc.StatusCode.FAILED_PRECONDITION,
    engine_errors.UrlRefusedError: grpc.StatusCode.PERMISSION_DENIED,
    engine_errors.UrlFetchError: grpc.StatusCode.FAILED_PRECONDITION,
    engine_errors.UrlMissingError: grpc.StatusCode.NOT_FOUND,
    engine_errors.UrlUnavailableError: grpc.StatusCode.UNAVAILABLE,
    engine_errors.QueueFullError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    engine_errors.NotServingError: grpc.StatusCode.UNAVAILABLE,
    engine_errors.GenerationCancelledError: grpc.StatusCode.CANCELLED,
    engine_errors.GenerationFailedError: grpc.StatusCode.INTERNAL,
    access.TokenMissingError: grpc.StatusCode.UNAUTHENTICATED,
    access.TokenInvalidError: grpc.StatusCode.UNAUTHENTICATED,
    access.AdminRequiredError: grpc.StatusCode.PERMISSION_DENIED,
}

# How long to wait before retrying, for the reasons where a retry can succeed; an error's own
# `retry_after_s` metadata wins. Shutting down: long enough for a load balancer to drop the replica.
RETRY_DELAY_S_FOR_REASON: dict[ErrorReason, float] = {
    ErrorReason.QUEUE_FULL: 1.0,
    ErrorReason.NOT_SERVING: 1.0,
    ErrorReason.SHUTTING_DOWN: 1.0,
}


def status_code_for(error: engine_errors.EngineError) -> grpc.StatusCode:
    """The status code of the nearest class in the table (INTERNAL when none)."""
    for cls in type(error).__mro__:
        if cls in STATUS_FOR_ERROR:
            return STATUS_FOR_ERROR[cls]
    return grpc.StatusCode.INTERNAL


def retry_delay_s(error: engine_errors.EngineError) -> float | None:
    """Seconds the caller should wait before retrying, or None when retrying the same call cannot help.

    An error's `retry_after_s` (a fetched URL's Retry-After) gives a delay for any reason."""
    default = RETRY_DELAY_S_FOR_REASON.get(error.reason)
    if default is None and "retry_after_s" not in error.metadata:
        return None
    try:
        return max(0.0, float(error.metadata["retry_after_s"]))
    except (KeyError, ValueError):
        return default


def _packed(message) -> any_pb2.Any:
    detail = any_pb2.Any()
    detail.Pack(message)
    return detail


def to_rpc_status(error: engine_errors.EngineError) -> grpc.Status:
    """A grpc.Status carrying the message, exactly one ErrorInfo, and RetryInfo / BadRequest where they apply."""
    code = status_code_for(error)
    details = [
        _packed(error_details_pb2.ErrorInfo(reason=str(error.reason), domain=ERROR_DOMAIN, metadata=error.metadata))
    ]
    delay_s = retry_delay_s(error)
    if delay_s is not None:
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(round(delay_s * 1e9))
        details.append(_packed(error_details_pb2.RetryInfo(retry_delay=delay)))
    field = error.metadata.get("field")
    if field:
        violation = error_details_pb2.BadRequest.FieldViolation(field=field, description=error.message)
        details.append(_packed(error_details_pb2.BadRequest(field_violations=[violation])))
    status = status_pb2.Status(code=getattr(code_pb2, code.name), message=error.message, details=details)
    return rpc_status.to_status(status)


# What a client sees for anything that is not an EngineError; the traceback stays in the server's log.
INTERNAL_ERROR = engine_errors.EngineError(
    "the server hit an unexpected error; it keeps serving, retry or report it",
    reason=engine_errors.ErrorReason.INTERNAL,
)
