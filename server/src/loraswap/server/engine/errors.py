"""Domain errors raised by the engine.

Each error carries a `reason` from the closed `ErrorReason` vocabulary and a
message that says what the caller should change. The transport maps each class
to one gRPC status in a single table (loraswap.server.transport.errors);
nothing here knows about gRPC.
"""

from __future__ import annotations

import enum

# gRPC carries the message and the ErrorInfo in headers that clients cap at 16 KiB in all (beyond it the
# caller sees RESOURCE_EXHAUSTED instead of the real status), so no echoed input may grow them unbounded.
MAX_ECHO_CHARS = 200
MAX_MESSAGE_CHARS = 2000


def shorten(value: object, limit: int = MAX_ECHO_CHARS) -> str:
    """`value` as text of at most `limit` characters, cut with an ellipsis: for quoting input back to callers."""
    text = str(value)
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


class ErrorReason(str, enum.Enum):
    """Every reason the engine gives callers; the only place reasons are spelled.

    The contract mirrors this list as `loraswap.v1.ErrorReason`, whose value
    `ERROR_REASON_<name>` is sent as the bare `<name>`: the value here is that
    wire string. tests/unit/test_error_reasons.py keeps the two lists equal.
    """

    INVALID_REQUEST = "INVALID_REQUEST"
    INVALID_ADAPTER_NAME = "INVALID_ADAPTER_NAME"
    ADAPTER_NOT_FOUND = "ADAPTER_NOT_FOUND"
    ADAPTER_MALFORMED = "ADAPTER_MALFORMED"
    ADAPTER_PICKLE_REFUSED = "ADAPTER_PICKLE_REFUSED"
    ADAPTER_BAD_DTYPE = "ADAPTER_BAD_DTYPE"
    ADAPTER_NOT_FINITE = "ADAPTER_NOT_FINITE"
    ADAPTER_OUT_OF_RANGE = "ADAPTER_OUT_OF_RANGE"
    ADAPTER_UNSUPPORTED_TENSORS = "ADAPTER_UNSUPPORTED_TENSORS"
    ADAPTER_SHAPE_MISMATCH = "ADAPTER_SHAPE_MISMATCH"
    ADAPTER_NO_DENOISER_LAYERS = "ADAPTER_NO_DENOISER_LAYERS"
    ADAPTER_INCOMPATIBLE = "ADAPTER_INCOMPATIBLE"
    ADAPTER_RANK_TOO_HIGH = "ADAPTER_RANK_TOO_HIGH"
    ADAPTER_LAYER_NOT_TARGETED = "ADAPTER_LAYER_NOT_TARGETED"
    ADAPTER_TEXT_ENCODER_LAYERS = "ADAPTER_TEXT_ENCODER_LAYERS"
    ADAPTER_TOO_LARGE = "ADAPTER_TOO_LARGE"
    HUB_DISABLED = "HUB_DISABLED"
    QUEUE_FULL = "QUEUE_FULL"
    NOT_SERVING = "NOT_SERVING"
    SHUTTING_DOWN = "SHUTTING_DOWN"
    CANCELLED = "CANCELLED"
    GENERATION_FAILED = "GENERATION_FAILED"
    INTERNAL = "INTERNAL"
    ADAPTER_MISMATCH = "ADAPTER_MISMATCH"
    STACK_RANK_EXCEEDED = "STACK_RANK_EXCEEDED"
    ADAPTER_BAD_METADATA = "ADAPTER_BAD_METADATA"
    GENERATION_NOT_FINITE = "GENERATION_NOT_FINITE"
    TOKEN_MISSING = "TOKEN_MISSING"
    TOKEN_INVALID = "TOKEN_INVALID"
    ADMIN_REQUIRED = "ADMIN_REQUIRED"
    BASE_MODEL_MISMATCH = "BASE_MODEL_MISMATCH"
    ADAPTER_PINNED = "ADAPTER_PINNED"
    ADAPTER_KIND_UNSUPPORTED = "ADAPTER_KIND_UNSUPPORTED"
    FUSE_MEMORY_EXCEEDED = "FUSE_MEMORY_EXCEEDED"
    FUSE_CHOICE_UNAVAILABLE = "FUSE_CHOICE_UNAVAILABLE"
    URL_SCHEME_UNSUPPORTED = "URL_SCHEME_UNSUPPORTED"
    URL_CREDENTIALS_IN_NAME = "URL_CREDENTIALS_IN_NAME"
    URL_HOST_NOT_ALLOWED = "URL_HOST_NOT_ALLOWED"
    URL_INSECURE_NOT_ALLOWED = "URL_INSECURE_NOT_ALLOWED"
    URL_ADDRESS_NOT_ALLOWED = "URL_ADDRESS_NOT_ALLOWED"
    URL_REDIRECT_REFUSED = "URL_REDIRECT_REFUSED"
    URL_TOO_MANY_REDIRECTS = "URL_TOO_MANY_REDIRECTS"
    URL_DNS_FAILED = "URL_DNS_FAILED"
    URL_CONNECT_FAILED = "URL_CONNECT_FAILED"
    URL_TIMED_OUT = "URL_TIMED_OUT"
    URL_TLS_FAILED = "URL_TLS_FAILED"
    URL_ACCESS_DENIED = "URL_ACCESS_DENIED"
    URL_NOT_FOUND = "URL_NOT_FOUND"
    URL_GONE = "URL_GONE"
    URL_RATE_LIMITED = "URL_RATE_LIMITED"
    URL_SERVER_ERROR = "URL_SERVER_ERROR"
    URL_HTTP_ERROR = "URL_HTTP_ERROR"
    URL_CONTENT_ENCODING_REFUSED = "URL_CONTENT_ENCODING_REFUSED"
    URL_BODY_SHORT = "URL_BODY_SHORT"
    URL_CHECKSUM_MISMATCH = "URL_CHECKSUM_MISMATCH"
    URL_NOT_SAFETENSORS = "URL_NOT_SAFETENSORS"
    DISK_CACHE_FULL = "DISK_CACHE_FULL"
    ADAPTER_MIXED_KINDS = "ADAPTER_MIXED_KINDS"

    def __str__(self) -> str:
        # The wire string, on every Python version (3.10 would print "ErrorReason.NAME").
        return self.value


