"""error_from_rpc: status codes map to error classes, and ErrorInfo reason/metadata survive the wire.

A real grpc.aio server on port 0 aborts with a rich status built from
google.rpc messages; both the aio and the sync gRPC APIs call it, since the
client library may be handed either kind of error.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from loraswap.client.errors import (
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    FieldViolation,
    InternalError,
    InvalidRequest,
    LoraswapError,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    error_from_rpc,
    error_reason_value,
)
from loraswap.v1 import diffusion_service_pb2 as pb

# The failing server's methods take the status to fail with as their request.
_ABORT_WITH_RICH_STATUS = "/loraswap.test.Failing/AbortWithRichStatus"
_ABORT_PLAIN = "/loraswap.test.Failing/AbortPlain"


async def _abort_with_rich_status(request: status_pb2.Status, context: grpc.aio.ServicerContext) -> None:
    await context.abort_with_status(rpc_status.to_status(request))


async def _abort_plain(request: status_pb2.Status, context: grpc.aio.ServicerContext) -> None:
    code = next(code for code in grpc.StatusCode if code.value[0] == request.code)
    await context.abort(code, request.message)


@pytest.fixture(scope="module")
async def failing_server_target() -> AsyncIterator[str]:
    """A grpc.aio server on an OS-picked port whose methods fail with the status they are sent."""
    handlers = {
        name.rsplit("/", 1)[1]: grpc.unary_unary_rpc_method_handler(
            behaviour,
            request_deserializer=status_pb2.Status.FromString,
            response_serializer=bytes,
        )
        for name, behaviour in ((_ABORT_WITH_RICH_STATUS, _abort_with_rich_status), (_ABORT_PLAIN, _abort_plain))
    }
    server = grpc.aio.server()
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("loraswap.test.Failing", handlers)])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{port}"
    await server.stop(None)


async def _failed_call(target: str, method: str, status: status_pb2.Status, api: str) -> grpc.RpcError:
    """Calls the failing server through the aio or the sync gRPC API and returns the raised error."""
    if api == "aio":
        async with grpc.aio.insecure_channel(target) as channel:
            call = channel.unary_unary(method, request_serializer=status_pb2.Status.SerializeToString)
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await call(status, timeout=5)
            return raised.value

    def call_blocking() -> grpc.RpcError:
        with grpc.insecure_channel(target) as channel:
            call = channel.unary_unary(method, request_serializer=status_pb2.Status.SerializeToString)
            with pytest.raises(grpc.RpcError) as raised:
                call(status, timeout=5)
            return raised.value

    # The server runs on this loop, so the blocking call must not.
    return await asyncio.to_thread(call_blocking)


def _rich_status(code: grpc.StatusCode, message: str, reason: str, metadata: dict[str, str]) -> status_pb2.Status:
    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.ErrorInfo(reason=reason, domain="loraswap", metadata=metadata))
    return status_pb2.Status(code=code.value[0], message=message, details=[detail])


@dataclass(frozen=True)
class ErrorCase:
    code: grpc.StatusCode
    reason: str
    metadata: dict[str, str]
    expected_class: type[LoraswapError]


ERROR_CASES = [
    # Status codes and reasons as a loraswap server sends them (loraswap.v1.ErrorReason).
    ErrorCase(
        grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST", {"field": "width", "multiple": "16"}, InvalidRequest
    ),
    ErrorCase(grpc.StatusCode.NOT_FOUND, "ADAPTER_NOT_FOUND", {"adapter": "styles/ink"}, NotFound),
    ErrorCase(
        grpc.StatusCode.FAILED_PRECONDITION,
        "ADAPTER_RANK_TOO_HIGH",
        {"rank": "128", "max_rank": "64"},
        FailedPrecondition,
    ),
    ErrorCase(grpc.StatusCode.RESOURCE_EXHAUSTED, "QUEUE_FULL", {"retry_after_s": "2.5"}, ResourceExhausted),
    ErrorCase(grpc.StatusCode.UNAVAILABLE, "SHUTTING_DOWN", {}, Unavailable),
    ErrorCase(grpc.StatusCode.CANCELLED, "CANCELLED", {}, Cancelled),
    ErrorCase(grpc.StatusCode.INTERNAL, "GENERATION_FAILED", {}, InternalError),
    ErrorCase(grpc.StatusCode.UNAUTHENTICATED, "TOKEN_MISSING", {}, Unauthenticated),
    ErrorCase(grpc.StatusCode.PERMISSION_DENIED, "ADMIN_REQUIRED", {}, PermissionDenied),
    # Codes a loraswap server never sends with an ErrorInfo (a proxy or a newer server might):
    # reasons outside the vocabulary still pass through unchanged.
    ErrorCase(grpc.StatusCode.DEADLINE_EXCEEDED, "GENERATION_TIMED_OUT", {}, DeadlineExceeded),
    ErrorCase(grpc.StatusCode.UNKNOWN, "UNEXPECTED", {}, InternalError),
    ErrorCase(grpc.StatusCode.UNIMPLEMENTED, "NOT_SUPPORTED", {}, InternalError),
    ErrorCase(grpc.StatusCode.PERMISSION_DENIED, "DENIED_BY_PROXY", {"policy": "internal-only"}, PermissionDenied),
    ErrorCase(grpc.StatusCode.DATA_LOSS, "CORRUPT_ADAPTER", {}, InternalError),
]


@pytest.mark.parametrize("api", ["aio", "sync"])
@pytest.mark.parametrize("case", ERROR_CASES, ids=lambda case: case.code.name)
async def test_rich_status_maps_to_class_with_reason_and_metadata(
    failing_server_target: str, case: ErrorCase, api: str
) -> None:
    message = f"{case.reason.lower()}: change the request"
    rpc_error = await _failed_call(
        failing_server_target,
        _ABORT_WITH_RICH_STATUS,
        _rich_status(case.code, message, case.reason, case.metadata),
        api,
    )

    error = error_from_rpc(rpc_error)

    assert type(error) is case.expected_class
    assert error.code is case.code
    assert error.reason == case.reason
    assert error.metadata == case.metadata
    assert error.message == message
    assert str(error) == f"{case.code.name} {case.reason}: {message}"


@pytest.mark.parametrize("api", ["aio", "sync"])
async def test_status_without_details_has_no_reason(failing_server_target: str, api: str) -> None:
    status = status_pb2.Status(code=grpc.StatusCode.NOT_FOUND.value[0], message="no such adapter")
    rpc_error = await _failed_call(failing_server_target, _ABORT_PLAIN, status, api)

    error = error_from_rpc(rpc_error)

    assert type(error) is NotFound
    assert (error.reason, error.metadata, error.message) == (None, {}, "no such adapter")
    assert str(error) == "NOT_FOUND: no such adapter"


async def test_rich_status_without_error_info_has_no_reason(failing_server_target: str) -> None:
    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.BadRequest(field_violations=[{"field": "width", "description": "too big"}]))
    status = status_pb2.Status(code=grpc.StatusCode.INVALID_ARGUMENT.value[0], message="bad width", details=[detail])
    rpc_error = await _failed_call(failing_server_target, _ABORT_WITH_RICH_STATUS, status, "aio")

    error = error_from_rpc(rpc_error)

    assert type(error) is InvalidRequest
    assert (error.reason, error.metadata) == (None, {})
    assert error.field_violations == (FieldViolation("width", "too big"),)


@pytest.mark.parametrize("api", ["aio", "sync"])
async def test_retry_info_and_bad_request_beside_the_error_info(failing_server_target: str, api: str) -> None:
    """The server's standard details arrive as retry_delay_s and field_violations; the ErrorInfo still counts."""
    status = _rich_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full; retry", "QUEUE_FULL", {"retry_after_s": "9"})
    retry = any_pb2.Any()
    retry.Pack(error_details_pb2.RetryInfo(retry_delay={"seconds": 2, "nanos": 500_000_000}))
    bad_request = any_pb2.Any()
    bad_request.Pack(
        error_details_pb2.BadRequest(
            field_violations=[{"field": "width", "description": "not a multiple of 16"}, {"field": "height"}]
        )
    )
    status.details.extend([retry, bad_request])
    rpc_error = await _failed_call(failing_server_target, _ABORT_WITH_RICH_STATUS, status, api)

    error = error_from_rpc(rpc_error)

    assert type(error) is ResourceExhausted and error.reason == "QUEUE_FULL"
    assert error.retry_delay_s == 2.5 and error.retry_after_s == 2.5  # RetryInfo wins over the metadata hint
    assert error.field_violations == (FieldViolation("width", "not a multiple of 16"), FieldViolation("height", ""))


