"""Text log lines escape what callers write into them: one record is one printable line, each value reads back.

The integration cases (tests/integration/test_hostile_surfaces.py) send such values through a real server; this
table covers each kind of character the rule names, in a message and in a field.
"""

from __future__ import annotations

import json
import logging
import re

import pytest

from loraswap.server.observability.log_format import formatter_for

NASTY = {
    "newline": "one\ntwo",
    "carriage return": "one\rtwo",
    "ESC (a colour code)": "\x1b[31mred",
    "an OSC title and BEL": "\x1b]0;owned\x07",
    "C1 CSI": "\x9b2J",
    "DEL": "a\x7fb",
    "NUL": "a\x00b",
    "line separator": "a\u2028b",
    "a bidi override": "a\u202eb",
    "a no-break space": "a\u00a0b",
    "a lone surrogate": "a\udcffb",
    "a tag character (beyond the BMP)": "a\U000e0041b",
    "quotes, equals and a backslash": 'k="v" \\n',
}
READABLE = "café 日本 😀"  # printable beyond ASCII stays as it is


def _line(message_arg: str, field: str) -> str:
    record = logging.LogRecord("loraswap.access", logging.INFO, __file__, 1, "Evict %s", (message_arg,), None)
    record.adapter = field
    return formatter_for("text").format(record)


@pytest.mark.parametrize("value", NASTY.values(), ids=NASTY)
def test_a_value_is_escaped_in_the_message_and_in_a_field(value: str) -> None:
    line = _line(value, value)
    assert line.isprintable(), line
    (written,) = re.findall(r' adapter=("(?:[^"\\]|\\.)*")$', line)
    assert json.loads(written) == value


def test_printable_text_is_written_as_it_is() -> None:
    assert _line(READABLE, "outline").endswith(f"Evict {READABLE} adapter=outline")
    assert _line("x", READABLE).endswith(f' adapter="{READABLE}"')
