"""The errors the loraswap client raises: one family, one class per status code.

The server attaches exactly one ``google.rpc.ErrorInfo`` (domain ``loraswap``)
to every error; its ``reason`` says what went wrong in a stable, matchable
form and its ``metadata`` carries details such as ``retry_after_s``. Errors
worth retrying after a pause also carry a ``google.rpc.RetryInfo``
(``LoraswapError.retry_delay_s``), and errors about one request field a
``google.rpc.BadRequest`` (``LoraswapError.field_violations``).

The reasons are a closed list, the contract's ``loraswap.v1.ErrorReason`` enum
(documented value by value in ``diffusion_service.proto``): a reason is the
enum value's name without its ``ERROR_REASON_`` prefix, so
``ERROR_REASON_QUEUE_FULL`` arrives as ``"QUEUE_FULL"``. ``error_reason_value``
and ``LoraswapError.reason_value`` give the enum value for a reason.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2

from loraswap.v1 import diffusion_service_pb2 as pb

__all__ = [
    "Cancelled",
    "DeadlineExceeded",
    "FailedPrecondition",
    "FieldViolation",
    "InternalError",
    "InvalidRequest",
    "LoraswapError",
    "NotFound",
    "PermissionDenied",
    "ResourceExhausted",
    "Unauthenticated",
    "Unavailable",
    "error_from_rpc",
    "error_reason_value",
]

# Trailing-metadata key under which gRPC carries a serialized google.rpc.Status.
_STATUS_DETAILS_METADATA_KEY = "grpc-status-details-bin"

# The contract's rule: the ErrorInfo reason is the ErrorReason value name without this prefix.
_REASON_PREFIX = "ERROR_REASON_"
_REASON_VALUES: dict[str, int] = {
    name.removeprefix(_REASON_PREFIX): number
    for name, number in pb.ErrorReason.items()
    if number != pb.ERROR_REASON_UNSPECIFIED
}


def error_reason_value(reason: str | None) -> pb.ErrorReason.ValueType:
    """The ``loraswap.v1.ErrorReason`` value of an ErrorInfo reason, e.g. ``"QUEUE_FULL"`` -> ``ERROR_REASON_QUEUE_FULL``.

    ``ERROR_REASON_UNSPECIFIED`` when there is no reason or one this client's
    contract does not list (a newer server's); the status code still applies.
    """
    return _REASON_VALUES.get(reason or "", pb.ERROR_REASON_UNSPECIFIED)


@dataclass(frozen=True, slots=True)
class FieldViolation:
    """One request field the server refused (a ``google.rpc.BadRequest.FieldViolation``)."""

    field: str
    description: str


class LoraswapError(Exception):
    """A failed call to a loraswap server.

    Attributes:
        code: The gRPC status code of the failure.
        reason: The ``ErrorInfo.reason`` the server attached, one of the
            ``loraswap.v1.ErrorReason`` names without the ``ERROR_REASON_``
            prefix (e.g. ``"QUEUE_FULL"``), or None when the failure carried
            none (e.g. a connection failure).
        metadata: The ``ErrorInfo.metadata`` the server attached.
        message: The human-readable message; it says what to change.
        retry_delay_s: Seconds to wait before retrying, from the server's
            ``google.rpc.RetryInfo``; None when it sent none (retrying the
            same call will not help).
        field_violations: The request fields the server refused, from its
            ``google.rpc.BadRequest``.
    """

    default_code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(
        self,
        message: str,
        *,
        code: grpc.StatusCode | None = None,
        reason: str | None = None,
        metadata: Mapping[str, str] | None = None,
        retry_delay_s: float | None = None,
        field_violations: Iterable[FieldViolation] = (),
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code if code is not None else self.default_code
        self.reason = reason
        self.metadata: dict[str, str] = dict(metadata or {})
        self.retry_delay_s = retry_delay_s
        self.field_violations: tuple[FieldViolation, ...] = tuple(field_violations)

    @property
    def reason_value(self) -> pb.ErrorReason.ValueType:
        """``reason`` as a ``loraswap.v1.ErrorReason`` value (``ERROR_REASON_UNSPECIFIED`` when none or unknown)."""
        return error_reason_value(self.reason)

    def __str__(self) -> str:
        label = self.code.name if self.reason is None else f"{self.code.name} {self.reason}"
        return f"{label}: {self.message}"

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(code={self.code.name}, reason={self.reason!r}, "
            f"message={self.message!r}, metadata={self.metadata!r})"
        )


class InvalidRequest(LoraswapError):
    """The request was malformed or out of range (INVALID_ARGUMENT)."""

    default_code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(LoraswapError):
    """The named adapter does not exist or is not cached (NOT_FOUND)."""

    default_code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(LoraswapError):
    """The server cannot do this in its current state (FAILED_PRECONDITION)."""

    default_code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(LoraswapError):
    """The server is out of room: queue full, adapter too big (RESOURCE_EXHAUSTED)."""

    default_code = grpc.StatusCode.RESOURCE_EXHAUSTED

    @property
    def retry_after_s(self) -> float | None:
        """Seconds the server suggests waiting before retrying, if it said (RetryInfo, else ErrorInfo metadata)."""
        if self.retry_delay_s is not None:
            return self.retry_delay_s
        hint = self.metadata.get("retry_after_s")
        if hint is None:
            return None
        try:
            return float(hint)
        except ValueError:
            return None


class Unavailable(LoraswapError):
    """The server cannot be reached or is shutting down (UNAVAILABLE)."""

    default_code = grpc.StatusCode.UNAVAILABLE


class Unauthenticated(LoraswapError):
    """The server wants a bearer token and got none or an unknown one (UNAUTHENTICATED)."""

    default_code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(LoraswapError):
    """The token is valid but its role may not make this call (PERMISSION_DENIED)."""

    default_code = grpc.StatusCode.PERMISSION_DENIED


class DeadlineExceeded(LoraswapError):
    """The call's deadline passed before it finished (DEADLINE_EXCEEDED)."""

    default_code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(LoraswapError):
    """The call was cancelled (CANCELLED)."""

    default_code = grpc.StatusCode.CANCELLED


class InternalError(LoraswapError):
    """Any other failure: INTERNAL, UNKNOWN, UNIMPLEMENTED and the rest."""

    default_code = grpc.StatusCode.INTERNAL


_ERROR_CLASS_BY_CODE: dict[grpc.StatusCode, type[LoraswapError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
}


# What grpc reports when a stream ends without a status (the transport under it closed).
_STREAM_REMOVED = "Stream removed"


def error_from_rpc(exc: grpc.aio.AioRpcError | grpc.RpcError) -> LoraswapError:
    """Turns a failed gRPC call (async or sync) into the matching LoraswapError.

    The caller should raise the result ``from exc`` so the original stays
    attached as ``__cause__``.
    """
    # A bare grpc.RpcError need not be a grpc.Call, so every accessor is optional.
    code = _call_attribute(exc, "code") or grpc.StatusCode.UNKNOWN
    message = _call_attribute(exc, "details") or ""
    details = _status_details_from_metadata(_call_attribute(exc, "trailing_metadata"))
    if code is grpc.StatusCode.UNKNOWN and details.error_info is None and message.startswith(_STREAM_REMOVED):
        # The connection under the stream went away before any status came: a replica behind a proxy died while
        # it ran the call (HAProxy 2.6 ends such a stream with no grpc-status). The server is unavailable.
        code = grpc.StatusCode.UNAVAILABLE
        message = f"the server went away while it ran the call ({message}); retry, on another replica if any"
    error_class = _ERROR_CLASS_BY_CODE.get(code, InternalError)
    return error_class(
        message,
        code=code,
        reason=(details.error_info.reason or None) if details.error_info else None,
        metadata=dict(details.error_info.metadata) if details.error_info else None,
        retry_delay_s=details.retry_delay_s,
        field_violations=details.field_violations,
    )


def _call_attribute(exc: grpc.RpcError, name: str):
    accessor = getattr(exc, name, None)
    return accessor() if callable(accessor) else None


@dataclass(frozen=True, slots=True)
class _StatusDetails:
    error_info: error_details_pb2.ErrorInfo | None = None
    retry_delay_s: float | None = None
    field_violations: tuple[FieldViolation, ...] = ()


def _status_details_from_metadata(
    trailing_metadata: Iterable[tuple[str, str | bytes]] | None,
) -> _StatusDetails:
    """Finds the ErrorInfo, RetryInfo and BadRequest inside the rich status carried in trailing metadata.

    Parsed by hand rather than with ``rpc_status.from_call`` because that
    raises when the status message and the call details differ, and a
    malformed detail should cost the caller the details, not the error itself.
    """
    for key, value in trailing_metadata or ():
        if key != _STATUS_DETAILS_METADATA_KEY or not isinstance(value, bytes):
            continue
        try:
            status = status_pb2.Status.FromString(value)
        except DecodeError:
            return _StatusDetails()
        # The first detail of each kind counts; a loraswap server sends at most one of each.
        found: dict[type, object] = {}
        for detail in status.details:
            for kind in (error_details_pb2.ErrorInfo, error_details_pb2.RetryInfo, error_details_pb2.BadRequest):
                if kind not in found and detail.Is(kind.DESCRIPTOR):
                    unpacked = kind()
                    if detail.Unpack(unpacked):
                        found[kind] = unpacked
        retry_info = found.get(error_details_pb2.RetryInfo)
        bad_request = found.get(error_details_pb2.BadRequest)
        return _StatusDetails(
            error_info=found.get(error_details_pb2.ErrorInfo),
            retry_delay_s=retry_info.retry_delay.ToNanoseconds() / 1e9 if retry_info is not None else None,
            field_violations=tuple(
                FieldViolation(field=violation.field, description=violation.description)
                for violation in (bad_request.field_violations if bad_request is not None else ())
            ),
        )
    return _StatusDetails()