async def test_no_retry_info_means_no_retry_delay(failing_server_target: str) -> None:
    status = _rich_status(grpc.StatusCode.NOT_FOUND, "no such adapter", "ADAPTER_NOT_FOUND", {"adapter": "ink"})
    error = error_from_rpc(await _failed_call(failing_server_target, _ABORT_WITH_RICH_STATUS, status, "aio"))

    assert (error.retry_delay_s, error.field_violations) == (None, ())


def test_rpc_error_that_is_not_a_call_becomes_internal_error() -> None:
    error = error_from_rpc(grpc.RpcError())

    assert type(error) is InternalError
    assert error.code is grpc.StatusCode.UNKNOWN
    assert error.reason is None


class _EndedCall(grpc.RpcError):
    """A call whose stream ended without a status, as grpc reports it (code UNKNOWN, details "Stream removed")."""

    def __init__(self, details: str) -> None:
        self._details = details

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNKNOWN

    def details(self) -> str:
        return self._details

    def trailing_metadata(self):
        return ()


def test_a_stream_removed_under_the_call_is_unavailable_not_unknown() -> None:
    """A replica killed behind HAProxy while it ran the call: retryable elsewhere, so Unavailable."""
    error = error_from_rpc(_EndedCall("Stream removed (Data frame with END_STREAM flag received)"))
    assert isinstance(error, Unavailable) and error.code is grpc.StatusCode.UNAVAILABLE
    assert "Stream removed" in str(error)
    other = error_from_rpc(_EndedCall("Exception iterating responses: boom"))
    assert type(other) is InternalError and other.code is grpc.StatusCode.UNKNOWN


