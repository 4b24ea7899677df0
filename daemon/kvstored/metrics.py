"""Prometheus metrics of ``kvstored``: the store's counters at scrape time, RPC latencies.

Three parts, one dedicated :class:`~prometheus_client.CollectorRegistry` (never the
process-global one, so two daemons in one process, or a library user's own metrics,
cannot collide):

- :class:`StoreCollector` calls ``Store.stats()`` on every scrape and turns the one
  snapshot it returns into metric families. The store already counts hits, misses,
  evictions and bytes; nothing is counted a second time here, and every value of one
  scrape comes from the same moment (``stats()`` takes the store lock once).
- :class:`RpcMetricsInterceptor`, a ``grpc.aio`` server interceptor, times every call
  of every registered service (KVStore, health, reflection), unary and streaming
  alike, and records ``kvstore_rpc_duration_seconds{method,code}`` when the call ends:
  a streaming call ends after its last message, or when the peer cancels it.
- :class:`MetricsHTTPServer` serves ``/metrics`` over HTTP on ``metrics_listen`` (a
  loopback address by default) from prometheus_client's threaded server; scrapes
  never run on the event loop.

Every metric is documented, with its type and labels, in ``deploy/README.md``; the
test ``tests/test_metrics.py`` checks the two agree.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Gauge, Histogram, ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.exposition import start_http_server
from prometheus_client.registry import Collector

from kvproto.v1.results import Stats

log = logging.getLogger("kvstored.metrics")

# RPCs last from ~100 us (a Lookup of a short chain) to seconds (a 1 GiB inline Put);
# WatchEvents streams last as long as their watcher, so the top buckets are wide.
RPC_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
)

# Store counters that Stats carries in its ``counters`` dict, by metric name.
STORE_COUNTERS = {
    "disk_refused_writes": (
        "kvstore_disk_refused_writes",
        "Blocks the disk tier did not take: it was not writable (a disk fault) or its write "
        "queue (disk_queue_bytes) was full. Not an error by itself: those blocks stay in "
        "host or are evicted as if the disk had no room.",
    ),
    "disk_dropped_writes": (
        "kvstore_disk_dropped_writes",
        "Queued disk writes dropped: they did not fit the LMDB map, or failed during a disk fault.",
    ),
    "put_waits": (
        "kvstore_put_waits",
        "Puts that waited for the disk writer: every block they could evict was due on "
        "disk and its queue was full (back-pressure, bounded by put_wait_ms).",
    ),
    "writer_refused": (
        "kvstore_writer_refused_blocks",
        "Blocks of puts refused because the disk writer stayed behind for put_wait_ms "
        "(overflow = wait; the put's answer counts them as refused).",
    ),
    "dirty_dropped": (
        "kvstore_dirty_dropped_blocks",
        "Blocks due on disk evicted from the host tier before they were written, because "
        "the disk writer stayed behind for put_wait_ms (overflow = drop): lost from the cache.",
    ),
    "room_refused": (
        "kvstore_reads_refused_for_room",
        "Acquires refused (RESOURCE_EXHAUSTED) because not one block of their window got "
        "a host slot while they waited put_wait_ms for room (on the waiting pool): other "
        "reads' leases or pending puts held it.",
    ),
    "dropped": (
        "kvstore_blocks_removed",
        "Blocks removed from the store entirely (evicted from the last tier, deleted, "
        "cleared or orphaned).",
    ),
    "lost_on_disk": (
        "kvstore_disk_lost_reads",
        "Disk reads of a block the index held that failed (checksum mismatch or missing "
        "record); the block and its disk-only descendants were dropped.",
    ),
    "kv_events_dropped": (
        "kvstore_kv_events_dropped",
        "Tier changes not published as KV events because the publisher fell behind by "
        "its whole feed (routers' indexes of this node miss them until its next start).",
    ),
    "known_slot_gets": (
        "kvstore_known_slot_gets",
        "Gets a same-host client served from arena slots it knew, with no call of its "
        "own, reported afterwards (ReportReads): the RPC metrics do not count them.",
    ),
}


# Store figures in the same dict that go up and down (or stop): gauges.
STORE_GAUGES = {
    "kv_events_queued": (
        "kvstore_kv_events_queued",
        "Tier changes waiting for the KV event publisher.",
    ),
    "index_records_loaded": (
        "kvstore_index_records_loaded",
        "Disk records indexed since the start (the index loads in the background; equal "
        "to kvstore_index_records_total once it is done).",
    ),
    "index_records_total": (
        "kvstore_index_records_total",
        "Disk records found at the start, to be indexed.",
    ),
}


class StoreCollector(Collector):
    """Metric families from one ``Store.stats()`` snapshot per scrape."""

    def __init__(
        self,
        stats: Callable[[], Stats],
        version: str,
        platform: Callable[[], str],
        namespaces: bool = True,
    ) -> None:
        self._stats = stats
        self._version = version
        self._platform = platform
        # per-namespace series name what each tenant runs: only when asked for
        # (config metrics_namespaces; kvstored.config.DaemonConfig.namespace_metrics)
        self._namespaces = namespaces

    def collect(self) -> Iterator[Metric]:
        build = InfoMetricFamily(
            "kvstore_build", "Version of kvstored and the platform profile it chose."
        )
        build.add_metric([], {"version": self._version, "platform": str(self._platform())})
        yield build
        try:
            stats = self._stats()
        except Exception as exc:  # a scrape during shutdown: the store is closed
            log.debug("store stats unavailable for a scrape: %s", exc)
            return
        yield from _tier_families(stats)
        if self._namespaces:
            yield from _namespace_families(stats)
        yield from _store_families(stats)


def _tier_families(stats: Stats) -> Iterator[Metric]:
    labels = ["tier"]
    gauges = (
        ("kvstore_tier_capacity_bytes", "Configured capacity of the tier.", "capacity_bytes"),
        ("kvstore_tier_used_bytes", "Bytes held by blocks (and pending slots) in the tier.",
         "used_bytes"),
        ("kvstore_tier_blocks", "Blocks held in the tier.", "blocks"),
    )
    counters = (
        ("kvstore_tier_hits", "Blocks found in the tier by lookups and reads.", "hits"),
        ("kvstore_tier_misses", "Blocks looked for in the tier and not found.", "misses"),
        ("kvstore_tier_evictions",
         "Blocks evicted from the tier to make room (host: demoted or dropped; disk: "
         "deleted).", "evictions"),
        ("kvstore_tier_bytes_in", "Block bytes written into the tier (puts, demotions, "
         "promotions).", "bytes_in"),
        ("kvstore_tier_bytes_out", "Block bytes read out of the tier (gets, demotions, "
         "promotions).", "bytes_out"),
    )
    for name, doc, attr in gauges:
        family = GaugeMetricFamily(name, doc, labels=labels)
        for tier in stats.tiers:
            family.add_metric([tier.name], getattr(tier, attr))
        yield family
    for name, doc, attr in counters:
        counter = CounterMetricFamily(name, doc, labels=labels)
        for tier in stats.tiers:
            counter.add_metric([tier.name], getattr(tier, attr))
        yield counter


def _namespace_families(stats: Stats) -> Iterator[Metric]:
    labels = ["namespace"]
    info = InfoMetricFamily(
        "kvstore_namespace", "Model and block geometry of each namespace.", labels=labels
    )
    blocks = GaugeMetricFamily(
        "kvstore_namespace_blocks", "Blocks of the namespace in the store.", labels=labels
    )
    size = GaugeMetricFamily(
        "kvstore_namespace_bytes", "Block bytes of the namespace in the store.", labels=labels
    )
    hits = CounterMetricFamily(
        "kvstore_namespace_hits", "Blocks of the namespace found by lookups and reads.",
        labels=labels,
    )
    misses = CounterMetricFamily(
        "kvstore_namespace_misses", "Blocks of the namespace looked for and not found.",
        labels=labels,
    )
    for ns in stats.namespaces:
        label = [ns.ns_id]
        info.add_metric(
            label,
            {
                "model": ns.model,
                "block_tokens": str(ns.block_tokens),
                "block_bytes": str(ns.block_bytes),
            },
        )
        blocks.add_metric(label, ns.blocks)
        size.add_metric(label, ns.bytes)
        hits.add_metric(label, ns.hits)
        misses.add_metric(label, ns.misses)
    yield from (info, blocks, size, hits, misses)


# Store-wide figures of Stats, by metric: (family, name, help, Stats field)
_STORE_FIGURES: tuple[tuple[type[Metric], str, str, str], ...] = (
    (CounterMetricFamily, "kvstore_demotions",
     "Blocks moved from the host tier to the disk tier.", "demotions"),
    (CounterMetricFamily, "kvstore_promotions",
     "Blocks moved from the disk tier back into the host tier.", "promotions"),
    (GaugeMetricFamily, "kvstore_pending_blocks",
     "Blocks reserved by a writer whose bytes are not committed.", "pending_blocks"),
    (GaugeMetricFamily, "kvstore_leases", "Open read and write leases.", "leases"),
    (GaugeMetricFamily, "kvstore_staged_bytes",
     "Host arena bytes set aside for writers' next puts (staged slots, in no block yet).",
     "staged_bytes"),
    (CounterMetricFamily, "kvstore_corrupt_reads",
     "Disk records that failed their checksum (reported as misses).", "corrupt_reads"),
    (GaugeMetricFamily, "kvstore_disk_queue_bytes",
     "Block bytes queued for the disk writer, not yet in LMDB.", "disk_queue_bytes"),
)  # fmt: skip


# The shared tier's figures (SharedStats), served only when the daemon has one.
_SHARED_FIGURES: tuple[tuple[type[Metric], str, str, str], ...] = (
    (GaugeMetricFamily, "kvstore_shared_connected",
     "1 once the daemon reached the shared tier's cluster, 0 before.", "connected"),
    (GaugeMetricFamily, "kvstore_shared_nodes",
     "Primaries in the shared tier's cluster slot map.", "nodes"),
    (GaugeMetricFamily, "kvstore_shared_reachable_nodes",
     "Of those, the ones answering (circuit breaker closed).", "reachable_nodes"),
    (CounterMetricFamily, "kvstore_shared_lookups",
     "Reads that asked the shared tier for the blocks after the node's own prefix.",
     "lookups"),
    (CounterMetricFamily, "kvstore_shared_hits",
     "Of those, reads that found at least one block.", "hits"),
    (CounterMetricFamily, "kvstore_shared_blocks_read",
     "Blocks pulled from the shared tier into the host tier.", "blocks_read"),
    (CounterMetricFamily, "kvstore_shared_bytes_read",
     "Block bytes pulled from the shared tier.", "bytes_read"),
    (CounterMetricFamily, "kvstore_shared_blocks_written",
     "Blocks written to the shared tier (behind the puts).", "blocks_written"),
    (CounterMetricFamily, "kvstore_shared_bytes_written",
     "Value bytes written to the shared tier.", "bytes_written"),
    (CounterMetricFamily, "kvstore_shared_write_errors",
     "Blocks a cluster node did not store (failed, timed out).", "write_errors"),
    (CounterMetricFamily, "kvstore_shared_writes_dropped",
     "Stored blocks never sent: the writer fell behind, the block left the host tier "
     "first, or its parent was gone.", "writes_dropped"),
    (GaugeMetricFamily, "kvstore_shared_queue_bytes",
     "Block bytes stored on this node and not yet sent to the shared tier (its "
     "write-behind queue, at most shared_queue_bytes).", "queue_bytes"),
    (CounterMetricFamily, "kvstore_shared_corrupt",
     "Shared-tier values that failed their check (served as misses).", "corrupt"),
    (CounterMetricFamily, "kvstore_shared_unauthenticated",
     "Shared-tier values the keyed MAC refused (shared_key_file): planted, without a "
     "MAC, or with one this node cannot check; served as misses.", "unauthenticated"),
    (CounterMetricFamily, "kvstore_shared_errors",
     "Failed calls to cluster nodes (connection errors, timeouts, error replies).",
     "errors"),
    (CounterMetricFamily, "kvstore_shared_breaker_changes",
     "State changes of the per-node circuit breakers (each also one log line).",
     "breaker_changes"),
)  # fmt: skip


def _store_families(stats: Stats) -> Iterator[Metric]:
    for family, name, doc, field in _STORE_FIGURES:
        yield family(name, doc, value=getattr(stats, field))  # type: ignore[call-arg]
    if any(tier.name == "disk" for tier in stats.tiers):
        yield GaugeMetricFamily(
            "kvstore_disk_writable",
            "1 while the disk tier takes writes, 0 while its commits fail (disk full, I/O "
            "errors; the daemon log says why and when it recovers).",
            value=0 if stats.disk_fault else 1,
        )
    for key, (name, doc) in STORE_COUNTERS.items():
        if key in stats.counters:
            yield CounterMetricFamily(name, doc, value=stats.counters[key])
    for key, (name, doc) in STORE_GAUGES.items():
        if key in stats.counters:
            yield GaugeMetricFamily(name, doc, value=stats.counters[key])
    if stats.shared is not None:
        for family, name, doc, field in _SHARED_FIGURES:
            value = getattr(stats.shared, field)
            yield family(name, doc, value=int(value))  # type: ignore[call-arg]


# --- RPCs ------------------------------------------------------------------------------


# the four kinds of gRPC method handler and how to build each around a new behaviour
_HANDLER_KINDS: tuple[tuple[str, Callable[..., grpc.RpcMethodHandler]], ...] = (
    ("unary_unary", grpc.unary_unary_rpc_method_handler),
    ("unary_stream", grpc.unary_stream_rpc_method_handler),
    ("stream_unary", grpc.stream_unary_rpc_method_handler),
    ("stream_stream", grpc.stream_stream_rpc_method_handler),
)


class RpcMetricsInterceptor(grpc.aio.ServerInterceptor):
    """Times each call: ``kvstore_rpc_duration_seconds`` and ``kvstore_rpc_in_flight``.

    ``method`` is ``package.Service/Method`` of a registered method only (an unknown
    method gets no handler and no series, so a peer cannot grow the label set). The
    status ``code`` is OK, the code the handler aborted or set, CANCELLED when the
    peer went away, or UNKNOWN for an exception grpc turns into UNKNOWN.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.duration = Histogram(
            "kvstore_rpc_duration_seconds",
            "Duration of gRPC calls handled, from the call's start to its status; "
            "_count is the number of calls.",
            ["method", "code"],
            buckets=RPC_BUCKETS,
            registry=registry,
        )
        self._children: dict[tuple[str, str], Any] = {}
        self.in_flight = Gauge(
            "kvstore_rpc_in_flight", "gRPC calls being handled now.", ["method"],
            registry=registry,
        )

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method.lstrip("/")
        for kind, make in _HANDLER_KINDS:
            behavior = getattr(handler, kind)
            if behavior is not None:
                return make(
                    self._wrap(method, behavior),
                    request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer,
                )
        return handler

    def _wrap(self, method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
        """The same kind of callable as ``behavior`` (async generator or coroutine)."""
        record = self._record
        in_flight = self.in_flight.labels(method)

        @contextlib.contextmanager
        def timed(context: grpc.aio.ServicerContext) -> Iterator[None]:
            started = time.perf_counter()
            failure: BaseException | None = None
            in_flight.inc()
            try:
                yield
            except BaseException as exc:
                failure = exc
                raise
            finally:
                in_flight.dec()
                record(method, context, failure, started)

        if inspect.isasyncgenfunction(behavior):

            async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                with timed(context):
                    async with contextlib.aclosing(behavior(request, context)) as responses:
                        async for response in responses:
                            yield response

            return stream

        if inspect.iscoroutinefunction(behavior):

            async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
                with timed(context):
                    return await behavior(request, context)

            return call

        return behavior  # a synchronous handler (none in kvstored): left untimed

    def _record(
        self,
        method: str,
        context: grpc.aio.ServicerContext,
        failure: BaseException | None,
        started: float,
    ) -> None:
        self.observe(method, status_name(context, failure), time.perf_counter() - started)

    def observe(self, method: str, code: str, seconds: float) -> None:
        """One finished call (gRPC here, local calls from kvstored.local_calls)."""
        child = self._children.get((method, code))
        if child is None:  # labels() takes a lock and builds a tuple: once per series
            child = self._children[(method, code)] = self.duration.labels(method, code)
        child.observe(seconds)


def status_name(context: grpc.aio.ServicerContext, failure: BaseException | None) -> str:
    """The status a call ended with, as the code's name (``OK``, ``NOT_FOUND`` ...)."""
    if isinstance(failure, asyncio.CancelledError | GeneratorExit):
        return grpc.StatusCode.CANCELLED.name
    code: Any = None
    with contextlib.suppress(Exception):  # older grpc: no ServicerContext.code()
        code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    if isinstance(code, int):  # some grpc versions return the raw status number
        for status in grpc.StatusCode:
            if status.value[0] == code:
                return status.name
    return grpc.StatusCode.OK.name if failure is None else grpc.StatusCode.UNKNOWN.name


# --- the HTTP endpoint -----------------------------------------------------------------


def split_host_port(listen: str) -> tuple[str, int]:
    """``127.0.0.1:9464`` -> ("127.0.0.1", 9464); ``[::1]:0`` -> ("::1", 0)."""
    host, _, port = listen.rpartition(":")
    return host.strip("[]"), int(port)


def url_of(host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/metrics"


class MetricsHTTPServer:
    """prometheus_client's HTTP server on its own threads; ``close()`` stops it."""

    def __init__(self, registry: CollectorRegistry, listen: str) -> None:
        host, port = split_host_port(listen)
        self._httpd, self._thread = start_http_server(port, addr=host, registry=registry)
        self.url = url_of(host, self._httpd.server_address[1])

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


class DaemonMetrics:
    """The daemon's registry, its RPC interceptor and (once started) its HTTP endpoint."""

    def __init__(self, store: StoreCollector) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(store)
        ProcessCollector(registry=self.registry)  # process_* (RSS, CPU, fds, start time)
        self.interceptor = RpcMetricsInterceptor(self.registry)
        self._http: MetricsHTTPServer | None = None
        self._lock = threading.Lock()

    def start_http(self, listen: str, required: bool) -> str:
        """Serve /metrics on ``listen`` ("" = off) -> the URL, or "" when not serving.

        A bind failure raises when ``required`` (the operator asked for this address);
        for the built-in default it is one warning and a daemon without metrics, so a
        second daemon on the host, or a test daemon, still starts.
        """
        if not listen:
            return ""
        try:
            http = MetricsHTTPServer(self.registry, listen)
        except OSError as exc:
            if required:
                raise MetricsBindError(f"{listen} (metrics_listen): {exc}") from exc
            log.warning(
                "metrics disabled: cannot listen on %s: %s (set metrics_listen to a free "
                "address, or off)", listen, exc.strerror or exc,
                extra={"event": "metrics_disabled"},
            )
            return ""
        with self._lock:
            self._http = http
        return http.url

    def close(self) -> None:
        with self._lock:
            http, self._http = self._http, None
        if http is not None:
            http.close()


class MetricsBindError(OSError):
    """The configured metrics address cannot be bound (start-up fails, exit 1)."""
