"""The read side of a namespace, written once as ops (:mod:`kvclient.effects`).

A get takes the first route that applies:

1. **Inline** (no arena: another host, or ``use_arena=False``): the Get stream, header
   then chunks, called again from the next block while the header says ``truncated``.
2. **Known slots** (:mod:`kvclient.unpinned_reads`): the last answer for the same
   request was complete and the slots' epoch counters are unchanged before and after
   the copy: no call; the read is reported later (:mod:`kvclient.accounting`).
3. **Unpinned Acquire**: the client copies the slots it expects while the Acquire is
   in flight, then checks the answer's epochs; a slot that changed under a copy sends
   the get to route 4, counted once.
4. **Pinned Acquire**: the ready prefix pinned in host slots under a read lease (the
   daemon promotes disk-only blocks first: only the daemon reads its disk tier); the
   lease is released with the accounting.

Any answer that names another arena than the mapped one (the daemon restarted) sends
the get inline, and the next call maps the new arena. ``acquire`` hands out zero-copy
views of pinned slots (:class:`kvclient.arena_path.BlockViews`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvclient import wire
from kvclient.arena_path import ClientArena, SlotTable, read_slots
from kvclient.connection import Connection
from kvclient.effects import Op, Stream, Work
from kvclient.errors import ArenaUnavailableError, InvalidArgumentError, KVStoreError
from kvclient.payloads import as_tokens, check_out, output_array
from kvclient.results import GetResult
from kvclient.unpinned_reads import UnpinnedGet, wanted_blocks
from kvproto.v1 import kvstore_pb2 as pb
from kvproto.v1 import result_messages
from kvproto.v1.results import LookupResult, MissReason, NamespaceInfo


def lookup_request(
    ns: NamespaceInfo, tokens: Any, extra_keys: wire.ExtraKeys, wait_s: float = 0.0
) -> pb.LookupRequest:
    return pb.LookupRequest(
        ns_id=ns.ns_id,
        tokens=as_tokens(tokens).tolist(),
        extra_keys=wire.extra_bytes(extra_keys),
        wait_pending_s=wait_s,
    )


def lookup(
    conn: Connection, ns: NamespaceInfo, tokens: Any, extra_keys: wire.ExtraKeys, wait_s: float
) -> Op[LookupResult]:
    request = lookup_request(ns, tokens, extra_keys, wait_s)
    return result_messages.lookup_result((yield from conn.call("Lookup", request)))


def lookup_batch(
    conn: Connection,
    ns: NamespaceInfo,
    prompts: Sequence[Any],
    extra_keys: Sequence[wire.ExtraKeys] | None,
) -> Op[list[LookupResult]]:
    """A lookup of each prompt (each with its own extra keys): one LookupBatch per
    max_blocks_per_request prompts, or blocks, of the daemon's (ServerInfo)."""
    if extra_keys is not None and len(extra_keys) != len(prompts):
        raise InvalidArgumentError(
            f"lookup_batch: {len(prompts)} prompts but {len(extra_keys)} extra_keys"
        )
    extras = extra_keys if extra_keys is not None else [()] * len(prompts)
    chains = [
        pb.LookupBatchRequest.Chain(
            tokens=as_tokens(tokens).tolist(), extra_keys=wire.extra_bytes(extra)
        )
        for tokens, extra in zip(prompts, extras, strict=True)
    ]
    info, _ = yield from conn.refresh()
    limit = info.max_blocks_per_request or max(len(chains), 1)  # 0: the daemon sets none
    found: list[LookupResult] = []
    start = 0
    while start < len(chains):  # each call: at most `limit` chains and `limit` blocks
        stop, blocks = start, 0
        while stop < len(chains) and stop - start < limit:
            blocks += len(chains[stop].tokens) // ns.block_tokens
            if blocks > limit and stop > start:
                break  # (a chain over the bound on its own goes alone: the daemon refuses it)
            stop += 1
        request = pb.LookupBatchRequest(ns_id=ns.ns_id, chains=chains[start:stop])
        response = yield from conn.call("LookupBatch", request)
        found += [result_messages.lookup_result(answer) for answer in response.answers]
        start = stop
    return found


def why(
    conn: Connection, ns: NamespaceInfo, tokens: Any, extra_keys: wire.ExtraKeys
) -> Op[MissReason]:
    request = lookup_request(ns, tokens, extra_keys)
    request.explain = True
    return result_messages.miss_reason((yield from conn.call("Lookup", request)).miss)


# a window of Namespace.windows when none is given: bytes of blocks one window pins
DEFAULT_WINDOW_BYTES = 64 << 20


