"""The router's log lines: timestamped text or one JSON object per line, with fields.

Every line starts with its time (UTC, milliseconds). A call site attaches structured fields
with :func:`kv` (``log.info("replica drained", extra=kv(pool=p, replica=r))``): the text
format appends them to the message as ``key=value`` pairs (logfmt quoting), the JSON format
puts them beside ``ts``, ``level``, ``logger`` and ``message`` so a log pipeline can filter on
them without parsing prose. Standard library logging only: third-party code (uvicorn, httpx,
the event SDK) logs through the same handler and gets the same format.

:func:`configure` is what ``kvrouter serve`` calls (``--log-format``, ``server.log_format``).
It keeps httpx and httpcore (every ``/metrics`` scrape and health probe of every replica is a
request of theirs) at WARNING unless the level is ``debug``: at INFO they were 1,772 of 1,779
lines after ten minutes and buried everything else.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from typing import Any, TextIO

__all__ = ["FIELDS", "JsonFormatter", "TextFormatter", "configure", "kv"]

FIELDS = "fields"
"""The ``LogRecord`` attribute :func:`kv` fills (a dict of structured fields)."""

_CORE = ("ts", "level", "logger", "message")
_CHATTY = ("httpx", "httpcore")
"""Loggers that log every HTTP request the router makes (scrapes, probes, tokenizer calls)."""


def kv(**fields: Any) -> dict[str, Any]:
    """``extra=`` for a logging call: structured fields of the line."""
    return {FIELDS: fields}


def timestamp(created: float) -> str:
    """``2025-06-01T12:00:00.123Z``: ISO 8601, UTC, milliseconds (sortable as text)."""
    secs = int(created)
    ms = int((created - secs) * 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(secs)) + f".{ms:03d}Z"


_QUOTE = re.compile(r'[\s="\\]')


def _logfmt(value: Any) -> str:
    """A logfmt value: ``-`` for None, ``true``/``false``, floats to 6 digits, text quoted
    when it must be."""
    if value is None:
        return "-"
    kind = type(value)
    if kind is bool:
        return "true" if value else "false"
    if kind is int:
        return str(value)
    if kind is float:
        return f"{value:.6g}"
    text = str(value)
    if not text or _QUOTE.search(text):
        return json.dumps(text, ensure_ascii=False)
    return text


class TextFormatter(logging.Formatter):
    """``<ts> <LEVEL> <logger>: <message> key=value ...`` and the traceback, if any."""

    def format(self, record: logging.LogRecord) -> str:
        line = f"{timestamp(record.created)} {record.levelname} {record.name}: "
        line += record.getMessage()
        fields = getattr(record, FIELDS, None)
        if fields:
            line += " " + " ".join(f"{k}={_logfmt(v)}" for k, v in fields.items())
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        elif record.stack_info:
            line += "\n" + self.formatStack(record.stack_info)
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts``, ``level``, ``logger``, ``message``, the fields of
    :func:`kv` (a field never replaces one of those four), and ``exception`` with the
    traceback when there is one. Values JSON cannot hold are written as their ``str``."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": timestamp(record.created),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, FIELDS, None)
        if fields:
            for k, v in fields.items():
                out[k if k not in _CORE else f"field_{k}"] = v
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        elif record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def configure(level: str, fmt: str = "text", stream: TextIO | None = None) -> logging.Handler:
    """Send every log line of the process to ``stream`` (stderr) in ``fmt`` ("text" or
    "json") at ``level``, replacing any handler the root logger had; returns the handler."""
    if fmt not in ("text", "json"):
        raise ValueError(f"log format must be 'text' or 'json', got {fmt!r}")
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    numeric = logging.getLevelName(level.upper())
    root.setLevel(numeric)
    for name in _CHATTY:
        logging.getLogger(name).setLevel(logging.DEBUG if numeric <= logging.DEBUG else "WARNING")
    logging.captureWarnings(True)  # Python warnings as log lines too (JSON stays JSON)
    return handler
