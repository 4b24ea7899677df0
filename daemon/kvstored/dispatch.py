"""What every handler of the KVStore servicer shares: the store and the daemon's
settings, where a call runs (the quick path on the event loop, else a thread pool),
and the key chains of requests.

Store calls lock, hash and copy block bytes, so they run on a bounded thread pool
(``workers``) via ``run_in_executor``; calls that may wait a long time use pools of their
own so they cannot fill the first: Lookups with ``wait_pending_s`` one (and Acquires
waiting for host room, kvstored.read_handlers), event streams
another, puts waiting for the disk writer (back-pressure) a third, so that one
tenant's puts on a slow disk never delay another tenant's lookups; explains (``kvctl
why``) run one at a time on a paced thread of their own, a bounded queue before it
(:meth:`Calls.run_explain`). Each caller (a
tenant, or the admin) may park at most its share of a waiting pool's threads
(:class:`WaitShares`); past it a Lookup is answered at once, with what is still
pending, and an event stream polls without parking a thread, so one tenant waiting on
its own blocks never delays another's answers or events.
Short calls skip the pool (a hand-off to a pool thread and back costs about a
millisecond on a busy two-core machine, more than the call itself): a handler offers
its work to :meth:`Calls.run_quick`, which runs it on the event loop with
``quick=True``; work that finds it would touch the disk, evict, or hash a long prompt
raises :class:`NeedsPool` before it changed anything and runs again on the pool.
"""

from __future__ import annotations

import asyncio
import functools
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc

from kvstore.errors import OutOfSpace
from kvstore.keys import BlockKey, NamespaceSpec
from kvstore.store import Store
from kvstore.tenants import tenant_of
from kvstored import convert, hostinfo
from kvstored.auth import Access, Caller
from kvstored.config import DaemonConfig
from kvstored.get_buffers import GetBuffers
from kvstored.names import NamespaceNames
from kvstored.owners import Owners

T = TypeVar("T")
Ctx = grpc.aio.ServicerContext  # a call's gRPC context, as every handler takes it

# what the chain cache holds at most: its entries' token bytes (8 a token: 1 KiB a
# block of 128 tokens, 32x its key) and keys, as the Python objects take them
CHAIN_CACHE_BYTES = 16 << 20
BYTES_OBJECT = sys.getsizeof(b"")  # a bytes object's size besides its bytes
QUICK_BLOCKS = 1024  # larger requests (hashing ~1 ms per 400 blocks) always use the pool
WAIT_THREADS = 64  # Lookups with wait_pending_s parked at once, all callers together
EVENT_THREADS = 32  # event streams parked at once (in a poll of the store's events)
PUT_WAIT_THREADS = 32  # puts waiting for the disk writer at once (the rest queue)
EXPLAIN_SLOTS = 8  # Lookups with explain running or queued at once, all callers together


class NeedsPool(Exception):
    """A call tried on the event loop would wait on the disk or hash a long prompt: it
    stopped before changing anything and runs again on the pool."""


