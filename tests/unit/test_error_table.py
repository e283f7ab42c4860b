"""The one table from engine (and access) errors to gRPC status: exactly one google.rpc.ErrorInfo per error,
google.rpc.RetryInfo where a retry can succeed, google.rpc.BadRequest naming the field at fault."""

from __future__ import annotations

import inspect

import grpc
import pytest
from google.rpc import code_pb2, error_details_pb2, status_pb2

from loraswap.server import access
from loraswap.server.engine import errors as engine_errors
from loraswap.server.transport.errors import ERROR_DOMAIN, INTERNAL_ERROR, status_code_for, to_rpc_status

EXPECTED_CODES = {
    engine_errors.EngineError: grpc.StatusCode.INTERNAL,
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

EXPECTED_REASONS = {
    engine_errors.EngineError: "INTERNAL",
    engine_errors.InvalidRequestError: "INVALID_REQUEST",
    engine_errors.AdapterNameError: "INVALID_ADAPTER_NAME",
    engine_errors.AdapterNotFoundError: "ADAPTER_NOT_FOUND",
    engine_errors.AdapterPinnedError: "ADAPTER_PINNED",
    engine_errors.AdapterFormatError: "ADAPTER_MALFORMED",
    engine_errors.AdapterIncompatibleError: "ADAPTER_INCOMPATIBLE",
    engine_errors.BaseModelMismatchError: "BASE_MODEL_MISMATCH",
    engine_errors.FuseChoiceError: "FUSE_CHOICE_UNAVAILABLE",
    engine_errors.AdapterTooLargeError: "ADAPTER_TOO_LARGE",
    engine_errors.HubDisabledError: "HUB_DISABLED",
    engine_errors.UrlRefusedError: "URL_HOST_NOT_ALLOWED",
    engine_errors.UrlFetchError: "URL_HTTP_ERROR",
    engine_errors.UrlMissingError: "URL_NOT_FOUND",
    engine_errors.UrlUnavailableError: "URL_CONNECT_FAILED",
    engine_errors.QueueFullError: "QUEUE_FULL",
    engine_errors.NotServingError: "NOT_SERVING",
    engine_errors.GenerationCancelledError: "CANCELLED",
    engine_errors.GenerationFailedError: "GENERATION_FAILED",
    access.TokenMissingError: "TOKEN_MISSING",
    access.TokenInvalidError: "TOKEN_INVALID",
    access.AdminRequiredError: "ADMIN_REQUIRED",
}

ALL_ERRORS = sorted(
    {
        cls
        for module in (engine_errors, access)
        for _, cls in inspect.getmembers(module, inspect.isclass)
        if issubclass(cls, engine_errors.EngineError)
    },
    key=lambda cls: cls.__name__,
)

DETAIL_KINDS = (error_details_pb2.ErrorInfo, error_details_pb2.RetryInfo, error_details_pb2.BadRequest)


def _details(status: grpc.Status) -> tuple[status_pb2.Status, dict[type, list]]:
    """The rich status in the trailers, and its details by kind; any other kind of detail fails the test."""
    (binary,) = [value for key, value in status.trailing_metadata if key == "grpc-status-details-bin"]
    decoded = status_pb2.Status.FromString(binary)
    by_kind: dict[type, list] = {kind: [] for kind in DETAIL_KINDS}
    for detail in decoded.details:
        (kind,) = [kind for kind in DETAIL_KINDS if detail.Is(kind.DESCRIPTOR)] or [None]
        assert kind is not None, f"unexpected detail {detail.type_url}"
        unpacked = kind()
        detail.Unpack(unpacked)
        by_kind[kind].append(unpacked)
    return decoded, by_kind


def _decode(status: grpc.Status) -> tuple[status_pb2.Status, list[error_details_pb2.ErrorInfo]]:
    decoded, by_kind = _details(status)
    return decoded, by_kind[error_details_pb2.ErrorInfo]


def test_every_engine_error_is_in_this_table() -> None:
    """A new EngineError subclass must be given its expected status here."""
    assert set(ALL_ERRORS) == set(EXPECTED_CODES) == set(EXPECTED_REASONS)


@pytest.mark.parametrize("error_class", ALL_ERRORS, ids=lambda cls: cls.__name__)
def test_status_for_each_error(error_class: type[engine_errors.EngineError]) -> None:
    error = error_class("do this next", adapter="owner/name", rank=32)
    expected_code = EXPECTED_CODES[error_class]
    assert status_code_for(error) is expected_code

    status = to_rpc_status(error)
    assert status.code is expected_code
    assert status.details == "do this next"
    decoded, infos = _decode(status)
    assert decoded.code == getattr(code_pb2, expected_code.name) == expected_code.value[0]
    assert decoded.message == "do this next"
    (info,) = infos
    assert info.domain == ERROR_DOMAIN == "loraswap"
    assert info.reason == EXPECTED_REASONS[error_class]
    assert dict(info.metadata) == {"adapter": "owner/name", "rank": "32"}


@pytest.mark.parametrize(
    ("error", "code", "reason", "metadata"),
    [
        (engine_errors.AdapterFormatError("pickle", reason="ADAPTER_PICKLE_REFUSED"),
         grpc.StatusCode.INVALID_ARGUMENT, "ADAPTER_PICKLE_REFUSED", {}),
        (engine_errors.AdapterIncompatibleError("rank", reason="ADAPTER_RANK_TOO_HIGH", rank=128, max_rank=64),
         grpc.StatusCode.FAILED_PRECONDITION, "ADAPTER_RANK_TOO_HIGH", {"rank": "128", "max_rank": "64"}),
        (engine_errors.BaseModelMismatchError(
            "made for SDXL", adapter_base="stabilityai/stable-diffusion-xl-base-1.0",
            served_base="black-forest-labs/FLUX.1-dev", source="safetensors:base_model"),
         grpc.StatusCode.FAILED_PRECONDITION, "BASE_MODEL_MISMATCH",
         {"adapter_base": "stabilityai/stable-diffusion-xl-base-1.0", "served_base": "black-forest-labs/FLUX.1-dev",
          "source": "safetensors:base_model"}),
        (engine_errors.InvalidRequestError("bad", field="width"),
         grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST", {"field": "width"}),
        (INTERNAL_ERROR, grpc.StatusCode.INTERNAL, "INTERNAL", {}),
    ],
)  # fmt: skip
def test_reason_overrides_and_metadata(error, code: grpc.StatusCode, reason: str, metadata: dict) -> None:
    status = to_rpc_status(error)
    assert status.code is code
    _, (info,) = _decode(status)
    assert info.reason == reason
    assert dict(info.metadata) == metadata


def test_subclass_takes_its_nearest_ancestor_code() -> None:
    class RankTooHighError(engine_errors.AdapterIncompatibleError):
        reason = engine_errors.ErrorReason.ADAPTER_RANK_TOO_HIGH

    class Unlisted(engine_errors.EngineError):
        pass

    assert status_code_for(RankTooHighError("x")) is grpc.StatusCode.FAILED_PRECONDITION
    assert status_code_for(Unlisted("x")) is grpc.StatusCode.INTERNAL
    _, (info,) = _decode(to_rpc_status(RankTooHighError("x")))
    assert info.reason == "ADAPTER_RANK_TOO_HIGH"


def test_reasons_are_upper_snake_case() -> None:
    for error_class in ALL_ERRORS:
        reason = error_class.reason
        assert reason == reason.upper() and reason.replace("_", "").isalnum(), reason


RETRY_CASES = [
    (engine_errors.QueueFullError("full; retry", retry_after_s=2.5), 2.5),
    (engine_errors.QueueFullError("full; retry"), 1.0),
    (engine_errors.NotServingError("starting; retry"), 1.0),
    (engine_errors.NotServingError("going away", reason=engine_errors.ErrorReason.SHUTTING_DOWN), 1.0),
    (engine_errors.AdapterNotFoundError("no such adapter"), None),
    (engine_errors.InvalidRequestError("bad width", field="width"), None),
    (access.TokenMissingError("send a token"), None),
    # A URL's server said when to come back (Retry-After): that, and only then.
    (
        engine_errors.UrlUnavailableError("429", reason=engine_errors.ErrorReason.URL_RATE_LIMITED, retry_after_s="7"),
        7.0,
    ),
    (engine_errors.UrlUnavailableError("503", reason=engine_errors.ErrorReason.URL_SERVER_ERROR), None),
]


@pytest.mark.parametrize(("error", "delay_s"), RETRY_CASES, ids=lambda value: getattr(value, "reason", value))
def test_retry_info_only_where_a_retry_can_succeed(error, delay_s) -> None:
    _, by_kind = _details(to_rpc_status(error))
    retry_infos = by_kind[error_details_pb2.RetryInfo]
    if delay_s is None:
        assert retry_infos == []
    else:
        (retry_info,) = retry_infos
        assert retry_info.retry_delay.ToNanoseconds() == round(delay_s * 1e9)
    assert len(by_kind[error_details_pb2.ErrorInfo]) == 1


@pytest.mark.parametrize(
    "error",
    [
        engine_errors.InvalidRequestError("width 65 is not a multiple of 16", field="width"),
        engine_errors.InvalidRequestError("adapter is empty", field="adapter"),
        engine_errors.AdapterNameError("a name may not hold `..`", field="adapters[1].adapter"),
    ],
    ids=lambda error: error.metadata["field"],
)
def test_bad_request_names_the_field_at_fault(error) -> None:
    decoded, by_kind = _details(to_rpc_status(error))
    (bad_request,) = by_kind[error_details_pb2.BadRequest]
    (violation,) = bad_request.field_violations
    assert (violation.field, violation.description) == (error.metadata["field"], error.message)
    (info,) = by_kind[error_details_pb2.ErrorInfo]
    assert info.metadata["field"] == error.metadata["field"] and decoded.message == error.message


def test_no_bad_request_without_a_field() -> None:
    _, by_kind = _details(to_rpc_status(engine_errors.AdapterFormatError("truncated file")))
    assert by_kind[error_details_pb2.BadRequest] == []
