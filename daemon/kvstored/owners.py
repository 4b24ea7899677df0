"""Who holds a call's leases: a client's process (local calls) or its Session (gRPC).

An owner is "live" while it has a connection or stream open; its leases end when the
last one closes (:meth:`Owners.closed`), so a killed client holds nothing for its
leases' TTL. A call still running then makes its leases after that: :meth:`Owners.own`
ends them at once. Runs on the event loop (``own`` on any thread).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from kvstore.errors import StoreError
from kvstore.store import Store
from kvstored.log_limits import LIMITED

log = logging.getLogger("kvstored.service")

SESSION_METADATA = "kvstore-session"  # the call metadata naming a client's Session
SESSION_OWNER = "session:"  # owner names of gRPC sessions (local calls: "local:<pid>")


class Owners:
    """Live owners and their leases (see the module docstring)."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._live: dict[str, int] = {}  # open connections and sessions per owner

    def opened(self, owner: str) -> None:
        self._live[owner] = self._live.get(owner, 0) + 1

    def closed(self, owner: str) -> None:
        left = self._live.get(owner, 1) - 1
        if left:
            self._live[owner] = left
            return
        self._live.pop(owner, None)
        self.release_owner(owner)

    def owner_of(self, context: Any) -> str:
        """Whose leases a call makes: the local-call connection's process, or the open
        Session named in the call's metadata; "" for none (the leases' TTL applies)."""
        owner = getattr(context, "owner", None)
        if owner is not None:
            return str(owner)
        for key, value in context.invocation_metadata() or ():
            if key == SESSION_METADATA:
                named = SESSION_OWNER + str(value)
                return named if named in self._live else ""
        return ""

    def own(self, owner: str, lease_ids: Sequence[int]) -> None:
        """Tie leases a call made to its owner (any thread); if the owner went away
        while the call ran, end them now."""
        ids = [lease_id for lease_id in lease_ids if lease_id]
        if not owner or not ids:
            return
        self._store.own(owner, ids)
        if owner not in self._live:
            self.release_owner(owner)

    def release_owner(self, owner: str) -> None:
        """End the leases of a client that went away (its connection or session)."""
        try:
            ended = self._store.release_owner(owner)
        except StoreError:  # closed: its leases ended with it
            return
        if ended:
            LIMITED.info(
                log, "client_gone", "released %d leases of a client that went away (%s)",
                ended, owner,
            )  # fmt: skip
