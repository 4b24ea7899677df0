"""How an engine integration lives with a failing daemon: kvstore is a cache, so a call
that fails is a miss (the engine computes, and stores nothing), never a failed request.

After a failure the integration answers misses for ``retry_after_s`` without asking
the daemon again, so a daemon that is down or slow does not stall every step on a
deadline. A broken daemon is seen by every request, and the log should say so once,
not thousands of times: each kind of warning is logged at most once per
``WARN_EVERY_S``; and when a call succeeds again after failures, one INFO line says so.
"""

from __future__ import annotations

import logging
import time

WARN_EVERY_S = 60.0  # one warning of a kind per this many seconds


class Outage:
    """Rate-limited warnings and the ``retry_after_s`` pause after a failed call."""

    def __init__(self, log: logging.Logger, retry_after_s: float, name: str = "kvstore") -> None:
        """``name``: what the lines call the daemon (say, ``kvstore at ADDR``)."""
        self._log = log
        self._retry_after_s = retry_after_s
        self._name = name
        self._down_until = 0.0
        self._failing_since: float | None = None  # the first failure since the last answer
        self._warned: dict[str, float] = {}  # kind -> when it was last logged

    @property
    def down(self) -> bool:
        """Whether a call failed less than ``retry_after_s`` ago (answer misses)."""
        return time.monotonic() < self._down_until

    def failed(self, kind: str, message: str, *args: object) -> None:
        """A call failed: pause for ``retry_after_s`` and warn (rate-limited)."""
        now = time.monotonic()
        self._down_until = now + self._retry_after_s
        if self._failing_since is None:
            self._failing_since = now
        self.warn(kind, message, *args)

    def answered(self) -> None:
        """A call succeeded: after failures, one INFO line says the daemon is back."""
        if self._failing_since is not None:
            self._log.info(
                "%s answers again (it failed %.0f s ago)",
                self._name, time.monotonic() - self._failing_since,
            )  # fmt: skip
            self._failing_since = None

    def warn(self, kind: str, message: str, *args: object) -> None:
        """``log.warning(message, *args)``, unless ``kind`` was logged lately."""
        now = time.monotonic()
        if now - self._warned.get(kind, -WARN_EVERY_S) >= WARN_EVERY_S:
            self._warned[kind] = now
            self._log.warning(message, *args)
