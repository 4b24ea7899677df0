"""The blocking client of kvstored: the blocking driver of the client's core.

Everything a call does is written once, as an op of the core
(:mod:`kvclient.connection`, :mod:`kvclient.reads`, :mod:`kvclient.writes`,
:mod:`kvclient.claims`); :class:`KVClient` runs those ops in the caller's thread
(:func:`kvclient.effects.run_blocking`) over blocking transports, and sends the
pending accounting (:mod:`kvclient.accounting`) from a timer thread. Its twin,
:class:`kvclient.AsyncKVClient`, runs the same ops on an event loop.

The arena is used when ``use_arena`` is None (auto) or True and the daemon's
``ServerInfo.host_id`` equals this host's and its arena file maps; ``use_arena=True``
raises :class:`ArenaUnavailableError` otherwise, ``False`` always goes inline.
Every failure is a :class:`kvclient.errors.KVStoreError`; results are the frozen
dataclasses of :mod:`kvproto.v1.results`.
"""

from __future__ import annotations

import threading
from collections.abc import Generator, Sequence
from typing import Any, TypeVar

from kvclient.base_client import DEFAULT_TIMEOUT_S, BaseClient
from kvclient.connection import events_of
from kvclient.effects import LOCKS, Op, run_blocking
from kvclient.fork_safety import renew_in_child
from kvclient.local_calls import BLOCKING_SOCKETS
from kvclient.namespace import Namespace
from kvproto.v1.results import Event, NamespaceInfo, ServerInfo, Stats

__all__ = ["DEFAULT_TIMEOUT_S", "KVClient"]

T = TypeVar("T")


class KVClient(BaseClient):
    """Blocking client of one kvstored. Thread-safe; close it (or use ``with``)."""

    sockets = BLOCKING_SOCKETS
    event_class = threading.Event

    def _start_driver(self) -> None:
        self._new_thread_state()
        renew_in_child(self)

    def _after_fork_in_child(self) -> None:
        self._new_thread_state()

    def _new_thread_state(self) -> None:
        """The driver's locks and timer, all new: at creation, and again in a forked
        child (a thread of the parent may have held a lock at the fork)."""
        self._locks = {name: threading.Lock() for name in LOCKS}
        self._timer_cond = threading.Condition()
        self._timer: threading.Thread | None = None
        self._timer_parked = False

    def _drive(self, op: Op[T]) -> T:
        return run_blocking(op, self._locks)

    # -- the accounting timer -------------------------------------------------------

    def _wake(self, now: bool) -> None:
        """Work was queued: start the timer thread, or wake it when it is parked or the
        work is due ``now`` (not per get: a thread hop)."""
        with self._timer_cond:
            # not alive: never started, or started in the parent before a fork
            if (self._timer is None or not self._timer.is_alive()) and not self._conn.closed:
                self._timer = threading.Thread(
                    target=self._timer_loop, name="kvclient-accounting", daemon=True
                )
                self._timer.start()
            elif self._timer_parked or now:
                self._timer_cond.notify()

    def _timer_loop(self) -> None:
        """Send the accounting when it is due; park while there is none."""
        cond, accounting = self._timer_cond, self._conn.accounting
        while True:
            with cond:
                if self._conn.closed:
                    return
                due = accounting.due_in()
                if due is None or due > 0:
                    self._timer_parked = due is None
                    cond.wait(due)
                    self._timer_parked = False
                    continue
            self._drive(self._conn.settle())

    # -- what differs in kind -------------------------------------------------------

    def close(self) -> None:
        """Give back leases and staged slots, close the channel, unmap the arena.
        Idempotent."""
        self._drive(self._conn.close())
        with self._timer_cond:
            self._timer_cond.notify_all()  # the timer thread exits

    def __enter__(self) -> KVClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def arena_in_use(self) -> bool:
        """Whether data calls go through the shared arena (asks the daemon once)."""
        return self._drive(self._conn.arena_in_use())

    # -- daemon-wide calls ----------------------------------------------------------

    def events(
        self,
        from_seq: int = 0,
        *,
        ns_id: str = "",
        kinds: Sequence[str] = (),
        from_now: bool = False,
        duration_s: float | None = None,
    ) -> Generator[Event, None, None]:
        """Events with seq > ``from_seq``, following the stream until the caller stops
        (or ``duration_s`` passes). Leaving the loop cancels the call."""
        call = self._watch(from_seq, ns_id, kinds, from_now, duration_s)()
        with self._conn.watching(call, duration_s):
            for msg in call:
                yield from events_of(msg)

    def server_info(self) -> ServerInfo:
        """The daemon's ServerInfo."""
        return self._drive(self._conn.server_info())

    def stats(self) -> Stats:
        """Tier occupancy, hit counts and more."""
        return self._drive(self._conn.stats())

    def namespaces(self) -> list[NamespaceInfo]:
        """The namespaces this caller sees."""
        return self._drive(self._conn.namespaces())

    def clear(self, ns: str | None = None) -> int:
        """Remove every block (of namespace ``ns``, or of all); returns blocks removed."""
        return self._drive(self._conn.clear(ns))

    # -- namespaces -----------------------------------------------------------------

    def namespace(
        self, model: str, block_tokens: int = 16, block_bytes: int = 0, *, name: str = "",
        **layout: Any,
    ) -> Namespace:  # fmt: skip
        """Open (or re-open) a namespace. ``layout``: num_layers, num_kv_heads,
        head_dim, dtype, rank, world_size, tenant_salt, hash_algorithm, vocab_size,
        codec (how the daemon's disk and shared tiers keep its blocks: kvstore.codecs),
        and the labels served_model and tokenizer (what serves it and where its
        tokenizer is, for kvctl --text: not part of its identity); ``name`` binds a
        name to it (checked against the layout when it exists)."""
        info = self._drive(self._opened(model, block_tokens, block_bytes, name, layout))
        return Namespace(self, self._conn, info)

    def open_namespace(self, ns_id: str) -> Namespace:
        """A handle on an existing namespace, by ns_id or bound name (NOT_FOUND if none)."""
        return Namespace(self, self._conn, self._drive(self._described(ns_id)))
