"""The shared tier's link to a Valkey / Redis Cluster: batched gets and sets per
cluster node, each node behind a circuit breaker, every call bounded by a deadline.

redis-py's cluster client does the cluster work: it discovers every node from the
one in the URL, keeps the slot map, follows MOVED and ASK, and reconnects. What it
cannot give is a partial answer: one of its pipelines fails whole when one node does.
So this module groups the keys of a batch by the node that owns their slot, sends
every node its commands on one of the client's pooled connections, then reads the
answers node by node (the nodes work in parallel, on one thread, as in the cluster
client's own pipeline). A node that fails, does not answer before the deadline or has
its breaker open answers None for its keys; the others answer theirs. A key answered with a
redirection (a slot moved under us) is asked again through the cluster client, which
follows the redirection and learns the new slot owner.

Breakers (one per node): closed -> open after ``FAILURES_TO_OPEN`` failures in a row
(a connection error, a timeout); open -> half-open after ``OPEN_S``: the next call is
let through, and closes the breaker when it succeeds or opens it again when it fails.
Each change is one log line and counts in :class:`LinkStats`. While a node's breaker is
open, its keys are misses at no cost.

The link never connects on a caller's thread: :meth:`ClusterLink.check` (the shared
tier's own thread, every ``CHECK_S``) connects, refreshes the slot map after errors and
pings every primary, which also probes open breakers. Until the first connect succeeds
every get is a miss and every set fails.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

FAILURES_TO_OPEN = 3
OPEN_S = 2.0
CHECK_S = 1.0

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half-open"


class Breaker:
    """One cluster node's circuit breaker (see the module docstring). Thread-safe."""

    def __init__(
        self,
        name: str,
        on_change: Callable[[str, str, str], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.state = CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._probing = False
        self._on_change = on_change
        self._clock = clock
        self._lock = threading.Lock()

    def allow(self) -> bool:
        """Whether a call to this node may go out now (half-open: one at a time)."""
        with self._lock:
            if self.state == CLOSED:
                return True
            if self.state == OPEN and self._clock() - self._opened_at >= OPEN_S:
                self._set(HALF_OPEN, "probing")
            if self.state == HALF_OPEN and not self._probing:
                self._probing = True
                return True
            return False

    def succeeded(self) -> None:
        with self._lock:
            self._failures = 0
            self._probing = False
            if self.state != CLOSED:
                self._set(CLOSED, "answered")

    def failed(self, why: str) -> None:
        with self._lock:
            self._failures += 1
            self._probing = False
            if self.state == HALF_OPEN or (
                self.state == CLOSED and self._failures >= FAILURES_TO_OPEN
            ):
                self._opened_at = self._clock()
                self._set(OPEN, why)

    def _set(self, state: str, why: str) -> None:
        old, self.state = self.state, state
        self._on_change(self.name, f"{old} -> {state}", why)


@dataclass(frozen=True, slots=True)
class LinkStats:
    connected: bool
    nodes: int  # primaries in the slot map
    reachable_nodes: int  # of those, breaker closed
    errors: int  # failed node calls (connection errors, timeouts, error replies)
    breaker_changes: int


class ClusterLink:
    """Batched, deadline-bound access to one cluster (see the module docstring)."""

    def __init__(
        self,
        url: str,
        timeout_s: float,
        username: str | None = None,
        password: str | None = None,
    ) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self._auth = {"username": username, "password": password}
        self._cluster: Any = None
        self._breakers: dict[str, Breaker] = {}
        self._lock = threading.Lock()
        self._stale = False  # refresh the slot map at the next check
        self.errors = 0  # failed node calls, ever
        self._changes = 0
        self._down_logged = False

    # --- the shared tier's thread ----------------------------------------------------
    def check(self) -> None:
        """Connect if not connected, refresh the slot map after errors, ping every
        primary (probing open breakers). Never raises."""
        cluster = self._cluster
        if cluster is None:
            self._connect()
            return
        try:
            if self._stale:
                self._stale = False
                cluster.nodes_manager.initialize()
        except Exception as exc:  # noqa: BLE001 - a cluster fault is a state, not a crash
            self._stale = True
            log.debug("shared tier: slot map refresh failed: %s", exc)
        for node in self._primaries():
            breaker = self._breaker(node.name)
            if breaker.allow():  # closed, or open long enough to probe
                try:
                    cluster.get_redis_connection(node).ping()
                except Exception as exc:  # noqa: BLE001
                    self._node_failed(node, breaker, exc)
                else:
                    breaker.succeeded()

    def _connect(self) -> None:
        from redis.cluster import RedisCluster  # the daemon imports redis only when used

        try:
            self._cluster = RedisCluster.from_url(
                self.url,
                socket_timeout=self.timeout_s,
                socket_connect_timeout=self.timeout_s,
                require_full_coverage=False,  # a dead node costs its slots, not the rest
                cluster_error_retry_attempts=1,
                **{k: v for k, v in self._auth.items() if v},
            )
        except Exception as exc:  # noqa: BLE001
            if not self._down_logged:
                log.warning("shared tier: cluster %s unreachable (%s); retrying", self.url, exc)
                self._down_logged = True
            return
        log.info("shared tier: connected to %s (%d primaries)", self.url, len(self._primaries()))
        self._down_logged = False

    # --- callers' threads ------------------------------------------------------------
    def get(self, names: Sequence[bytes], deadline: float) -> list[bytes | None]:
        """The values of ``names`` (None: absent, or its node failed, is open or did not
        answer before ``deadline``, a time.monotonic() instant)."""
        out: list[bytes | None] = [None] * len(names)
        for indices, answers in self._per_node(names, deadline, lambda n: ("GET", n)).values():
            for i, answer in zip(indices, answers, strict=True):
                if isinstance(answer, Exception):
                    answer = self._redirected(names[i], answer, deadline)
                out[i] = answer if isinstance(answer, bytes) else None
        return out

    def set(
        self, items: Sequence[tuple[bytes, bytes | memoryview]], ttl_s: int, deadline: float
    ) -> list[bool]:
        """Store each (name, value), expiring after ``ttl_s`` (0: never) -> which were
        stored. A failed or unanswered node's items are not."""
        values = dict(items)
        expiry = ("EX", ttl_s) if ttl_s else ()
        out = [False] * len(items)
        names = [name for name, _ in items]
        for indices, answers in self._per_node(
            names, deadline, lambda n: ("SET", n, values[n], *expiry)
        ).values():
            for i, answer in zip(indices, answers, strict=True):
                out[i] = answer in (b"OK", "OK", True)
        return out

    def usable(self) -> bool:
        """Connected, and some node's breaker is not open."""
        if self._cluster is None:
            return False
        breakers = list(self._breakers.values())
        return not breakers or any(b.state != OPEN for b in breakers)

    def stats(self) -> LinkStats:
        primaries = self._primaries()
        reachable = sum(self._breaker(node.name).state == CLOSED for node in primaries)
        return LinkStats(
            self._cluster is not None, len(primaries), reachable, self.errors, self._changes
        )

    def forget_topology(self) -> None:
        """Ask the next check to reload the slot map (after a failed call)."""
        self._stale = True

    def close(self) -> None:
        cluster, self._cluster = self._cluster, None
        if cluster is not None:
            with contextlib.suppress(Exception):
                cluster.close()

    # --- helpers -------------------------------------------------------------------
    def _per_node(
        self,
        names: Sequence[bytes],
        deadline: float,
        command: Callable[[bytes], tuple[Any, ...]],
    ) -> dict[Any, tuple[list[int], list[Any]]]:
        """``command(name)`` for each of ``names``, pipelined on the node that owns its
        slot, every node's commands sent before any answer is read -> {node: (indices
        into names, answers)} for the nodes that answered before ``deadline``; an error
        reply is its exception, in place."""
        cluster = self._cluster
        if cluster is None or not names:
            return {}
        groups: dict[Any, list[int]] = {}
        try:
            for i, name in enumerate(names):
                groups.setdefault(cluster.get_node_from_key(name), []).append(i)
        except Exception as exc:  # noqa: BLE001 - e.g. a slot nobody covers now
            self._count_error(f"slot map: {exc}")
            self.forget_topology()
            return {}
        sent = []
        for node, indices in groups.items():
            breaker = self._breaker(node.name)
            if not breaker.allow():
                continue
            pool = cluster.get_redis_connection(node).connection_pool
            conn = None
            try:
                conn = pool.get_connection()
                commands = [command(names[i]) for i in indices]
                conn.send_packed_command(conn.pack_commands(commands), check_health=False)
                sent.append((node, breaker, pool, conn, indices))
            except Exception as exc:  # noqa: BLE001 - connection errors and timeouts
                self._node_failed(node, breaker, exc, pool, conn)
        answered = {}
        for node, breaker, pool, conn, indices in sent:
            try:
                if not conn.can_read(timeout=max(deadline - time.monotonic(), 0.0)):
                    raise TimeoutError("no answer before the deadline")
                answers = [_answer(conn) for _ in indices]
            except Exception as exc:  # noqa: BLE001
                self._node_failed(node, breaker, exc, pool, conn)
                continue
            pool.release(conn)
            breaker.succeeded()
            answered[node] = (indices, answers)
        return answered

    def _node_failed(
        self, node: Any, breaker: Breaker, exc: Exception, pool: Any = None, conn: Any = None
    ) -> None:
        self._count_error(f"{node.name}: {exc}")
        breaker.failed(type(exc).__name__)
        self.forget_topology()
        if conn is not None:
            conn.disconnect()  # answers may be left unread on it
            pool.release(conn)

    def _redirected(self, name: bytes, error: Exception, deadline: float) -> Any:
        """A key answered with an error: ask again through the cluster client when it
        was a redirection and time is left (it follows MOVED / ASK); else a miss."""
        from redis.exceptions import AskError, MovedError

        if not isinstance(error, (MovedError, AskError)) or time.monotonic() >= deadline:
            self._count_error(str(error))
            return None
        try:
            return self._cluster.get(name)
        except Exception as exc:  # noqa: BLE001
            self._count_error(str(exc))
            return None

    def _primaries(self) -> list[Any]:
        cluster = self._cluster
        if cluster is None:
            return []
        try:
            return list(cluster.get_primaries())
        except Exception:  # noqa: BLE001
            return []

    def _breaker(self, name: str) -> Breaker:
        breaker = self._breakers.get(name)
        if breaker is None:
            with self._lock:
                breaker = self._breakers.setdefault(name, Breaker(name, self._changed))
        return breaker

    def _changed(self, node: str, change: str, why: str) -> None:
        self._changes += 1
        log.warning("shared tier: node %s breaker %s (%s)", node, change, why)

    def _count_error(self, what: str) -> None:
        self.errors += 1
        log.debug("shared tier: %s", what)


def _answer(conn: Any) -> Any:
    """The next answer on ``conn``; an error reply as its exception (the connection
    stays good)."""
    from redis.exceptions import ResponseError

    try:
        return conn.read_response()
    except ResponseError as exc:
        return exc
