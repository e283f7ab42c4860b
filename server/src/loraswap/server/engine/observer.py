"""What the engine reports while it works, for whoever watches it (metrics, traces); no-ops by default.

The engine calls an `EngineObserver` at the moment something happens: a cache lookup, an adapter load, an
eviction, a job leaving the queue, a swap, a denoising step, a finished image. Levels that can be read at any
moment (queue depth, cache bytes, recompilations) are not reported: a watcher reads them when it wants them,
from `DiffusionEngine.gauges()`. Nothing here knows Prometheus, OpenTelemetry or log formats.

The calls come from the worker thread and the loader threads: an observer must be thread-safe and quick,
because a step waits for its call to return.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class SwapPath(enum.Enum):
    """How the adapters a swap put in place got to the cache."""

    WARM = "warm"  # every adapter was already cached when the request arrived
    COLD = "cold"  # the request had to read, convert and validate at least one of them first


class SwapMode(enum.Enum):
    """How a swap applied its adapters (--fuse)."""

    FUSED = "fused"  # merged into the base weights
    UNFUSED = "unfused"  # copied into the swap slot (and the base model: the LoRA branch skipped)


@dataclass(frozen=True)
class EngineGauges:
    """Levels of the engine at one moment, each read under at most one short lock (never one held over a step)."""

    queue_depth: int
    cache_bytes: int
    cache_entries: int
    recompilations: int
    swaps: int


class EngineObserver:
    """Receives the engine's events; every method does nothing here. Subclass and override what you need."""

    def cache_lookup(self, hit: bool) -> None:
        """An adapter was asked of the cache: `hit` when it was there, else a load starts (or is joined)."""

    def adapter_loaded(self, seconds: float) -> None:
        """An adapter was read, converted and validated into the cache, taking `seconds`."""

    def url_download(self, host: str, outcome: str, transferred_bytes: int) -> None:
        """A URL adapter was fetched from `host` (the --allow-url-host rule that allowed it: a bounded set):
        `outcome` is "downloaded", "not_modified" (revalidated, the file on disk served), "disk" (pinned by
        #sha256= and on disk: nothing sent) or the ErrorReason of a failure; `transferred_bytes` of body came."""

    def adapters_evicted(self, count: int) -> None:
        """`count` adapters left the cache (an Evict, or the byte budget making room)."""

    def job_dequeued(self, wait_seconds: float) -> None:
        """A job left the queue for the worker after waiting `wait_seconds`."""

    def swapped(self, path: SwapPath, mode: SwapMode, seconds: float) -> None:
        """The swap slot changed to a job's adapters (or to the base model), fused or not, taking `seconds`."""

    def step_done(self, seconds: float) -> None:
        """One denoising step of a served request finished, taking `seconds` (warm-up steps are not reported)."""

    def image_done(self) -> None:
        """A generation finished with an image."""


NO_OBSERVER = EngineObserver()