class WaitShares:
    """How many threads of a waiting pool each caller holds; a caller may hold at most
    ``threads // callers`` of them (callers: the tenants and the admin)."""

    def __init__(self, threads: int, callers: int) -> None:
        self.share = max(1, threads // max(1, callers))
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def take(self, caller: Caller) -> bool:
        """One more thread for ``caller``, if within its share (then :meth:`give` it
        back)."""
        who = "" if caller.admin else caller.tenant
        with self._lock:
            held = self._held.get(who, 0)
            if held >= self.share:
                return False
            self._held[who] = held + 1
            return True

    def give(self, caller: Caller) -> None:
        who = "" if caller.admin else caller.tenant
        with self._lock:
            self._held[who] -= 1
            if not self._held[who]:
                del self._held[who]


Memo = tuple[str, bytes, tuple[bytes, ...]]


def memo_bytes(memo: Memo, keys: list[BlockKey]) -> int:
    """What an entry of the chain cache takes: its token bytes, extra keys and keys (a
    32-byte bytes object and a list slot each), about."""
    extras = sum(BYTES_OBJECT + len(extra) for extra in memo[2])
    return 2 * BYTES_OBJECT + len(memo[1]) + extras + len(keys) * (BYTES_OBJECT + 40)


class ChainCache:
    """Key chains computed recently, by (ns_id, token bytes, extra keys); LRU, bounded by
    the bytes its entries take (:func:`memo_bytes`: a request's tokens take more than
    its keys). Keys are a pure function of those, so a hit is exact."""

    def __init__(self, max_bytes: int) -> None:
        self._max_bytes = max_bytes
        self._entries: OrderedDict[tuple[str, bytes, tuple[bytes, ...]], list[BlockKey]] = (
            OrderedDict()
        )
        self._held = 0
        self._lock = threading.Lock()

    def get(self, memo: tuple[str, bytes, tuple[bytes, ...]]) -> list[BlockKey] | None:
        with self._lock:
            keys = self._entries.get(memo)
            if keys is not None:
                self._entries.move_to_end(memo)
            return keys

    def put(self, memo: Memo, keys: list[BlockKey]) -> None:
        size = memo_bytes(memo, keys)
        if not keys or size > self._max_bytes:
            return
        with self._lock:
            if memo in self._entries:
                return
            self._entries[memo] = keys
            self._held += size
            while self._held > self._max_bytes:
                old_memo, old = self._entries.popitem(last=False)
                self._held -= memo_bytes(old_memo, old)


class Calls:
    """The store, the settings, the pools and the lease owners every handler uses (see
    the module docstring); owns its thread pools, not the store."""

    def __init__(
        self,
        store: Store,
        config: DaemonConfig,
        names: NamespaceNames,
        version: str,
        access: Access,
    ) -> None:
        self.store = store
        self.owners = Owners(store)  # whose leases a call makes
        self.config = config
        self.names = names
        self.access = access
        self.version = version
        self.started = time.monotonic()
        self.host_id = hostinfo.host_id()
        self._pool = ThreadPoolExecutor(config.workers, thread_name_prefix="kv-store")
        self._wait_pool = ThreadPoolExecutor(WAIT_THREADS, thread_name_prefix="kv-wait")
        self._event_pool = ThreadPoolExecutor(EVENT_THREADS, thread_name_prefix="kv-events")
        self._put_wait_pool = ThreadPoolExecutor(
            PUT_WAIT_THREADS, thread_name_prefix="kv-put-wait"
        )
        callers = len(config.tenants) + 1  # (the admin, or everyone without tokens)
        self.wait_shares = WaitShares(WAIT_THREADS, callers)
        self.event_shares = WaitShares(EVENT_THREADS, callers)
        # explains (``kvctl why``) run one at a time on a thread of their own, each
        # caller queueing at most its share of EXPLAIN_SLOTS (see run_explain)
        self._explain_pool = ThreadPoolExecutor(1, thread_name_prefix="kv-why")
        self.explain_shares = WaitShares(EXPLAIN_SLOTS, callers)
        self.stopping = asyncio.Event()  # set at a graceful stop: streams end
        # the bytes Get streams hold copied, each caller within its share
        self.get_buffers = GetBuffers(config.get_buffer_bytes, callers)
        self._chains = ChainCache(CHAIN_CACHE_BYTES)
        # True once add_to_server registered Get and Put with identity (de)serializers:
        # Get then yields framed bytes and Put receives them (see kvproto.v1.data_frames).
        self.framed = False
        # the local-call socket once kvstored.local_calls serves it (ServerInfo names it)
        self.local_socket = ""
        # the arena hand-out socket once kvstored.arena_handout serves it
        self.arena_socket = ""

    def arena_name(self, spec: NamespaceSpec) -> str:
        """How answers about ``spec``'s blocks name the arena their slots are in."""
        return self.store.arena_name(tenant_of(spec.tenant_salt))

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._wait_pool.shutdown(wait=False, cancel_futures=True)
        self._event_pool.shutdown(wait=False, cancel_futures=True)
        self._put_wait_pool.shutdown(wait=False, cancel_futures=True)
        self._explain_pool.shutdown(wait=False, cancel_futures=True)

    async def run_parked(
        self, shares: WaitShares, caller: Caller, fn: Callable[..., T], *args: Any
    ) -> tuple[bool, T | None]:
        """(True, ``fn(*args)``) run on the waiting pool of ``shares`` (``wait_shares``:
        the Lookups', ``event_shares``: the event streams') when ``caller`` is within its
        share of it; (False, None), having run nothing, otherwise."""
        if not shares.take(caller):
            return False, None
        pool = self._wait_pool if shares is self.wait_shares else self._event_pool
        try:
            loop = asyncio.get_running_loop()
            return True, await loop.run_in_executor(pool, functools.partial(fn, *args))
        finally:
            shares.give(caller)

    async def run_explain(self, caller: Caller, fn: Callable[[], T]) -> T:
        """``fn()`` (a Lookup with ``explain``) on the explain thread, queued behind the
        explains before it. A caller past its share of EXPLAIN_SLOTS is refused at once
        (OutOfSpace: RESOURCE_EXHAUSTED), so explains, which hash a prompt over every
        namespace the caller sees, take at most one thread and never the store pool
        that other tenants' calls need (kvstored.why paces that thread)."""
        if not self.explain_shares.take(caller):
            raise OutOfSpace(
                f"too many explains at once: at most {self.explain_shares.share} per "
                "caller run or wait; ask again when one has answered"
            )
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._explain_pool, fn)
        finally:
            self.explain_shares.give(caller)

    async def run(self, fn: Callable[..., T], *args: Any, wait: bool = False) -> T:
        """``fn(*args)`` on the store pool; ``wait``: on the pool of puts waiting for
        the disk writer (never the Lookups' waiting pool: see the module docstring)."""
        loop = asyncio.get_running_loop()
        pool = self._put_wait_pool if wait else self._pool
        return await loop.run_in_executor(pool, functools.partial(fn, *args))

    async def run_quick(self, fn: Callable[[bool], T], may_wait: bool = False) -> T:
        """``fn(quick=True)`` on the event loop; on the pool when it raises NeedsPool.
        A call that ``may_wait`` for a writer (a put under back-pressure) goes to
        the put-wait pool while the writer is behind, so it never holds a thread that
        reads and lookups need, waiting ones included."""
        try:
            return fn(True)
        except NeedsPool:
            return await self.run(fn, False, wait=may_wait and self.store.writer_behind)

    def check_host(self, ns_id: str, keys: Sequence[BlockKey]) -> None:
        """Quick calls only: every ready block of ``keys`` is in the host tier."""
        if self.store.lookup(ns_id, keys).disk_blocks:
            raise NeedsPool

    def check_room(self, ns_id: str, keys: Sequence[BlockKey], n_blocks: int) -> None:
        """Quick calls only: a reservation of ``n_blocks`` after ``keys``' ready prefix
        fits the arena's free bytes (so it evicts nothing)."""
        arena = self.store.arena
        spec = self.store.namespace(ns_id)
        region = arena.regions[arena.region_of(tenant_of(spec.tenant_salt))]
        block = -(-spec.block_bytes // 4096) * 4096
        if region.size - arena.used_bytes_of(region.name) < (n_blocks + 1) * block:
            raise NeedsPool

    def write_through(self) -> bool:
        return self.store.config.admission == "write-through"

    # --- the chain of a request (run on a pool thread, or quick) ---------------------

    def chain(
        self, ns_id: str, tokens: Any, extra: Any, caller: Caller, quick: bool = False
    ) -> tuple[NamespaceSpec, list[BlockKey]]:
        """The namespace (one the caller owns) and the key chain of a request's tokens;
        a Lookup and the Acquire or Get that follows it for the same prompt hash it once
        (ChainCache)."""
        spec = self.access.spec(ns_id, caller)
        arr = convert.tokens(tokens)
        extras = convert.extra_keys(extra)
        memo = (spec.ns_id, arr.tobytes(), tuple(extras))
        keys = self._chains.get(memo)
        if keys is None:
            if quick and arr.size > QUICK_BLOCKS * spec.block_tokens:
                raise NeedsPool
            keys = self.store.keys_for(spec.ns_id, arr, extras)
            self._chains.put(memo, keys)
        return spec, keys

    def read_chain(
        self, ns_id: str, tokens: Any, extra: Any, caller: Caller, quick: bool = False
    ) -> tuple[NamespaceSpec, list[BlockKey], int]:
        """:meth:`chain` for a read, which falls through the store's tiers: the blocks
        its far tiers have after this node's ready prefix are pulled into the host tier
        first (kvstore.tier_stack: a network wait, so a quick call moves to the pool
        when one could help); the third value counts them."""
        spec, keys = self.chain(ns_id, tokens, extra, caller, quick)
        return spec, keys, self.pull(spec.ns_id, keys, quick)

    def pull(self, ns_id: str, keys: Sequence[BlockKey], quick: bool = False) -> int:
        """Pull the blocks the store's far tiers have after this node's ready prefix of
        ``keys`` into the host tier -> how many (a network wait: a quick call raises
        NeedsPool where one could help)."""
        if quick:
            if self.store.far_gap(ns_id, keys):
                raise NeedsPool
            return 0
        return self.store.pull(ns_id, keys)
