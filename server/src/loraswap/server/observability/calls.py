"""One RPC as the observers see it: who asked for what, how it ended, where its time went."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from loraswap.server.engine.types import Timings

REQUEST_ID_KEY = "x-request-id"
# The short names of DiffusionService's RPCs (tests/unit/test_rpc_methods.py keeps them equal to the contract's).
RPC_METHODS = ("Generate", "ListAdapters", "GetServerInfo", "PreloadAdapter", "Evict")
# What a call to any other method path under the service counts and logs as: a caller picks the path, so its
# name would make the metrics' `method` label (and the log) as big as the caller likes.
UNKNOWN_METHOD = "unknown"
# A caller's request id is kept when it is this short and printable; otherwise the server makes one.
MAX_REQUEST_ID_CHARS = 128


def method_name(rpc: str) -> str:
    """The name a call to `rpc` (the last part of its method path) is counted and logged under."""
    return rpc if rpc in RPC_METHODS else UNKNOWN_METHOD


def request_id_from(sent: str | None) -> str:
    """The caller's `x-request-id` when it is usable (visible ASCII, at most 128 characters), else a new one."""
    if sent and len(sent) <= MAX_REQUEST_ID_CHARS and sent.isascii() and sent.isprintable() and " " not in sent:
        return sent
    return uuid.uuid4().hex


@dataclass
class CallRecord:
    """A DiffusionService call, filled in while it runs and handed to the observers when it ends."""

    method: str  # the RPC's short name (Generate, PreloadAdapter, ...), or UNKNOWN_METHOD
    request_id: str
    started_unix_ns: int = field(default_factory=time.time_ns)
    started: float = field(default_factory=time.perf_counter)
    code: str = "OK"  # the gRPC status code's name
    reason: str = ""  # the ErrorInfo reason, when the call failed with one
    duration_s: float = 0.0
    # What was asked: the adapters named (a stack's members, or the one adapter), the prompt, steps and size.
    adapters: tuple[str, ...] = ()
    prompt: str = ""
    steps: int | None = None
    width: int | None = None
    height: int | None = None
    # Generate only: where the image's time went, and whether its adapters were fused (None: no image came out).
    timings: Timings | None = None
    fused: bool | None = None
    # W3C trace context headers the caller sent (traceparent, tracestate).
    trace_headers: dict[str, str] = field(default_factory=dict)

    def finish(self, code: str, reason: str = "") -> None:
        """Record how the call ended, and its duration."""
        self.code = code
        self.reason = reason
        self.duration_s = time.perf_counter() - self.started

    @property
    def ended_unix_ns(self) -> int:
        return self.started_unix_ns + round(self.duration_s * 1e9)
