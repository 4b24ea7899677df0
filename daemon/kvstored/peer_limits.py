"""Connections per user on the daemon's unix sockets: one user cannot take its fds.

Each unix socket beside the gRPC one (local calls: kvstored.local_calls; the arena
hand-out: kvstored.arena_handout) counts the connections each user (uid, from
SO_PEERCRED) holds open, and closes at once a new one past
``max_connections_per_user``, logged at a bounded rate. Another user's process can
then hold at most that many of the daemon's file descriptors per socket, whatever it
does with them, and every other user is still served.
"""

from __future__ import annotations

import logging

from kvstored.log_limits import LIMITED

log = logging.getLogger("kvstored.peer_limits")


class ConnectionsPerUser:
    """The open connections of each uid on one socket (``what`` names it in the log)."""

    def __init__(self, limit: int, what: str) -> None:
        self.limit = limit
        self._what = what
        self._held: dict[int, int] = {}  # uid -> its open connections

    def admit(self, uid: int) -> bool:
        """Count a new connection of ``uid``; False (logged: close it) when that user
        holds ``limit`` already."""
        held = self._held.get(uid, 0)
        if held >= self.limit:
            LIMITED.warning(
                log, f"{self._what}_connections", "closing a %s connection of uid %d: it "
                "holds %d already (max_connections_per_user)", self._what, uid, held,
            )  # fmt: skip
            return False
        self._held[uid] = held + 1
        return True

    def release(self, uid: int) -> None:
        """A connection :meth:`admit` counted closed."""
        left = self._held.get(uid, 1) - 1
        if left > 0:
            self._held[uid] = left
        else:
            self._held.pop(uid, None)
