"""The write side of a namespace, written once as ops (:mod:`kvclient.effects`).

One put path, :meth:`Put.send`; ``put_nowait()`` returns what it sends, ``put()``
sends with ``wait`` and then waits for the outcome (:func:`put`):

- **Arena** (same host): the put copies its blocks into slots the daemon set aside
  for this client on an earlier call (staged slots, :mod:`kvclient.staged_slots`) and
  sends one Reserve that names them and commits them on arrival, without waiting
  (:mod:`kvclient.puts_ahead`). Without enough staged slots (the namespace's first
  put, a larger put, a staging lease run out) it first reads the answers it is owed
  (they bring slots); failing that, the Reserve asks for slots, the blocks are copied
  into them, and a Commit follows without waiting. Either Reserve asks for two puts'
  worth of slots for the puts after. Anything raised between a Reserve and its Commit
  abandons the pending blocks. A waiting put without staged slots copies while its
  Reserve is in flight (the copy and the round trip overlap).
- **Inline** (no arena): Put streams of at most ``max_transfer_bytes`` each, the
  blocks as data chunks.

What is copied into the slots is up to a :class:`SlotWriter`: numpy rows here, GPU
blocks in :mod:`kvclient.integrations.gpu`.

Claims (:mod:`kvclient.claims`) deliver blocks into slots reserved earlier: the slots
are written, then a Commit of that many is waited for; inline, a Put carries the
claim's lease id.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

from kvclient import wire
from kvclient.arena_path import ClientArena, SlotTable, write_slots
from kvclient.connection import Connection, StagedSlotsLost
from kvclient.effects import Io, Op, Work
from kvclient.errors import ArenaUnavailableError, KVStoreError, LeaseError
from kvclient.payloads import (
    BlockRows,
    as_blocks,
    as_tokens,
    blocks_per_call,
    check_cover,
    check_priority,
    check_start,
)
from kvclient.puts_ahead import PendingPut, answer_handler, commit_handler
from kvclient.staged_slots import put_reserve
from kvproto.v1 import kvstore_pb2 as pb
from kvproto.v1 import result_messages
from kvproto.v1.results import NamespaceInfo, PutResult, ServerInfo
from kvstore.host.mapping import ArenaMapping

log = logging.getLogger(__name__)


class SlotWriter(Protocol):
    """Blocks a put copies into arena slots itself (GPU blocks: kvclient.integrations.gpu)."""

    def __len__(self) -> int: ...

    def write(self, mapping: ArenaMapping, slots: SlotTable, first_index: int) -> None:
        """Copy block ``index - first_index`` into the slot of each chain ``index``."""


class _Rows:
    """Numpy rows as a SlotWriter."""

    def __init__(self, rows: BlockRows, block_bytes: int) -> None:
        self.rows = rows
        self._block_bytes = block_bytes

    def __len__(self) -> int:
        return len(self.rows)

    def write(self, mapping: ArenaMapping, slots: SlotTable, first_index: int) -> None:
        write_slots(mapping, slots, self.rows, self._block_bytes, first_index)


class Put:
    """One put of blocks ``start .. start + n`` of ``tokens``' chain."""

    def __init__(
        self,
        conn: Connection,
        ns: NamespaceInfo,
        tokens: Any,
        blocks: Any,
        start: int,
        priority: int | None,
        extra_keys: wire.ExtraKeys,
    ) -> None:
        arr = as_tokens(tokens)
        if isinstance(blocks, _Rows) or hasattr(blocks, "write"):
            self.blocks: _Rows | SlotWriter = blocks
        else:
            self.blocks = _Rows(as_blocks(blocks, ns.block_bytes), ns.block_bytes)
        self.n = len(self.blocks)
        check_cover(arr, ns.block_tokens, start, self.n)
        check_priority(priority)
        self.conn = conn
        self.ns = ns
        self.tokens = arr[: (start + self.n) * ns.block_tokens].tolist()
        self.extra = wire.extra_bytes(extra_keys)
        self.start = start
        self.priority = priority
        self.named_staging = False  # the last Reserve named a staging lease

    def send(self, wait: bool = False) -> Op[PendingPut]:
        """The put, sent: its outcome pending where the arena carries it. ``wait``:
        the caller waits for the outcome (see :meth:`into_arena`).

        A Reserve that named a staging lease the daemon does not know (LeaseError: the
        daemon was restarted, kill -9 included, and its leases went with it) or that
        found the local socket gone first (StagedSlotsLost) makes the put start again,
        once, from a fresh look at the daemon and without staged slots: the lease is
        made anew, and no error of the dead daemon's reaches the caller."""
        conn = self.conn
        if self.n == 0:
            return conn.resolved(PutResult(stored=0, existing=0, refused=0))
        for again in (False, True):
            info, arena = yield from conn.arena_for_data()
            if arena is None:
                return conn.resolved((yield from self.inline(info)))
            try:
                return (yield from self.into_arena(arena, wait))
            except (LeaseError, StagedSlotsLost) as exc:
                if again or not isinstance(exc, StagedSlotsLost) and not self.named_staging:
                    raise
                log.info("a put named staged slots of a daemon that is gone (%s): "
                         "putting again", exc)  # fmt: skip
                conn.forget_arena()
        raise AssertionError("unreachable")

    def into_arena(self, arena: ClientArena, wait: bool) -> Op[PendingPut]:
        """Sent ahead (``wait`` False) with enough staged slots: copy, then one Reserve
        that commits on arrival. Otherwise a Reserve whose answer is read first (the
        counts are in it), the copy running while it flies when the slots are staged,
        and a Commit that nothing waits for (but a caller waiting under write-through
        admission, whose answer says what is durable)."""
        conn = self.conn
        stash = conn.stash(self.ns.ns_id)
        if len(stash) < self.n and conn.local is not None:
            conn.local.poll_owed()  # answers of earlier puts bring more slots
            if len(stash) < self.n and not wait:
                yield from conn.read_owed()
        request, staged = put_reserve(
            stash, arena, self.ns.ns_id, self.tokens, self.extra, self.start, self.n,
            self.priority, ahead=not wait,
        )  # fmt: skip
        self.named_staging = bool(request.stage_lease_id)
        sent_at = time.monotonic()
        release = conn.accounting.release_later
        if staged is not None and not wait:  # copy into the staged slots, then commit
            if conn.local is not None and conn.local.peer_gone():
                # the daemon that staged them went away (kill -9, restart): they may be
                # another daemon's slots now, holding others' blocks; never write them
                stash.forget(request)
                raise StagedSlotsLost("the local-call socket was closed by the daemon")
            try:
                yield Work(self.blocks.write, (arena.mapping, staged, self.start))
            except BaseException:
                stash.drop(request, release)
                raise
            pending = conn.pending_put()
            on_answer = answer_handler(pending, stash, request, sent_at, conn.checked, release)
            yield from conn.send("Reserve", request, on_answer)
            return pending
        copy = (
            None
            if staged is None
            else (lambda: self.blocks.write(arena.mapping, staged, self.start))
        )
        try:
            reserved = yield from conn.call("Reserve", request, during=copy)
        except BaseException:
            if staged is not None:
                stash.drop(request, release)
            raise
        if arena.names_another_arena(reserved.arena_path):  # the daemon restarted
            if reserved.lease_id:
                yield from abandon_quietly(conn, reserved.lease_id)
            conn.forget_arena()
            return conn.resolved((yield from self.inline(None)))
        stash.answered(sent_at, request, reserved)
        slots = wire.slot_table(reserved)
        if not reserved.lease_id:
            return conn.resolved(wire.committed_put(reserved, 0, None))
        if staged is None:
            yield from self.write_slots(arena, reserved.lease_id, slots)
        if wire.more_windows(reserved, len(slots)):  # (never with staged slots)
            return conn.resolved((yield from self.windows(arena, reserved, slots)))
        commit = pb.CommitRequest(lease_id=reserved.lease_id)
        if wait and not (conn.info is not None and conn.info.admission == "write-through"):
            # this client's next call on the connection reads the Commit's answer first
            # (an error in it is logged: kvclient.local_calls)
            yield from conn.send("Commit", commit)
            return conn.resolved(PutResult(len(slots), reserved.existing, reserved.refused))
        pending = conn.pending_put()
        yield from conn.send("Commit", commit, commit_handler(pending, reserved, len(slots)))
        return pending

    def write_slots(self, arena: ClientArena, lease_id: int, slots: SlotTable) -> Op[None]:
        """Copy the blocks into the reserved ``slots``; a failed copy abandons the lease."""
        try:
            yield Work(self.blocks.write, (arena.mapping, slots, self.start))
        except BaseException:
            yield from abandon_quietly(self.conn, lease_id)
            raise

    def windows(
        self, arena: ClientArena, reserved: pb.ReserveResponse, slots: SlotTable
    ) -> Op[PutResult]:
        """A put of a chain too long for the daemon's host tier, window by window, the
        first one copied already: commit the window (the daemon writes it to disk and
        lets it leave the host tier), reserve the next, copy into it, until the last."""
        conn = self.conn
        stored = existing = durable = 0
        while True:
            done = yield from conn.call("Commit", pb.CommitRequest(lease_id=reserved.lease_id))
            stored += done.committed
            existing += reserved.existing
            durable += done.durable
            if done.committed < len(slots) or not wire.more_windows(reserved, len(slots)):
                refused = reserved.refused + len(slots) - done.committed
                return PutResult(stored, existing, refused, durable, reserved.out_of_space)
            at = int(slots.indices[-1]) + 1
            request = pb.ReserveRequest(
                ns_id=self.ns.ns_id, tokens=self.tokens, extra_keys=self.extra,
                start_block=at, n_blocks=self.start + self.n - at, priority=self.priority,
                compact_slots=True,
            )  # fmt: skip
            reserved = yield from conn.call("Reserve", request)
            slots = wire.slot_table(reserved)
            if arena.names_another_arena(reserved.arena_path):  # the daemon restarted
                if reserved.lease_id:
                    yield from abandon_quietly(conn, reserved.lease_id)
                refused = self.start + self.n - at
                return PutResult(stored, existing, refused, durable, out_of_space=False)
            if not reserved.lease_id:
                return PutResult(
                    stored, existing + reserved.existing, reserved.refused, durable,
                    reserved.out_of_space,
                )  # fmt: skip
            yield from self.write_slots(arena, reserved.lease_id, slots)

    def inline(self, info: ServerInfo | None) -> Op[PutResult]:
        conn = self.conn
        if not isinstance(self.blocks, _Rows):
            raise ArenaUnavailableError(
                f"these blocks go through the shared arena of kvstored at {conn.addr}, "
                "which cannot be mapped here",
                addr=conn.addr,
            )
        if info is None:
            info, _ = yield from conn.refresh()
        rows = self.blocks.rows
        chunk = info.max_chunk_bytes or wire.DEFAULT_CHUNK_BYTES
        block_tokens = self.ns.block_tokens
        per_call = blocks_per_call(
            info.max_transfer_bytes, info.max_blocks_per_request, self.ns.block_bytes
        )
        total = PutResult(stored=0, existing=0, refused=0)
        done = 0
        while done < len(rows):
            n = min(per_call, len(rows) - done)
            header = pb.PutHeader(
                ns_id=self.ns.ns_id, tokens=self.tokens[: (self.start + done + n) * block_tokens],
                extra_keys=self.extra, start_block=self.start + done, n_blocks=n,
                priority=self.priority,
            )  # fmt: skip
            yield from conn.settle()
            messages = wire.put_messages(header, rows[done : done + n], chunk)
            result = result_messages.put_result(
                (yield from conn.over_grpc(Io(conn.grpc.put, (messages,))))
            )
            total = total + result
            done += n
            if result.refused:  # the chain is broken: later blocks have no parent
                total = total + PutResult(stored=0, existing=0, refused=len(rows) - done)
                break
        return total


