"""Log records kept in memory, for tests that read what a real server in this process logged."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator, Mapping

ACCESS_LOGGER = "loraswap.access"
# How long the server may take to log what a call did: its handler can end a moment after the client's status.
LOGGED_WITHIN_S = 10.0


class KeptRecords(logging.Handler):
    """Every record that reaches the logger it is attached to, from its level up."""

    def __init__(self, level: int = logging.DEBUG) -> None:
        super().__init__(level=level)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def since(self, start: int) -> list[logging.LogRecord]:
        return self.records[start:]

    def _access_lines(self, request_id: str) -> list[logging.LogRecord]:
        return [r for r in self.records if r.name == ACCESS_LOGGER and getattr(r, "request_id", None) == request_id]

    def access(self, request_id: str) -> logging.LogRecord:
        """The one access line of the call with `request_id`."""
        (record,) = self._access_lines(request_id)
        return record

    async def logged_soon(self, request_id: str) -> logging.LogRecord:
        """The access line of a call, waited for up to LOGGED_WITHIN_S (a call the client gave up on, or one
        handled on another thread, is logged after the client has its status)."""
        deadline = time.monotonic() + LOGGED_WITHIN_S
        while time.monotonic() < deadline:
            if self._access_lines(request_id):
                return self.access(request_id)
            await asyncio.sleep(0.02)
        raise AssertionError(f"no access line for {request_id}")


@contextlib.contextmanager
def keeping_records(
    attach_to: str, levels: Mapping[str, int], handler_level: int = logging.DEBUG
) -> Iterator[KeptRecords]:
    """A KeptRecords on the logger `attach_to` ("" for the root), with each logger in `levels` set to its level;
    the handler and the levels are put back on the way out."""
    handler = KeptRecords(handler_level)
    previous = {name: logging.getLogger(name).level for name in levels}
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
    logging.getLogger(attach_to).addHandler(handler)
    try:
        yield handler
    finally:
        logging.getLogger(attach_to).removeHandler(handler)
        for name, level in previous.items():
            logging.getLogger(name).setLevel(level)