class Get:
    """One get of the longest cached prefix of ``tokens`` (see the module docstring)."""

    def __init__(
        self,
        conn: Connection,
        ns: NamespaceInfo,
        tokens: Any,
        extra_keys: wire.ExtraKeys,
        out: np.ndarray | None,
    ) -> None:
        self.conn = conn
        self.ns = ns
        self.token_array = as_tokens(tokens)
        self.tokens = self.token_array.tolist()
        self.extra = wire.extra_bytes(extra_keys)
        self.max_blocks = check_out(out, ns.block_bytes)
        self.out = out

    def run(self) -> Op[GetResult]:
        _, arena = yield from self.conn.arena_for_data()
        if arena is None:
            return (yield from self.inline())
        counted = False
        if self.conn.epochs is not None:
            got = yield from self.unpinned(arena)
            if got is not None:
                return got
            counted = True  # its Acquire counted this get: the copy did not check out
        return (yield from self.pinned(arena, counted=counted))

    def _result(self, blocks: np.ndarray) -> GetResult:
        return GetResult(tokens=len(blocks) * self.ns.block_tokens, blocks=blocks)

    def unpinned(self, arena: ClientArena) -> Op[GetResult | None]:
        """Routes 2-3; None when a slot changed under a copy."""
        conn, ns = self.conn, self.ns
        assert conn.epochs is not None
        key = conn.last_slots.key(ns.ns_id, self.token_array, self.extra, self.max_blocks)
        wanted = wanted_blocks(len(self.tokens), ns.block_tokens, self.max_blocks)
        last = conn.last_slots.get(key)
        reader = UnpinnedGet(
            conn.epochs, arena, last, self.out, ns.block_bytes, self.max_blocks, wanted
        )
        known = (yield Work(reader.read_known)) if reader.knows_all else None
        if known is not None:  # no call: the slots still hold the last answer's blocks
            conn.accounting.report_read(key, self.tokens, len(known))
            return self._result(known)
        request = self._acquire(unpinned=True)
        # an effect only where there is work: each one costs the asyncio client a thread
        early = reader.copy_early if last is not None else None
        answer = yield from conn.call("Acquire", request, during=early)
        if answer.lease_id or answer.ready_blocks or arena.names_another_arena(answer.arena_path):
            # pinned after all (a block was on disk; maybe nothing of a prefix longer
            # than the host tier could be), or from a restarted daemon
            return (yield from self.read_pinned(arena, answer))
        done = (
            (yield Work(reader.finish, (answer,))) if answer.slot_offsets else reader.finish(answer)
        )
        if done is None:
            return None
        blocks, slots = done
        conn.last_slots.remember(key, slots)
        return self._result(blocks)

    def _acquire(self, **flags: bool) -> pb.AcquireRequest:
        return wire.get_request(
            self.ns.ns_id, self.tokens, self.extra, self.max_blocks,
            self.conn.accounting.take_done(), **flags,
        )  # fmt: skip

    def pinned(self, arena: ClientArena, counted: bool = False) -> Op[GetResult]:
        """Route 4; ``counted``: an Acquire of this get was answered and counted."""
        request = self._acquire(counted=counted)
        answer = yield from self.conn.call("Acquire", request)
        return (yield from self.read_pinned(arena, answer))

    def read_pinned(self, arena: ClientArena, answer: pb.AcquireResponse) -> Op[GetResult]:
        """Copy the blocks of a pinned Acquire answer out, then release its lease."""
        conn = self.conn
        if arena.names_another_arena(answer.arena_path):  # the daemon restarted
            if answer.lease_id:
                yield from conn.call("Release", pb.ReleaseRequest(lease_id=answer.lease_id))
            conn.forget_arena()
            return (yield from self.inline())
        try:
            slots = wire.slot_table(answer)
            total = len(slots)
            if answer.ready_blocks > total:  # longer than the daemon's host tier holds
                total = answer.ready_blocks
                if self.max_blocks:
                    total = min(total, self.max_blocks)
            blocks = output_array(self.out, total, self.ns.block_bytes)
            if len(slots):
                yield Work(read_slots, (arena.mapping, slots, blocks, self.ns.block_bytes))
        finally:
            if answer.lease_id:
                conn.accounting.release_later(answer.lease_id)
        if total > len(slots):  # the rest streams from the daemon's disk tier
            return (yield from self.inline(blocks, len(slots)))
        return self._result(blocks)

    def inline(self, blocks: np.ndarray | None = None, received: int = 0) -> Op[GetResult]:
        """Route 1: Get streams until the prefix is whole (from block ``received`` on,
        into ``blocks``, when the first ones came through the arena)."""
        sink = _GetSink(self.out, self.max_blocks, self.ns.block_bytes, self.conn.addr)
        if blocks is not None:
            sink.resume(blocks, received)
        while True:
            request = pb.GetRequest(
                ns_id=self.ns.ns_id, tokens=self.tokens, extra_keys=self.extra,
                start_block=sink.received, max_blocks=sink.remaining(),
            )  # fmt: skip
            yield from self.conn.settle()
            yield from self.conn.over_grpc(Stream(self.conn.grpc.get(request), sink))  # type: ignore[arg-type]
            if not sink.finish():
                break
        return self._result(sink.blocks())


