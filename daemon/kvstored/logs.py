"""Log lines of ``kvstored``: readable text for a terminal, JSON lines for a collector.

Every logger of the process (``kvstored.*``, ``kvstore.*``, grpc's and asyncio's Python
loggers, ``warnings``) ends in the one handler installed by :func:`setup_logging`, so a
``log_format = "json"`` daemon writes nothing on stderr that is not one JSON object per
line (except what grpc's C core prints itself, outside Python logging).

What is logged: one line per lifecycle event (start, serving, signal, drain, stop, a
stale socket or arena cleaned up) and one per error; never one per block or per call,
which is what the metrics are for. A lifecycle line names its ``event`` through
``extra``; the JSON form carries it, and any other ``extra`` field, as its own key::

    log.info("metrics on %s", url, extra={"event": "metrics", "url": url})
    -> {"ts": "2025-01-01T12:00:00.000Z", "level": "info", "logger": "kvstored",
        "msg": "metrics on http://127.0.0.1:9464/metrics", "event": "metrics",
        "url": "http://127.0.0.1:9464/metrics", "pid": 4242}

The text form is unchanged from the first daemon: ``time level logger: message``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any, TextIO

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# Attributes every LogRecord has; anything else on a record came from ``extra``.
_RECORD_FIELDS = frozenset(
    logging.LogRecord("", logging.INFO, "", 0, "", None, None).__dict__
) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (newlines in tracebacks are escaped)."""

    def __init__(self) -> None:
        super().__init__()
        self._pid = os.getpid()

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": _utc_timestamp(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for name, value in record.__dict__.items():
            if name not in _RECORD_FIELDS and not name.startswith("_"):
                entry[name] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        entry["pid"] = self._pid
        return json.dumps(entry, default=str, ensure_ascii=False)


def _utc_timestamp(created: float) -> str:
    """``2025-01-01T12:00:00.123Z``: RFC 3339, UTC, milliseconds."""
    seconds = int(created)
    millis = int((created - seconds) * 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{millis:03d}Z"


def make_formatter(log_format: str) -> logging.Formatter:
    if log_format == "json":
        return JsonFormatter()
    if log_format == "text":
        return logging.Formatter(TEXT_FORMAT)
    raise ValueError(f"unknown log format {log_format!r}")


def setup_logging(level: str, log_format: str, stream: TextIO | None = None) -> None:
    """Send every Python logger of the process to ``stream`` (stderr) in one format."""
    handler = logging.StreamHandler(sys.stderr if stream is None else stream)
    handler.setFormatter(make_formatter(log_format))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    logging.captureWarnings(True)
