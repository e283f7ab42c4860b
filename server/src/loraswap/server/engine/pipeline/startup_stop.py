"""A stop asked of a start-up still under way, and the stopping points where the start-up looks for it.

The start-up cannot be interrupted inside torch, so it checks a `StartupStop` instead: before each phase, before
each warm-up pass and at each warm-up step, like a request's cancel flag.
"""

from __future__ import annotations

from loraswap.server.engine.errors import StartupStopped


class StartupStop:
    """A stop request the start-up checks at its stopping points; it remembers the phase it came in.

    Set from the event loop, read on the worker thread: each field is one assignment, which needs no lock.
    """

    def __init__(self) -> None:
        self.phase = "load"
        self.requested_in: str | None = None

    def request(self) -> None:
        """Ask the start-up to stop at its next stopping point (a second request changes nothing)."""
        if self.requested_in is None:
            self.requested_in = self.phase

    @property
    def requested(self) -> bool:
        return self.requested_in is not None

    def check(self) -> None:
        """Raise StartupStopped if a stop was requested."""
        if self.requested_in is not None:
            raise StartupStopped(self.requested_in)

    def enter(self, phase: str) -> None:
        """A stopping point: stop here if asked to, else go on into `phase`."""
        self.check()
        self.phase = phase
