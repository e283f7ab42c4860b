"""Domain errors raised by the engine.

Each error carries a stable UPPER_SNAKE_CASE `reason` and a message that says
what the caller should change. The transport maps each class to one gRPC
status in a single table (loraswap.server.transport.errors); nothing here
knows about gRPC.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base of every error the engine reports to callers."""

    reason = "ENGINE_ERROR"

    def __init__(self, message: str, *, reason: str | None = None, **metadata: object) -> None:
        super().__init__(message)
        self.message = message
        if reason is not None:
            self.reason = reason
        self.metadata = {key: str(value) for key, value in metadata.items()}


class InvalidRequestError(EngineError):
    """A request field is out of range or malformed."""

    reason = "INVALID_REQUEST"


class AdapterNameError(EngineError):
    """An adapter name breaks the grammar or tries to leave the adapter directory."""

    reason = "INVALID_ADAPTER_NAME"


class AdapterNotFoundError(EngineError):
    """No adapter by that name exists (or it is not cached, for Evict)."""

    reason = "ADAPTER_NOT_FOUND"


class AdapterFormatError(EngineError):
    """The adapter itself is unusable: unreadable, truncated, pickled, malformed, or made for another model."""

    reason = "ADAPTER_MALFORMED"


class AdapterIncompatibleError(EngineError):
    """The adapter is valid but exceeds what this server was started with (max rank, slot layers, strictness)."""

    reason = "ADAPTER_INCOMPATIBLE"


class AdapterTooLargeError(EngineError):
    """The adapter is bigger than the server accepts."""

    reason = "ADAPTER_TOO_LARGE"


class HubDisabledError(EngineError):
    """A Hub adapter was asked for but the server runs without --allow-hub."""

    reason = "HUB_DISABLED"


class QueueFullError(EngineError):
    """Too many requests are waiting."""

    reason = "QUEUE_FULL"


class NotServingError(EngineError):
    """The engine is still starting or is shutting down."""

    reason = "NOT_SERVING"


class GenerationCancelledError(EngineError):
    """The caller went away; the generation was stopped at a step boundary."""

    reason = "CANCELLED"


class GenerationFailedError(EngineError):
    """The pipeline raised while generating; the server keeps serving."""

    reason = "GENERATION_FAILED"
