"""The server's log lines: readable text (default) or one JSON object per line (python-json-logger).

Log calls pass their structured fields as `extra`; JSON puts each at the top level of the object, text appends
them to the line as `key=value` (quoted when they hold spaces), so both formats carry the same facts.
"""

from __future__ import annotations

import json
import logging
import sys

from pythonjsonlogger.json import JsonFormatter

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
JSON_FIELDS = "%(asctime)s %(levelname)s %(name)s %(message)s"
# What every LogRecord has; anything else on a record came from `extra`.
_RECORD_ATTRIBUTES = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


def extra_fields(record: logging.LogRecord) -> dict[str, object]:
    """The fields a log call passed as `extra`, in the order given."""
    return {key: value for key, value in record.__dict__.items() if key not in _RECORD_ATTRIBUTES}


def _text_value(value: object) -> str:
    text = ",".join(str(item) for item in value) if isinstance(value, (list, tuple)) else str(value)
    if text == "" or any(char.isspace() or char in '"=' for char in text):
        return json.dumps(text, ensure_ascii=False)
    return text


class KeyValueFormatter(logging.Formatter):
    """The usual text line, followed by the record's `extra` fields as key=value pairs."""

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