class _GetSink:
    """The messages of Get streams, written into the output rows (no I/O here)."""

    def __init__(
        self, out: np.ndarray | None, max_blocks: int, block_bytes: int, addr: str
    ) -> None:
        self._out = out
        self._max_blocks = max_blocks
        self._block_bytes = block_bytes
        self._addr = addr
        self._blocks: np.ndarray | None = None
        self.received = 0  # blocks written
        self._start()

    def _start(self) -> None:
        self._header: pb.GetHeader | None = None
        self._n = self._filled = 0
        self._flat = np.empty(0, dtype=np.uint8)

    def resume(self, blocks: np.ndarray, received: int) -> None:
        """Go on filling ``blocks``, whose first ``received`` rows are written."""
        self._blocks, self.received = blocks, received

    def remaining(self) -> int:
        if self._blocks is not None:  # (sized already: ask for no more than it holds)
            return self._blocks.shape[0] - self.received
        return (self._max_blocks - self.received) if self._max_blocks else 0

    def __call__(self, raw: bytes) -> None:
        if self._header is None:
            header = wire.get_header(raw)
            if header is None:
                raise KVStoreError("kvstored sent data before the Get header", addr=self._addr)
            if self._blocks is None:
                total = header.ready_blocks
                if self._max_blocks:
                    total = min(total, self._max_blocks)
                self._blocks = output_array(self._out, total, self._block_bytes)
            # another client may have evicted part of the prefix between calls
            self._n = min(header.n_blocks, self._blocks.shape[0] - self.received)
            self._flat = self._blocks[self.received : self.received + self._n].reshape(-1)
            self._header = header
            return
        data = wire.data_of(raw)
        take = min(len(data), self._flat.size - self._filled)
        if take > 0:
            self._flat[self._filled : self._filled + take] = np.frombuffer(data, np.uint8, take)
        self._filled += len(data)

    def finish(self) -> bool:
        """After a stream ended: whether another one must follow (truncated)."""
        header, blocks = self._header, self._blocks
        if header is None or blocks is None:
            raise KVStoreError("kvstored closed the Get stream before its header", addr=self._addr)
        if self._filled < self._n * self._block_bytes:
            raise KVStoreError(
                f"Get stream ended after {self._filled} of {self._n * self._block_bytes} bytes",
                addr=self._addr,
            )
        self.received += self._n
        n = self._n
        self._start()
        return bool(header.truncated) and n > 0 and self.received < blocks.shape[0]

    def blocks(self) -> np.ndarray:
        assert self._blocks is not None
        return self._blocks[: self.received]


def acquire_request(
    ns: NamespaceInfo,
    tokens: Any,
    extra_keys: wire.ExtraKeys,
    max_blocks: int,
    ttl_s: float | None,
    start_block: int = 0,
    read_ahead: bool = False,
) -> pb.AcquireRequest:
    """The Acquire of ``Namespace.acquire`` or of one of ``Namespace.windows``
    (validated)."""
    token_list = as_tokens(tokens).tolist()
    if max_blocks < 0:
        raise InvalidArgumentError(f"max_blocks must be >= 0, got {max_blocks}")
    if start_block < 0:
        raise InvalidArgumentError(f"start must be >= 0, got {start_block}")
    if ttl_s is not None and not ttl_s > 0:
        raise InvalidArgumentError(f"ttl_s must be > 0, got {ttl_s}")
    return pb.AcquireRequest(
        ns_id=ns.ns_id, tokens=token_list, extra_keys=wire.extra_bytes(extra_keys),
        max_blocks=max_blocks, ttl_s=ttl_s or 0.0, compact_slots=True,
        start_block=start_block, read_ahead=read_ahead,
    )  # fmt: skip


def acquire(
    conn: Connection, request: pb.AcquireRequest
) -> Op[tuple[ClientArena, SlotTable, int, int]]:
    """Pin the prefix (from the request's start_block): (the arena, its slots, the lease
    id, the ready prefix's length when it is longer than the slots, else 0) for
    zero-copy views."""
    for _ in range(2):
        info, arena = yield from conn.arena_for_data()
        if arena is None:
            raise ArenaUnavailableError(
                f"zero-copy views need the shared arena of kvstored at {conn.addr}, "
                f"which cannot be mapped here (arena {info.arena_path or 'not shared'})",
                addr=conn.addr,
            )
        request.release_lease_ids[:] = conn.accounting.take_done()
        answer = yield from conn.call("Acquire", request)
        if not arena.names_another_arena(answer.arena_path):
            return arena, wire.slot_table(answer), answer.lease_id, answer.ready_blocks
        if answer.lease_id:  # the daemon restarted: map its new arena and ask again
            yield from conn.call("Release", pb.ReleaseRequest(lease_id=answer.lease_id))
        conn.forget_arena()
    raise ArenaUnavailableError("kvstored keeps naming another arena", addr=conn.addr)
