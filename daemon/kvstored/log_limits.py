"""The one rate-limited logger of every path that logs per request or per connection.

Such a path can be driven by anyone who reaches a socket: a flood of malformed replay
requests or local-call frames, clients that connect and vanish, an ``accept()`` that
fails while the process is out of descriptors. Each would write a line per event and
bury the log (and the disk under it). Through :data:`LIMITED` each *kind* of line is
written at most once per ``EVERY_S``; the next one written says how many of its kind
were held back since. Lines of other kinds are not held back by it. Thread-safe: the
event loop, the KV event publisher's thread and the pools all log through it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

EVERY_S = 10.0  # one line of a kind per this many seconds


class RateLimitedLog:
    """See the module docstring."""

    def __init__(self, every_s: float = EVERY_S) -> None:
        self.every_s = every_s
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}  # kind -> when its last line was written
        self._held: dict[str, int] = {}  # kind -> lines held back since

    def log(
        self, log: logging.Logger, level: int, kind: str, msg: str, *args: Any, **kwargs: Any
    ) -> bool:
        """``log.log(level, msg, *args)`` unless a line of ``kind`` was written less
        than ``every_s`` ago (then it is counted); whether it was written."""
        if not log.isEnabledFor(level):
            return False
        now = time.monotonic()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self.every_s:
                self._held[kind] = self._held.get(kind, 0) + 1
                return False
            self._last[kind] = now
            held = self._held.pop(kind, 0)
        if held:
            msg = f"{msg} (and {held} more like it in the last {now - (last or now):.0f} s)"
        extra = kwargs.pop("extra", None) or {}
        log.log(level, msg, *args, extra={"event": kind, **extra}, **kwargs)
        return True

    def warning(self, log: logging.Logger, kind: str, msg: str, *args: Any, **kwargs: Any) -> bool:
        return self.log(log, logging.WARNING, kind, msg, *args, **kwargs)

    def info(self, log: logging.Logger, kind: str, msg: str, *args: Any, **kwargs: Any) -> bool:
        return self.log(log, logging.INFO, kind, msg, *args, **kwargs)

    def error(self, log: logging.Logger, kind: str, msg: str, *args: Any, **kwargs: Any) -> bool:
        return self.log(log, logging.ERROR, kind, msg, *args, **kwargs)


LIMITED = RateLimitedLog()  # the daemon's (one per process, like its log)
