"""Errors quote input bounded: gRPC carries the message and ErrorInfo in headers clients cap at 16 KiB in all."""

from __future__ import annotations

import pytest

from loraswap.server.engine.errors import (
    MAX_ECHO_CHARS,
    MAX_MESSAGE_CHARS,
    AdapterNotFoundError,
    shorten,
)


@pytest.mark.parametrize(
    ("value", "expected"), [("abc", "abc"), ("x" * 200, "x" * 200), ("x" * 201, "x" * 199 + "\u2026")]
)
def test_shorten_keeps_short_values_and_cuts_long_ones(value: str, expected: str) -> None:
    assert shorten(value) == expected
    assert len(shorten(value)) <= MAX_ECHO_CHARS


def test_an_error_bounds_its_message_and_metadata_whatever_it_is_given() -> None:
    huge = "n" * 20_000
    error = AdapterNotFoundError(f"no adapter named {huge}", adapter=huge)
    assert len(error.message) == MAX_MESSAGE_CHARS and error.message.endswith("\u2026")
    assert str(error) == error.message
    assert error.metadata["adapter"] == shorten(huge)
