"""The handle of one namespace, for both clients.

Each call builds its op (:mod:`kvclient.reads`, :mod:`kvclient.writes`,
:mod:`kvclient.claims`) and hands it to the client's driver: a :class:`Namespace` (of a
:class:`kvclient.KVClient`) returns the result, an :class:`AsyncNamespace` (of a
:class:`kvclient.AsyncKVClient`) is a coroutine of it (``await ns.get(tokens)``).
Tokens: a list or ndarray of ints (the whole prompt from its first token); blocks:
``[n_blocks, block_bytes]`` array or a sequence of bytes-likes.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from kvclient import claims, reads, writes
from kvclient.arena_path import BlockViews, ClientArena, SlotTable
from kvclient.claims import Claim, ClaimTicket
from kvclient.connection import Connection
from kvclient.effects import Op
from kvclient.errors import InvalidArgumentError
from kvclient.puts_ahead import PendingPut
from kvclient.results import GetResult
from kvclient.wire import ExtraKeys, extra_bytes
from kvproto.v1.results import LookupResult, MissReason, NamespaceInfo, PutResult

if TYPE_CHECKING:
    from kvclient.async_client import AsyncKVClient
    from kvclient.sync_client import KVClient

Tokens = Sequence[int] | np.ndarray
T = TypeVar("T")


class _Namespace:
    """What both namespace classes share: the namespace's fields and the ops behind
    each call (the public methods, typed for each driver, are the subclasses')."""

    def __init__(self, conn: Connection, info: NamespaceInfo) -> None:
        self.info = info
        self.ns_id = info.ns_id
        self.block_tokens = info.block_tokens
        self.block_bytes = info.block_bytes
        self._conn = conn

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.ns_id!r}, block_tokens={self.block_tokens}, "
            f"block_bytes={self.block_bytes})"
        )

    def _why(self, tokens: Tokens, extra_keys: ExtraKeys) -> Op[MissReason]:
        return self._reopening(lambda: reads.why(self._conn, self.info, tokens, extra_keys))

    def _lookup(self, tokens: Tokens, extra_keys: ExtraKeys, wait_s: float) -> Op[LookupResult]:
        return self._reopening(
            lambda: reads.lookup(self._conn, self.info, tokens, extra_keys, wait_s)
        )

    def _lookup_batch(
        self, prompts: Sequence[Tokens], extra_keys: Sequence[ExtraKeys] | None
    ) -> Op[list[LookupResult]]:
        return self._reopening(
            lambda: reads.lookup_batch(self._conn, self.info, prompts, extra_keys)
        )

    def _get(self, tokens: Tokens, extra_keys: ExtraKeys, out: np.ndarray | None) -> Op[GetResult]:
        return self._reopening(
            lambda: reads.Get(self._conn, self.info, tokens, extra_keys, out).run()
        )

    def _acquire(
        self,
        tokens: Tokens,
        extra_keys: ExtraKeys,
        max_blocks: int,
        ttl_s: float | None,
        start: int = 0,
        read_ahead: bool = False,
    ) -> Op[BlockLease]:
        request = reads.acquire_request(
            self.info, tokens, extra_keys, max_blocks, ttl_s, start, read_ahead
        )
        arena, table, lease_id, ready = yield from self._reopening(
            lambda: reads.acquire(self._conn, request)
        )
        lease = BlockLease(self._conn, arena, table, self.block_bytes, self.block_tokens, lease_id)
        lease.first_block = start
        lease.ready_blocks = max(ready, start + lease.n_blocks)
        return lease

    def _window_ops(
        self,
        tokens: Tokens,
        extra_keys: ExtraKeys,
        start: int,
        stop: int,
        window_blocks: int,
        ttl_s: float | None,
        read_ahead: bool,
    ) -> Generator[Callable[[], Op[BlockLease]], BlockLease, None]:
        """The acquires of :meth:`Namespace.windows`, one per window, each made when the
        last one's lease came back (see there); validated before the first."""
        if window_blocks < 0 or stop < 0:
            raise InvalidArgumentError(
                f"window_blocks and stop must be >= 0, got {window_blocks} and {stop}"
            )
        size = window_blocks or max(1, reads.DEFAULT_WINDOW_BYTES // self.block_bytes)
        at = start
        while not stop or at < stop:
            limit = size if not stop else min(size, stop - at)
            lease = yield functools.partial(
                self._acquire, tokens, extra_keys, limit, ttl_s, at, read_ahead=read_ahead
            )
            if not lease.n_blocks:
                return
            at += lease.n_blocks
            if lease.n_blocks < limit and at >= lease.ready_blocks:
                return  # the prefix ends here (else the host tier held less than a window)

    def _put(
        self, tokens: Tokens, blocks: Any, start: int, priority: int | None, extra: ExtraKeys,
        wait: bool,
    ) -> Op[PendingPut]:  # fmt: skip
        """A put, sent (its outcome pending: see :meth:`kvclient.writes.Put.send`)."""
        put = writes.Put(self._conn, self.info, tokens, blocks, start, priority, extra)
        return self._reopening(lambda: put.send(wait))

    def _put_waited(
        self, tokens: Tokens, blocks: Any, start: int, priority: int | None, extra: ExtraKeys
    ) -> Op[PutResult]:
        pending = yield from self._put(tokens, blocks, start, priority, extra, wait=True)
        return (yield from pending.wait(None))

    def _reopening(self, make: Callable[[], Op[T]]) -> Op[T]:
        return self._conn.reopening(self.ns_id, make)

    def _claim(
        self, tokens: Tokens, start: int, ttl_s: float | None, priority: int | None,
        extra_keys: ExtraKeys,
    ) -> Op[Claim]:  # fmt: skip
        request = claims.reserve_request(
            self.ns_id, self.block_tokens, tokens, start, ttl_s, priority, extra_bytes(extra_keys)
        )
        return self._reopening(lambda: claims.claim(self._conn, self.info, request, start))

    def _set_priority(
        self, tokens: Tokens, priority: int, duration_s: float | None, start: int,
        extra_keys: ExtraKeys,
    ) -> Op[int]:  # fmt: skip
        return self._reopening(
            lambda: writes.set_priority(
                self._conn, self.info, tokens, priority, duration_s, start, extra_keys
            )
        )

    def _delete(self, tokens: Tokens, start: int, extra_keys: ExtraKeys) -> Op[int]:
        return self._reopening(
            lambda: writes.delete(self._conn, self.info, tokens, start, extra_keys)
        )


class Namespace(_Namespace):
    """Data calls of one namespace of a :class:`kvclient.KVClient` (see the module
    docstring)."""

    def __init__(self, client: KVClient, conn: Connection, info: NamespaceInfo) -> None:
        super().__init__(conn, info)
        self.client = client

    # -- read side ------------------------------------------------------------------

    def lookup(
        self, tokens: Tokens, *, extra_keys: ExtraKeys = (), wait_pending_s: float = 0.0
    ) -> LookupResult:
        """Longest cached prefix of ``tokens`` (and what other sessions are computing).
        ``wait_pending_s``: wait that long for pending blocks."""
        return self.client._drive(self._lookup(tokens, extra_keys, wait_pending_s))

    def lookup_batch(
        self, prompts: Sequence[Tokens], *, extra_keys: Sequence[ExtraKeys] | None = None
    ) -> list[LookupResult]:
        """:meth:`lookup` of each of ``prompts`` (``extra_keys[i]``: prompt i's), no
        waiting: what many lookups answer, in one call per max_blocks_per_request
        prompts or blocks (the daemon's bound) instead of one each."""
        return self.client._drive(self._lookup_batch(prompts, extra_keys))

    def why(self, tokens: Tokens, *, extra_keys: ExtraKeys = ()) -> MissReason:
        """Why ``tokens`` are not served whole: the first block that is not, and the
        reason the daemon knows (:class:`MissReason`)."""
        return self.client._drive(self._why(tokens, extra_keys))

    def get(
        self, tokens: Tokens, *, extra_keys: ExtraKeys = (), out: np.ndarray | None = None
    ) -> GetResult:
        """Bytes of the longest cached prefix (``uint8[n_blocks, block_bytes]``).

        ``out`` (``uint8[k, block_bytes]``, C-contiguous) is filled instead of a new
        array, and caps the blocks returned at k: reuse it across calls.
        """
        return self.client._drive(self._get(tokens, extra_keys, out))

    def acquire(
        self,
        tokens: Tokens,
        *,
        extra_keys: ExtraKeys = (),
        max_blocks: int = 0,
        ttl_s: float | None = None,
        start: int = 0,
    ) -> BlockLease:
        """Pin the cached prefix of ``tokens`` and see its blocks in place, no copy::

            with ns.acquire(tokens) as lease:      # async: async with ns.acquire(...)
                for block in lease.views:          # read-only uint8[block_bytes] each
                    ...                            # e.g. copy to the GPU
            # released here: the views must not be used any more

        Shared arena only (:class:`ArenaUnavailableError` otherwise). The lease lasts
        ``ttl_s`` (the daemon's default when None) unless released first. With
        ``start`` only blocks ``start ..`` are pinned (``max_blocks`` of them at most;
        ``lease.first_block``), the blocks before it ready in any tier: one window of a
        prefix longer than the daemon's host tier (:meth:`windows` reads them all).
        """
        return self.client._drive(self._acquire(tokens, extra_keys, max_blocks, ttl_s, start))

    def windows(
        self,
        tokens: Tokens,
        *,
        start: int = 0,
        stop: int = 0,
        window_blocks: int = 0,
        extra_keys: ExtraKeys = (),
        ttl_s: float | None = None,
        read_ahead: bool = True,
    ) -> Iterator[BlockLease]:
        """The cached prefix of ``tokens`` one window at a time, each pinned while the
        loop body reads it, however long the prefix (longer than the daemon's host
        tier too)::

            for lease in ns.windows(tokens):   # async: async for ... in ns.windows(...)
                copy(lease.views, lease.first_block)  # blocks first_block .. + n_blocks

        Blocks ``start`` .. ``stop`` (0: to the end of the prefix), ``window_blocks`` at
        a time (0: DEFAULT_WINDOW_BYTES of blocks). Each window is released when the
        next one is asked for (its release rides on that Acquire) or the loop ends;
        the daemon reads the next window from its disk tier into host while the loop
        body copies the last one (``read_ahead``; False: each window is read when asked
        for). Shared arena only, as :meth:`acquire`."""
        ops = self._window_ops(
            tokens, extra_keys, start, stop, window_blocks, ttl_s, read_ahead
        )
        make = next(ops, None)
        while make is not None:
            lease = self.client._drive(make())
            try:
                if lease.n_blocks:
                    yield lease
            finally:
                lease.release()
            try:
                make = ops.send(lease)
            except StopIteration:
                return

    # -- write side -----------------------------------------------------------------

    def put(
        self, tokens: Tokens, blocks: Any, start: int = 0, priority: int | None = None, *,
        extra_keys: ExtraKeys = (),
    ) -> PutResult:  # fmt: skip
        """Store ``blocks[i]`` as the block ``start + i`` of ``tokens``' chain and wait
        for the daemon's answer. Blocks before ``start`` must already be stored (else
        the offer is refused)."""
        op = self._put_waited(tokens, blocks, start, priority, extra_keys)
        return self.client._drive(op)

    def put_nowait(
        self, tokens: Tokens, blocks: Any, start: int = 0, priority: int | None = None, *,
        extra_keys: ExtraKeys = (),
    ) -> PendingPut:  # fmt: skip
        """Like :meth:`put`, but return once the bytes are in the daemon's arena: a
        :class:`kvclient.puts_ahead.PendingPut` whose ``result()`` gives the counts or
        the daemon's error. Without the arena the put is whole when this returns."""
        op = self._put(tokens, blocks, start, priority, extra_keys, wait=False)
        return self.client._drive(op)

    # -- early reuse ----------------------------------------------------------------

    def claim(
        self,
        tokens: Tokens,
        start: int = 0,
        *,
        ttl_s: float | None = None,
        priority: int | None = None,
        extra_keys: ExtraKeys = (),
    ) -> Claim:
        """Claim the full blocks of ``tokens`` from ``start`` that nobody has yet: they
        become pending (other sessions see them and may wait) and this session delivers
        them with ``Claim.fill`` as it computes them. See :mod:`kvclient.claims`.

        Raises OutOfSpaceError when no block can be claimed for lack of room (compute
        without storing).
        """
        return self.client._drive(self._claim(tokens, start, ttl_s, priority, extra_keys))

    def resume_claim(self, ticket: ClaimTicket) -> Claim:
        """The claim of ``ticket`` (made by another client, :meth:`Claim.ticket`), to
        deliver its remaining blocks from this client. No call is made."""
        return self.client._drive(claims.resume(self._conn, self.info, ticket))

    # -- management -----------------------------------------------------------------

    def delete(self, tokens: Tokens, start: int = 0, *, extra_keys: ExtraKeys = ()) -> int:
        """Remove block ``start`` of the chain and everything below it; returns blocks removed."""
        return self.client._drive(self._delete(tokens, start, extra_keys))

    def set_priority(
        self,
        tokens: Tokens,
        priority: int,
        duration_s: float | None = None,
        *,
        start: int = 0,
        extra_keys: ExtraKeys = (),
    ) -> int:
        """Set the priority (0..100) of the stored blocks of ``tokens`` from ``start``;
        after ``duration_s`` they fall back to the default. Returns blocks changed."""
        op = self._set_priority(tokens, priority, duration_s, start, extra_keys)
        return self.client._drive(op)


class AsyncNamespace(_Namespace):
    """The namespace of an :class:`kvclient.AsyncKVClient`: :class:`Namespace`'s calls,
    each a coroutine (``acquire`` an :class:`AsyncAcquire`)."""

    def __init__(self, client: AsyncKVClient, conn: Connection, info: NamespaceInfo) -> None:
        super().__init__(conn, info)
        self.client = client

    async def lookup(
        self, tokens: Tokens, *, extra_keys: ExtraKeys = (), wait_pending_s: float = 0.0
    ) -> LookupResult:
        return await self.client._drive(self._lookup(tokens, extra_keys, wait_pending_s))

    async def lookup_batch(
        self, prompts: Sequence[Tokens], *, extra_keys: Sequence[ExtraKeys] | None = None
    ) -> list[LookupResult]:
        return await self.client._drive(self._lookup_batch(prompts, extra_keys))

    async def why(self, tokens: Tokens, *, extra_keys: ExtraKeys = ()) -> MissReason:
        return await self.client._drive(self._why(tokens, extra_keys))

    async def get(
        self, tokens: Tokens, *, extra_keys: ExtraKeys = (), out: np.ndarray | None = None
    ) -> GetResult:
        return await self.client._drive(self._get(tokens, extra_keys, out))

    def acquire(
        self, tokens: Tokens, *, extra_keys: ExtraKeys = (), max_blocks: int = 0,
        ttl_s: float | None = None, start: int = 0,
    ) -> AsyncAcquire:  # fmt: skip
        """Await it for the lease, or ``async with`` it to release the lease after."""
        op = self._acquire(tokens, extra_keys, max_blocks, ttl_s, start)
        return AsyncAcquire(self.client._drive(op))

    async def windows(
        self,
        tokens: Tokens,
        *,
        start: int = 0,
        stop: int = 0,
        window_blocks: int = 0,
        extra_keys: ExtraKeys = (),
        ttl_s: float | None = None,
        read_ahead: bool = True,
    ) -> AsyncIterator[BlockLease]:
        """:meth:`Namespace.windows`, for ``async for``."""
        ops = self._window_ops(
            tokens, extra_keys, start, stop, window_blocks, ttl_s, read_ahead
        )
        make = next(ops, None)
        while make is not None:
            lease = await self.client._drive(make())
            try:
                if lease.n_blocks:
                    yield lease
            finally:
                await lease.release()
            try:
                make = ops.send(lease)
            except StopIteration:
                return

    async def put(
        self, tokens: Tokens, blocks: Any, start: int = 0, priority: int | None = None, *,
        extra_keys: ExtraKeys = (),
    ) -> PutResult:  # fmt: skip
        op = self._put_waited(tokens, blocks, start, priority, extra_keys)
        return await self.client._drive(op)

    async def put_nowait(
        self, tokens: Tokens, blocks: Any, start: int = 0, priority: int | None = None, *,
        extra_keys: ExtraKeys = (),
    ) -> PendingPut:  # fmt: skip
        op = self._put(tokens, blocks, start, priority, extra_keys, wait=False)
        return await self.client._drive(op)

    async def claim(
        self, tokens: Tokens, start: int = 0, *, ttl_s: float | None = None,
        priority: int | None = None, extra_keys: ExtraKeys = (),
    ) -> Claim:  # fmt: skip
        return await self.client._drive(self._claim(tokens, start, ttl_s, priority, extra_keys))

    async def resume_claim(self, ticket: ClaimTicket) -> Claim:
        return await self.client._drive(claims.resume(self._conn, self.info, ticket))

    async def delete(
        self, tokens: Tokens, start: int = 0, *, extra_keys: ExtraKeys = ()
    ) -> int:
        return await self.client._drive(self._delete(tokens, start, extra_keys))

    async def set_priority(
        self, tokens: Tokens, priority: int, duration_s: float | None = None, *,
        start: int = 0, extra_keys: ExtraKeys = (),
    ) -> int:  # fmt: skip
        op = self._set_priority(tokens, priority, duration_s, start, extra_keys)
        return await self.client._drive(op)


class AsyncAcquire:
    """What :meth:`AsyncNamespace.acquire` returns: await it for the lease, or use it
    in ``async with`` to have the lease released at the end of the block."""

    def __init__(self, pinning: Awaitable[BlockLease]) -> None:
        self._pinning = pinning
        self._lease: BlockLease | None = None

    def __await__(self) -> Generator[Any, None, BlockLease]:
        return self._pinning.__await__()

    async def __aenter__(self) -> BlockLease:
        self._lease = await self._pinning
        return self._lease

    async def __aexit__(self, *exc: object) -> None:
        if self._lease is not None:
            await self._lease.release()


class BlockLease(BlockViews):
    """A read lease on cached blocks with zero-copy views of them (from
    :meth:`Namespace.acquire`); released by ``with`` / ``async with`` or :meth:`release`."""

    def __init__(
        self,
        conn: Connection,
        arena: ClientArena,
        table: SlotTable,
        block_bytes: int,
        block_tokens: int,
        lease_id: int,
    ) -> None:
        super().__init__(arena.mapping, table, block_bytes, block_tokens, lease_id)
        self._conn = conn
        self.first_block = 0  # the chain position of views[0] (a window: see windows)
        # the ready prefix the daemon found, in blocks: more than first_block + n_blocks
        # when the host tier could not hold it all (read the rest with windows)
        self.ready_blocks = self.n_blocks

    def release(self) -> Any:
        """Give the blocks back (idempotent); the views must not be used after it. With
        the asyncio client, an awaitable."""
        return self._conn.drive(self._release())

    def _release(self) -> Op[None]:
        if not self.released:
            self._forget()
            self._conn.accounting.release_later(self.lease_id)
        return
        yield  # an op with nothing to wait for

    def __enter__(self) -> BlockLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    async def __aenter__(self) -> BlockLease:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.release()
