r"""The server's log lines: readable text (default) or one JSON object per line (python-json-logger).

Log calls pass their structured fields as `extra`; JSON puts each at the top level of the object, text appends
them to the line as `key=value`, so both formats carry the same facts.

Values come from callers (adapter names, prompts, method paths), so text lines escape them: in the message and
in every value, a character that is not printable (a newline, ESC and the rest of C0 and C1, DEL, U+2028, a
bidi override, a space other than ' ') is written as JSON writes it (`\n`, `\u001b`), and a value holding
such a character, a space, `"`, `=` or a backslash, or none at all, is written as a JSON string. One record is one
line (a traceback follows it on lines of its own), and a value reads back with `json.loads`.
"""

from __future__ import annotations

import logging
import sys

from pythonjsonlogger.json import JsonFormatter

from loraswap.server.config import LOG_FORMATS

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
JSON_FIELDS = "%(asctime)s %(levelname)s %(name)s %(message)s"
# What every LogRecord has; anything else on a record came from `extra`.
_RECORD_ATTRIBUTES = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


def extra_fields(record: logging.LogRecord) -> dict[str, object]:
    """The fields a log call passed as `extra`, in the order given."""
    return {key: value for key, value in record.__dict__.items() if key not in _RECORD_ATTRIBUTES}


_SHORT_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b", "\f": "\\f"}


def _escape(char: str) -> str:
    if char in _SHORT_ESCAPES:
        return _SHORT_ESCAPES[char]
    code = ord(char)
    if code > 0xFFFF:  # as JSON writes it: a surrogate pair
        code -= 0x10000
        return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"
    return f"\\u{code:04x}"


def escaped(text: str) -> str:
    """`text` with each character that is not printable written as a JSON escape: it stays on one line, and
    writes nothing a terminal would act on."""
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() else _escape(char) for char in text)


def _json_string(text: str) -> str:
    # Not json.dumps: with ensure_ascii=False it leaves DEL, C1 controls and U+2028 as they are.
    return '"' + "".join(_escape(char) if char in '"\\' or not char.isprintable() else char for char in text) + '"'


def _text_value(value: object) -> str:
    text = ",".join(str(item) for item in value) if isinstance(value, (list, tuple)) else str(value)
    if text and text.isprintable() and not any(char in ' "=\\' for char in text):
        return text
    return _json_string(text)


class KeyValueFormatter(logging.Formatter):
    """The usual text line, its message escaped, followed by the record's `extra` fields as key=value pairs."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        if record.message.isprintable():
            return super().formatMessage(record)
        # A copy, so that other handlers of the record still see its message as it was.
        return super().formatMessage(logging.makeLogRecord({**record.__dict__, "message": escaped(record.message)}))

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = extra_fields(record)
        if not fields:
            return line
        pairs = " ".join(f"{key}={_text_value(value)}" for key, value in fields.items())
        # An exception's traceback stays at the end.
        head, newline, tail = line.partition("\n")
        return f"{head} {pairs}{newline}{tail}"


def formatter_for(log_format: str) -> logging.Formatter:
    """The formatter of `--log-format` (text or json)."""
    if log_format == "json":
        return JsonFormatter(JSON_FIELDS, rename_fields={"levelname": "level", "name": "logger"}, timestamp=False)
    if log_format == "text":
        return KeyValueFormatter(TEXT_FORMAT)
    raise ValueError(f"unknown log format {log_format!r}; use one of {', '.join(LOG_FORMATS)}")


def configure_logging(level: str, log_format: str) -> None:
    """Send every log record to stderr in `log_format`, at `level` and above."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter_for(log_format))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
