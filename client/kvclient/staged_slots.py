"""Staged slots: the empty arena slots a client holds for its next puts.

Why: an arena put used to be Reserve (where do my blocks go?) -> copy -> Commit, two
round trips on its path, each as long as copying 4 MiB. With slots set aside ahead
(``ReserveRequest.stage_more``, under a staging lease: see ``kvstore.store``), a put
knows where its blocks go before it asks: it names the slots in its Reserve
(``staged_offsets``, one per offered block), copies every block into its slot while
that Reserve is in flight, and sends the Commit without waiting for its answer
(:meth:`kvclient.local_calls.LocalCalls.send`). The same Reserve asks for as many
new slots as it used, so a steady stream of puts of one size keeps a put's worth
ready. A put sent ahead (:mod:`kvclient.puts_ahead`) asks for two puts' worth, counting
the slots asked for by Reserves whose answers are still owed (:meth:`SlotStash.ask`).

Safety: a client writes only slots of a staging lease that is alive. The lease
lives ``stage_ttl_s`` from the daemon's handling of the last Reserve that named it,
which comes after that Reserve was sent; the stash counts from the send and stops
using its slots a margin before that (:data:`MARGIN`). It also forgets them when the
arena mapping changes (the daemon restarted: its staging leases are gone with it)
and in a forked child (the slots are the parent's). A Reserve that fails drops every
slot it named, since the daemon may have given them to blocks.

One :class:`SlotStash` per namespace and client, thread-safe.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable

import numpy as np

from kvclient.arena_path import ClientArena, SlotTable
from kvclient.fork_safety import renew_in_child
from kvproto.v1 import kvstore_pb2 as pb

# stop using a lease's slots this long (a quarter of its TTL, at least a second)
# before the daemon could reclaim them
MIN_MARGIN_S = 1.0
MARGIN = 0.25


def put_reserve(
    stash: SlotStash,
    arena: ClientArena,
    ns_id: str,
    tokens: list[int],
    extra: list[bytes],
    start: int,
    n: int,
    priority: int | None,
    ahead: bool = False,
) -> tuple[pb.ReserveRequest, SlotTable | None]:
    """The Reserve of an arena put of blocks ``start .. start + n``, and the staged
    slots it names as a table to copy into while it is in flight (None: none staged,
    the put copies into the slots the answer gives).

    ``ahead``: a put sent ahead (:mod:`kvclient.puts_ahead`). With staged slots the
    request commits on arrival; either way it asks for two puts' worth staged, so
    that the next put need not wait for this one's answer.
    """
    stage_lease, staged = stash.take(n, arena)
    request = pb.ReserveRequest(
        ns_id=ns_id,
        tokens=tokens,
        extra_keys=extra,
        start_block=start,
        n_blocks=n,
        priority=priority,
        compact_slots=True,
        stage_lease_id=stage_lease,
        staged_offsets=staged,
        stage_more=stash.ask(n, puts=2 if ahead else 1),
        commit=ahead and bool(staged),
    )
    if not staged:
        return request, None
    return request, SlotTable(np.arange(start, start + n), np.asarray(staged, np.int64))


class SlotStash:
    """The staged slots of one namespace in one client."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lease_id = 0
        self._offsets: list[int] = []
        self._usable_until = 0.0  # time.monotonic()
        self._arena: ClientArena | None = None
        self._pid = os.getpid()
        self._asked = 0  # slots asked for by Reserves not answered yet
        # leases dropped while Reserves naming them may still be in flight
        self._dropped: deque[int] = deque(maxlen=64)
        renew_in_child(self)

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()  # the parent's slots are forgotten by _check

    def take(self, n: int, arena: ClientArena) -> tuple[int, list[int]]:
        """The staging lease to name and the ``n`` slots this put may write (``[]``
        when fewer are staged: the put reserves fresh slots and asks for more)."""
        with self._lock:
            self._check(arena)
            if len(self._offsets) < n:
                return self._lease_id, []
            taken, self._offsets = self._offsets[:n], self._offsets[n:]
            return self._lease_id, taken

    def ask(self, n: int, puts: int = 1) -> int:
        """How many slots a Reserve asks for so that the next ``puts`` puts of ``n``
        blocks find them staged, counting those asked for by Reserves not answered
        yet; counted as asked until :meth:`answered` or :meth:`forget`."""
        with self._lock:
            more = max(0, puts * n - len(self._offsets) - self._asked)
            self._asked += more
            return more

    def answered(
        self, sent_at: float, request: pb.ReserveRequest, reply: pb.ReserveResponse
    ) -> None:
        """A Reserve sent at ``sent_at`` was answered: keep the slots it set aside and
        those it named but did not fill (their blocks existed), all for the next put,
        under the lease it used or made. An answer under a lease already dropped
        (:meth:`forget`, :meth:`detach`) is ignored: that lease is being released."""
        used = set(reply.slot_offsets)
        staged = request.staged_offsets
        with self._lock:
            self._asked = max(0, self._asked - request.stage_more)
            if reply.stage_lease_id in self._dropped:
                return
            if reply.stage_lease_id != self._lease_id:  # a new lease: the old one is gone
                self._offsets = []
            self._lease_id = reply.stage_lease_id
            self._offsets.extend(o for o in staged if o not in used)
            self._offsets.extend(reply.staged_offsets)
            ttl = reply.stage_ttl_s
            self._usable_until = sent_at + ttl - max(MIN_MARGIN_S, MARGIN * ttl)

    def forget(self, request: pb.ReserveRequest | None = None) -> int:
        """Drop the slots (``request``, a Reserve naming them, failed: they may be
        blocks now); the lease, to release what it still holds (0: nothing to release,
        as when ``request`` named a lease dropped already)."""
        with self._lock:
            if request is not None:
                self._asked = max(0, self._asked - request.stage_more)
                named = request.stage_lease_id
                if named and named != self._lease_id:  # a later lease is not at fault
                    return 0
            return self._drop()

    def drop(self, request: pb.ReserveRequest, release: Callable[[int], None]) -> None:
        """``request``, a Reserve naming staged slots, failed: :meth:`forget` them and
        ``release`` their lease, if it is still this stash's."""
        stage_lease = self.forget(request)
        if stage_lease:
            release(stage_lease)

    def detach(self) -> int:
        """The lease to release when the client closes (0: none); the stash is empty."""
        with self._lock:
            if self._pid != os.getpid():
                self._lease_id, self._offsets = 0, []
                return 0
            return self._drop()

    def _drop(self) -> int:
        """Under the lock: empty the stash and drop its lease for good."""
        lease_id, self._lease_id, self._offsets = self._lease_id, 0, []
        if lease_id:
            self._dropped.append(lease_id)
        return lease_id

    def __len__(self) -> int:
        return len(self._offsets)

    def _check(self, arena: ClientArena) -> None:
        """Under the lock: forget slots that may no longer be this client's to write."""
        stale = (
            self._arena is not arena
            or self._pid != os.getpid()
            or time.monotonic() >= self._usable_until
        )
        if stale:
            self._lease_id, self._offsets = 0, []
            self._arena, self._pid = arena, os.getpid()