def abandon_quietly(conn: Connection, lease_id: int) -> Op[None]:
    """Drop a write lease after a failed copy; the lease expiring does it otherwise."""
    try:
        yield from conn.call("Abandon", pb.AbandonRequest(lease_id=lease_id))
    except KVStoreError as exc:
        log.warning("abandon of lease %d failed (%s); it expires on its own", lease_id, exc)


def delete(
    conn: Connection, ns: NamespaceInfo, tokens: Any, start: int, extra_keys: wire.ExtraKeys
) -> Op[int]:
    request = pb.DeleteRequest(
        ns_id=ns.ns_id, tokens=as_tokens(tokens).tolist(),
        extra_keys=wire.extra_bytes(extra_keys), start_block=check_start(start),
    )  # fmt: skip
    return int((yield from conn.call("Delete", request)).removed)


def set_priority(
    conn: Connection,
    ns: NamespaceInfo,
    tokens: Any,
    priority: int,
    duration_s: float | None,
    start: int,
    extra_keys: wire.ExtraKeys,
) -> Op[int]:
    check_priority(priority)
    request = pb.SetPriorityRequest(
        ns_id=ns.ns_id, tokens=as_tokens(tokens).tolist(),
        extra_keys=wire.extra_bytes(extra_keys), start_block=check_start(start),
        priority=priority, duration_s=duration_s or 0.0,
    )  # fmt: skip
    return int((yield from conn.call("SetPriority", request)).changed)
