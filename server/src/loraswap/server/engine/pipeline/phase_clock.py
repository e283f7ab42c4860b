"""The start-up's log lines: each phase as it begins and as it ends, with its duration, and the steps of a long one.

Every line names its phase in the record's extra: `phase`, `event` (begins, step or done) and `seconds`, how long
the phase had run when the line was written (0 as it begins, its duration when done), so that the last line of a
start-up that never finishes says where it stopped and for how long it had been there.
"""

from __future__ import annotations

import logging
import time

# Every start-up line goes to the start-up's logger, whichever module writes it: operators (and the tests) pick the
# phase lines out by this name.
STARTUP_LOG = logging.getLogger("loraswap.server.engine.pipeline.startup")


class PhaseClock:
    """Logs each start-up phase as it begins and as it ends, with its duration."""

    def __init__(self) -> None:
        self.started = self._phase_started = time.perf_counter()

    def begin(self, phase: str, detail: str) -> None:
        """The line of a phase that begins: `detail` says what it will do."""
        self._phase_started = time.perf_counter()
        STARTUP_LOG.info(
            "start-up %s: begins, %s", phase, detail, extra={"phase": phase, "event": "begins", "seconds": 0.0}
        )

    def done(self, phase: str, detail: str) -> None:
        """The line of a phase that ended, with how long it took: `detail` says what it made."""
        now = time.perf_counter()
        seconds = now - self._phase_started
        STARTUP_LOG.info(
            "start-up %s: %.2f s, %s", phase, seconds, detail,
            extra={"phase": phase, "event": "done", "seconds": round(seconds, 3)},
        )  # fmt: skip
        self._phase_started = now

    @property
    def total_seconds(self) -> float:
        return time.perf_counter() - self.started


def log_step(phase: str, phase_started: float, detail: str) -> None:
    """A step within a phase that may take long (a warm-up pass: its first call compiles), logged as it begins."""
    seconds = time.perf_counter() - phase_started
    STARTUP_LOG.info(
        "start-up %s: %s, %.1f s into the phase", phase, detail, seconds,
        extra={"phase": phase, "event": "step", "seconds": round(seconds, 3)},
    )  # fmt: skip
