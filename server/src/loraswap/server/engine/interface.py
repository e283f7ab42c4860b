"""The engine as a front end sees it: what the transport, the app and the observers may call, and nothing else.

DiffusionEngine is the one implementation; test doubles (tests/support/engines.py) satisfy it too, and a
unit test holds both to these signatures.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol, runtime_checkable

from loraswap.server.engine.observer import EngineGauges
from loraswap.server.engine.types import (
    AdapterCacheSummary,
    GenerationEvent,
    GenerationRequest,
    PreloadResult,
    ServerDescription,
)


@runtime_checkable
class Engine(Protocol):
    """A resident model serving generations, with its adapter cache; plain domain types in and out."""

    async def start(self) -> None:
        """Load and warm up; returns when serving. Raises StartupError for what it cannot start with, and
        StartupStopped when stop() came first."""

    def stop_accepting(self) -> None:
        """New generations are refused with NotServingError; queued ones still run."""

    async def drain(self, timeout: float) -> bool:
        """Wait up to `timeout` s for queued and running generations to finish; True if they did."""

    def abort_all(self, message: str) -> None:
        """Fail every queued and running generation with NotServingError(message)."""

    async def stop(self, timeout: float | None = None) -> None:
        """Finish the queued work (up to timeout seconds) and end the engine's threads; a start-up still running
        stops at its next stopping point. Raises TimeoutError when the worker is still busy after `timeout`."""

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        """Validate and queue a request; yield Queued/StepProgress events, then the GeneratedImage."""

    async def preload(self, name: str, link: str | None = None) -> PreloadResult:
        """Make an adapter ready in the cache; idempotent. `link`: a URL adapter's full URL (`name`: its public
        identity)."""

    def reload_url_tokens(self) -> bool:
        """Re-read --url-token-file (on SIGHUP); False when there is none. ValueError or OSError for a file it
        cannot use: the tokens read before stay."""

    def evict(self, name: str) -> int:
        """Drop an adapter from the cache; returns the bytes freed."""

    def list_adapters(self) -> AdapterCacheSummary:
        """The cached adapters, most recently used first."""

    def describe(self) -> ServerDescription:
        """The resident model, its slot and its compile state."""

    def gauges(self) -> EngineGauges:
        """The engine's levels now (queue, cache, recompilations, swaps); cheap and safe from any thread."""