class EngineError(Exception):
    """Base of every error the engine reports to callers.

    `reason` may narrow the class's default; it must be an `ErrorReason`
    (or its exact string), so a reason outside the vocabulary fails at once.
    """

    reason: ErrorReason = ErrorReason.INTERNAL

    def __init__(self, message: str, *, reason: ErrorReason | str | None = None, **metadata: object) -> None:
        # Bounded here as well as where input is quoted, so no message or metadata value can overflow gRPC's headers.
        message = shorten(message, MAX_MESSAGE_CHARS)
        super().__init__(message)
        self.message = message
        if reason is not None:
            self.reason = ErrorReason(reason)
        self.metadata = {key: shorten(value) for key, value in metadata.items()}


class InvalidRequestError(EngineError):
    """A request field is out of range or malformed."""

    reason = ErrorReason.INVALID_REQUEST


class AdapterNameError(EngineError):
    """An adapter name breaks the grammar or tries to leave the adapter directory."""

    reason = ErrorReason.INVALID_ADAPTER_NAME


class AdapterNotFoundError(EngineError):
    """No adapter by that name exists (or it is not cached, for Evict)."""

    reason = ErrorReason.ADAPTER_NOT_FOUND


class AdapterFormatError(EngineError):
    """The adapter itself is unusable: unreadable, truncated, pickled, malformed, or made for another model."""

    reason = ErrorReason.ADAPTER_MALFORMED


class AdapterIncompatibleError(EngineError):
    """The adapter is valid but exceeds what this server was started with (max rank, slot layers, strictness)."""

    reason = ErrorReason.ADAPTER_INCOMPATIBLE


class FuseChoiceError(EngineError):
    """The request pins a path (GenerateRequest.fuse) this server cannot take for it; nothing was changed."""

    reason = ErrorReason.FUSE_CHOICE_UNAVAILABLE


class BaseModelMismatchError(EngineError):
    """The adapter declares a base model other than the one served (or --allow-base); nothing was loaded."""

    reason = ErrorReason.BASE_MODEL_MISMATCH


class AdapterPinnedError(EngineError):
    """Evict named an adapter the server keeps pinned (--pin); it stays cached."""

    reason = ErrorReason.ADAPTER_PINNED


class AdapterTooLargeError(EngineError):
    """The adapter is bigger than the server accepts."""

    reason = ErrorReason.ADAPTER_TOO_LARGE


class UrlRefusedError(EngineError):
    """A URL adapter this server may not fetch (host, plain HTTP, address, a redirect's target); nothing was sent
    to that host."""

    reason = ErrorReason.URL_HOST_NOT_ALLOWED


class UrlFetchError(EngineError):
    """A URL adapter's download failed in a way the same call will not mend (DNS, TLS, 401/403, a 4xx, a refused
    body, a checksum mismatch); nothing was cached."""

    reason = ErrorReason.URL_HTTP_ERROR


class UrlMissingError(EngineError):
    """The URL's server says the adapter is not there (404) or no longer there (410); nothing was cached."""

    reason = ErrorReason.URL_NOT_FOUND


class UrlUnavailableError(EngineError):
    """A URL adapter's download failed in a way a later retry may mend (a refused or timed-out connection, 429,
    5xx, a body cut short); nothing was cached. `retry_after_s` metadata: what the server's Retry-After said."""

    reason = ErrorReason.URL_CONNECT_FAILED


class HubDisabledError(EngineError):
    """A Hub adapter was asked for but the server runs without --allow-hub."""

    reason = ErrorReason.HUB_DISABLED


class QueueFullError(EngineError):
    """Too many requests are waiting."""

    reason = ErrorReason.QUEUE_FULL


class NotServingError(EngineError):
    """The engine is still starting or is shutting down."""

    reason = ErrorReason.NOT_SERVING


class GenerationCancelledError(EngineError):
    """The caller went away; the generation was stopped at a step boundary."""

    reason = ErrorReason.CANCELLED


class GenerationFailedError(EngineError):
    """The pipeline raised while generating; the server keeps serving."""

    reason = ErrorReason.GENERATION_FAILED


class StartupError(Exception):
    """The engine cannot start with its config (an adapter to preload or pin is unusable, pins overflow the cache).

    Not a caller's error: the message is one line for whoever starts the server, which then exits.
    """


class StartupStopped(Exception):
    """A stop came during start-up and the start-up reached a stopping point. Not a failure: the server exits 0."""

    def __init__(self, phase: str) -> None:
        super().__init__(f"stopped during start-up (phase {phase})")
        self.phase = phase
