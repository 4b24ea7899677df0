"""What Get streams hold copied out of the store: capped in all and per caller (#66).

A Get whose blocks the host tier pins whole sends them out of the arena's slots under
a read lease: nothing is copied but the message in flight. One it cannot pin (a
prefix longer than the caller's host room, or blocks on disk with no room to promote
them) copies its blocks into a buffer of the daemon's, which the stream holds until
its last message is sent: for a client that stops reading, until the call ends. So:

- such a Get copies one window per call (:meth:`GetBuffers.window_bytes`:
  ``window_bytes``, and at most an eighth of a caller's share) and says
  ``truncated``: the client calls again from the next block (kvclient.reads does);
- a window is held as COPIES times its bytes: the copy, and as much again in the
  messages made of it, which gRPC queues whole for a client that does not read (a
  stream's write completes before the client took the bytes in);
- what each window holds is counted against ``get_buffer_bytes`` (all callers together)
  and against its caller's share of it (``get_buffer_bytes // (tenants + 1)``: each
  tenant's, and the admin's) from before the copy until the call is done: gRPC holds
  the last messages of a stream after the handler returned, until the client read
  them, so the bytes are given back by the call's done callback, not the handler;
- a Get that would pass either waits for bytes to be freed up to ``put_wait_ms``,
  then is refused (OutOfSpace: RESOURCE_EXHAUSTED) with the reason, having copied
  nothing. A window larger than the share (one block bigger than it) is let through
  alone, when nothing else is held.

gRPC's flow control keeps what a stream that is not read holds to its window and the
message in flight. Used on the event loop only (the Get handler takes, its call's
done callback gives back), so it takes no lock.
"""

from __future__ import annotations

import asyncio
import contextlib

from kvstore.errors import OutOfSpace
from kvstored.auth import Caller

COPIES = 2  # what a window of a Get holds: its copy, and the messages made of it


class GetBuffers:
    """The bytes Get streams hold copied, per caller and in all (see the module
    docstring)."""

    def __init__(self, total: int, callers: int) -> None:
        self.total = total
        self.share = max(1, total // max(1, callers))
        self.held = 0  # all callers'
        self._held: dict[str, int] = {}  # per caller ("" for the admin)
        self._freed = asyncio.Event()  # set (and replaced) each time bytes are given back

    def window_bytes(self, window_bytes: int) -> int:
        """The bytes one Get copies at most: ``window_bytes``, and an eighth of a
        caller's share (a window holds COPIES times its bytes), so that four streams
        of a caller that does not read them fill its share, never another's."""
        return max(1, min(window_bytes, self.share // (4 * COPIES)))

    def held_by(self, caller: Caller) -> int:
        return self._held.get(_who(caller), 0)

    async def take(self, caller: Caller, nbytes: int, wait_s: float) -> None:
        """Hold ``nbytes`` for ``caller`` (until :meth:`give`); wait up to ``wait_s``
        for them first, then raise OutOfSpace, holding nothing."""
        who = _who(caller)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while not self._fits(who, nbytes):
            left = deadline - loop.time()
            if left <= 0:
                raise OutOfSpace(self._refusal(who, nbytes, wait_s))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._freed.wait(), left)
        self._held[who] = self._held.get(who, 0) + nbytes
        self.held += nbytes

    def give(self, caller: Caller, nbytes: int) -> None:
        """Give back what :meth:`take` held (never awaits: a cancelled call's done
        callback gives its bytes back)."""
        who = _who(caller)
        self.held -= nbytes
        self._held[who] -= nbytes
        if not self._held[who]:
            del self._held[who]
        self._freed.set()  # wake every waiter; the next ones wait on a new event
        self._freed = asyncio.Event()

    def _fits(self, who: str, nbytes: int) -> bool:
        mine = self._held.get(who, 0)
        if not mine:  # a window larger than a share (one block of a big model) goes
            # through while its caller holds nothing, within the total or alone: one
            # caller's stalled stream never shuts the others out
            return self.held + nbytes <= self.total or not self.held
        return mine + nbytes <= self.share and self.held + nbytes <= self.total

    def _refusal(self, who: str, nbytes: int, wait_s: float) -> str:
        mine = self._held.get(who, 0)
        if mine + nbytes > self.share:
            held = f"this caller's Get streams hold {mine} of its share of {self.share} bytes"
        else:
            held = f"Get streams hold {self.held} of {self.total} bytes"
        return (
            f"no buffer for {nbytes} bytes of this Get: {held} (get_buffer_bytes) copied "
            f"for clients still reading them, and none came free within put_wait_ms "
            f"({wait_s * 1000:.0f} ms); read those streams to their end, or read through "
            "the arena (acquire, windows)"
        )


def _who(caller: Caller) -> str:
    return "" if caller.admin else caller.tenant
