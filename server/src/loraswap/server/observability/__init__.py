"""What operators see of a running server: Prometheus metrics, access logs, start-up logs and OpenTelemetry traces.

Nothing here imports grpc: the transport's interceptor (transport/call_watch.py) turns each call into a
`CallRecord`, and the engine reports its events through `engine.observer.EngineObserver`.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def server_version() -> str:
    """The installed loraswap-server version ("unknown" when run from a tree that is not installed)."""
    try:
        return version("loraswap-server")
    except PackageNotFoundError:
        return "unknown"