@pytest.mark.parametrize(
    ("metadata", "expected_retry_after_s"),
    [
        ({"retry_after_s": "2.5"}, 2.5),
        ({"retry_after_s": "0"}, 0.0),
        ({}, None),
        ({"retry_after_s": "soon"}, None),
    ],
)
def test_resource_exhausted_retry_hint(metadata: dict[str, str], expected_retry_after_s: float | None) -> None:
    error = ResourceExhausted("the queue is full; retry later", reason="QUEUE_FULL", metadata=metadata)

    assert error.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.retry_after_s == expected_retry_after_s


CONTRACT_REASONS = [value.name for value in pb.ErrorReason.DESCRIPTOR.values if value.number]


@pytest.mark.parametrize("name", CONTRACT_REASONS)
def test_reason_maps_to_the_contract_value_named_after_it(name: str) -> None:
    reason = name.removeprefix("ERROR_REASON_")

    assert reason != name
    assert error_reason_value(reason) == pb.ErrorReason.Value(name)
    assert NotFound("x", reason=reason).reason_value == pb.ErrorReason.Value(name)


@pytest.mark.parametrize("reason", [None, "", "FROM_A_NEWER_SERVER", "ERROR_REASON_QUEUE_FULL", "queue_full"])
def test_missing_or_unknown_reason_is_unspecified(reason: str | None) -> None:
    assert error_reason_value(reason) == pb.ERROR_REASON_UNSPECIFIED
    assert InternalError("x", reason=reason).reason_value == pb.ERROR_REASON_UNSPECIFIED
