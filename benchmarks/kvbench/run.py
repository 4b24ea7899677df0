"""The run of ``kvctl bench``: every case, in turns with its baselines."""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvbench.harness import (
    DISK_CALLS,
    LAYOUTS,
    RAW_CHUNK,
    WARM_EVERY_S,
    Layout,
    MiB,
    Progress,
    Result,
    Series,
    Settings,
    TokenSource,
    aligned_buffer,
    drop_page_cache,
    interleaved_passes,
    timed_passes,
    wait_for,
    warm_page_cache,
)
from kvbench.servers import OwnDaemon, RawGrpcServer, RedisBaseline, redis_unavailable
from kvclient.namespace import Namespace
from kvclient.sync_client import KVClient
from kvstore.stream_copy import copy_into

# -- the run ----------------------------------------------------------------------------


@dataclass
class Case:
    """Chains of one (layout, batch): ``tokens[k]`` holds ``batch`` blocks whose bytes
    are ``source[k]``."""

    layout: Layout
    batch: int
    tokens: list[np.ndarray]
    source: list[np.ndarray]

    @property
    def call_bytes(self) -> int:
        return self.batch * self.layout.block_bytes


class Bench:
    def __init__(self, settings: Settings, addr: str | None, workdir: Path) -> None:
        self.s = settings
        self.addr = addr
        self.workdir = workdir
        self.results: list[Result] = []
        self.notes: list[str] = []
        self.tokens = TokenSource()
        self.daemon: OwnDaemon | None = None
        self.arena_client: KVClient | None = None
        self.inline_client: KVClient | None = None
        self.raw: RawGrpcServer | None = None
        self.redis: RedisBaseline | None = None
        self.info: dict[str, Any] = {}
        self.progress = Progress(1)
        pool_bytes = max(settings.bytes_per_pass, settings.max_call_bytes)
        self.pool = aligned_buffer(pool_bytes, fill=None)  # block bytes to put
        self.out = aligned_buffer(settings.max_call_bytes)  # the reused get buffer
        self.fresh = aligned_buffer(settings.bytes_per_pass)  # the stream floor's ring
        self._warmed_at = -math.inf  # when the disk tier's file was last read whole

    # -- set-up

    def open(self) -> None:
        if self.addr is None:
            self.daemon = OwnDaemon(self.workdir, self.s.host_bytes, self.s.disk_capacity)
            self.daemon.start()
            self.addr = self.daemon.addr
        self._connect()
        self.raw = RawGrpcServer()
        if self.s.redis:
            why = redis_unavailable()
            if why:
                self.notes.append(f"Redis baseline skipped: {why}.")
                self.s.redis = False
            else:
                server = shutil.which("redis-server")
                assert server is not None
                self.redis = RedisBaseline(server)
                self.info["redis"] = f"redis-server {self.redis.version}, {self.redis.parser}"

    def _connect(self) -> None:
        self.arena_client = KVClient(self.addr, use_arena=None, timeout=600)
        self.inline_client = KVClient(self.addr, use_arena=False, timeout=600)
        if not self.arena_client.arena_in_use:
            self.notes.append("the daemon's arena cannot be mapped here: arena cases skipped.")
            if "arena" in self.s.paths:
                self.s.paths.remove("arena")
        server = self.arena_client.server_info()
        self.info.update(daemon=server.version, arena_bytes=server.arena_bytes)

    def close(self) -> None:
        for client in (self.arena_client, self.inline_client):
            if client is not None:
                with contextlib.suppress(Exception):
                    client.close()
        if self.raw is not None:
            self.raw.close()
        if self.redis is not None:
            self.redis.close()
        if self.daemon is not None:
            self.daemon.cleanup()

    def client(self, path: str) -> KVClient:
        client = self.arena_client if path == "arena" else self.inline_client
        assert client is not None
        return client

    def ns(self, path: str, layout: Layout, suffix: str = "") -> Namespace:
        return self.client(path).namespace(
            f"bench-{layout.name}{suffix}", layout.block_tokens, **layout.spec()
        )

    # -- planning

    def case(self, layout: Layout, batch: int, budget: int, calls: int | None = None) -> Case:
        call_bytes = batch * layout.block_bytes
        k = min(
            calls or self.s.calls_per_pass,
            max(1, self.s.blocks_per_pass // batch),
            max(1, budget // call_bytes),
            max(1, self.pool.size // call_bytes),
        )
        tokens = [self.tokens.chain(batch * layout.block_tokens) for _ in range(k)]
        view = self.pool[: k * call_bytes].reshape(k, batch, layout.block_bytes)
        return Case(layout, batch, tokens, list(view))

    def combos(self) -> Iterator[tuple[Layout, int]]:
        for name in self.s.layouts:
            layout = LAYOUTS[name]
            for batch in self.s.batches:
                if batch * layout.block_bytes > self.s.max_call_bytes:
                    continue
                yield layout, batch

    def skipped(self) -> list[str]:
        out = []
        for name in self.s.layouts:
            layout = LAYOUTS[name]
            for batch in self.s.batches:
                size = batch * layout.block_bytes
                if size > self.s.max_call_bytes:
                    out.append(
                        f"{layout.name} x {batch} ({size / MiB:.0f} MiB per call, over the "
                        f"{self.s.max_call_bytes / MiB:.0f} MiB cap)"
                    )
        return out

    # -- measuring

    def run(self) -> None:
        combos = list(self.combos())
        steps = len(combos) * (3 + len(self.s.paths))  # see host_cases
        if self.daemon is not None and self.s.disk:
            steps += 4 + len(combos) * (1 + len(self.s.paths) * self.s.cold)
        self.progress = Progress(steps)
        for layout, batch in combos:
            self.host_cases(layout, batch)
        if self.s.disk:
            if self.daemon is None:
                self.notes.append(
                    "disk-tier cases skipped: they restart the daemon, which needs one this "
                    "program started (run without --addr)."
                )
            else:
                self.disk_phase(combos)
        self.progress.close()

    def host_cases(self, layout: Layout, batch: int) -> None:
        """Every host-tier case of one (layout, batch). The series that a target compares
        are measured in turns (:func:`interleaved_passes`): the puts beside memcpy, the
        raw gRPC push and Redis SET; the gets beside memcpy, the raw gRPC pull and Redis
        GET. The rest (lookups, zero-copy views, misses, the echo) one after another."""
        s, bb = self.s, layout.block_bytes
        label = f"{layout.name} x{batch}"
        fast = self.case(layout, batch, s.bytes_per_pass)
        slow_k = max(1, min(len(fast.tokens), s.slow_bytes_per_pass // fast.call_bytes))
        out = self.out[: fast.call_bytes].reshape(batch, bb)

        def meta(system: str, op: str, path: str, tier: str, calls: int) -> Result:
            return Result(
                system,
                op,
                path,
                tier,
                layout.name,
                bb,
                batch,
                calls,
                calls * batch,
                calls * fast.call_bytes,
            )

        def chains(path: str) -> int:
            return len(fast.tokens) if path == "arena" else slow_k

        # memcpy: the same bytes, call by call, into the reused buffer; measured in both
        # groups into one result (its best pass of all)
        memcpy = Series(
            meta("memcpy", "get", "-", "-", len(fast.source)),
            [lambda src=src: np.copyto(out, src) for src in fast.source],
        )
        # the put's floor: the same bytes into fresh memory, as a put lands them in slots
        rings = self.fresh[: len(fast.source) * fast.call_bytes].reshape(-1, batch, bb)
        stream = Series(
            meta("stream", "put", "-", "-", len(fast.source)),
            [
                lambda src=src, dst=dst: copy_into(dst, src)
                for src, dst in zip(fast.source, rings, strict=True)
            ],
        )
        namespaces = {path: self.ns(path, layout) for path in s.paths}
        # the path with the most chains puts last, so its pass leaves every chain stored
        order = sorted(s.paths, key=chains)
        puts = [self.put_series(namespaces[path], path, fast, chains(path), meta) for path in order]
        # puts sent ahead (put_nowait) into a namespace of their own, first in each round
        ahead_ns = self.ns("arena", layout, "-nowait") if "arena" in s.paths else None
        if ahead_ns is not None:
            ahead = self.put_series(ahead_ns, "arena", fast, chains("arena"), meta, nowait=True)
            puts.insert(0, ahead)
        gets = [
            Series(
                meta("kvstore", "get", path, "host", chains(path)),
                [
                    lambda t=t, ns=namespaces[path]: ns.get(t, out=out)
                    for t in fast.tokens[: chains(path)]
                ],
            )
            for path in s.paths
        ]
        raw_put, raw_get = self.raw_series(fast, slow_k, out, meta)
        redis_put, redis_get = self.redis_series(layout, batch, fast, slow_k, meta)
        interleaved_passes(
            puts[:-1] + [raw_put] + redis_put + puts[-1:] + [memcpy, stream], s.repeat
        )
        self.progress.step(f"put {label}")
        if ahead_ns is not None:
            last = len(fast.tokens) - 1
            self._check(ahead_ns, fast.tokens[last], fast.source[last], out)
            ahead_ns.client.clear(ahead_ns.ns_id)  # its room goes back before the gets
        for path in s.paths:
            k = chains(path)
            self._check(namespaces[path], fast.tokens[k - 1], fast.source[k - 1], out)
        if self.redis is not None:
            self.redis.check(layout, fast)
        interleaved_passes([memcpy] + gets + [raw_get] + redis_get, s.repeat)
        self.progress.step(f"get {label}")
        measured = [memcpy, stream, *puts, *gets, raw_put, raw_get, *redis_put, *redis_get]
        self.results.extend(one.result for one in measured)

        for path in s.paths:
            ns, k = namespaces[path], chains(path)
            tokens = fast.tokens[:k]
            if path == s.paths[0]:
                lookups = [lambda t=t, ns=ns: ns.lookup(t) for t in tokens]
                self.record(
                    meta("kvstore", "lookup", path, "host", k), *timed_passes(lookups, s.repeat)
                )
            both = [lambda t=t, ns=ns: (ns.lookup(t), ns.get(t, out=out)) for t in tokens]
            self.record(
                meta("kvstore", "lookup+get", path, "host", k), *timed_passes(both, s.repeat)
            )
            if path == "arena":  # zero-copy: pin, look at the views in place, release

                def view(t: np.ndarray, ns: Namespace = ns) -> None:
                    with ns.acquire(t) as lease:
                        if len(lease.views) != batch:
                            raise RuntimeError("acquire found fewer blocks than were put")

                views = [lambda t=t: view(t) for t in tokens]
                self.record(
                    meta("kvstore", "acquire", path, "host", k), *timed_passes(views, s.repeat)
                )

            missing = [self.tokens.chain(batch * layout.block_tokens) for _ in range(min(k, 16))]
            misses = [lambda t=t, ns=ns: ns.get(t, out=out) for t in missing]
            r = self.record(
                meta("kvstore", "miss", path, "miss", len(misses)), *timed_passes(misses, s.repeat)
            )
            r.bytes = 0
            self.progress.step(f"lookup, acquire, miss {path} {label}")
        for ns in namespaces.values():
            ns.client.clear(ns.ns_id)
        self.raw_echo(fast, slow_k, out, meta)
        self.progress.step(f"grpc echo {label}")
        if self.redis is not None:
            self.redis.client.flushall()

    def put_series(
        self,
        ns: Namespace,
        path: str,
        fast: Case,
        k: int,
        meta: Callable[..., Result],
        nowait: bool = False,
    ) -> Series:
        """Puts of the first ``k`` chains of ``fast``; every pass starts from an empty
        namespace. ``nowait``: puts sent ahead (``put_nowait``, op ``put-nowait``); the
        pass's last call also waits for its answer, so that a pass ends with every block
        committed and its time counts the daemon's work on all of them."""
        tokens, source = fast.tokens[:k], fast.source[:k]
        calls: list[Callable[[], object]] = []
        for i, (t, b) in enumerate(zip(tokens, source, strict=True)):
            if not nowait:
                calls.append(lambda t=t, b=b: ns.put(t, b))
            elif i < k - 1:
                calls.append(lambda t=t, b=b: ns.put_nowait(t, b))
            else:
                calls.append(lambda t=t, b=b: ns.put_nowait(t, b).result())

        def put_all() -> None:
            for call in calls:
                call()

        return Series(
            meta("kvstore", "put-nowait" if nowait else "put", path, "host", k),
            calls,
            warmup=put_all,
            before_pass=lambda: ns.client.clear(ns.ns_id),
        )

    def record(self, result: Result, seconds: float, latencies: list[float]) -> Result:
        result.seconds = seconds
        result.latencies_ms = latencies
        self.results.append(result)
        return result

    def _check(
        self, ns: Namespace, tokens: np.ndarray, source: np.ndarray, out: np.ndarray
    ) -> None:
        got = ns.get(tokens, out=out)
        if got.n_blocks != source.shape[0] or not np.array_equal(got.blocks, source):
            raise RuntimeError(f"{ns}: a get did not return the bytes put")

    def raw_series(
        self, fast: Case, k: int, out: np.ndarray, meta: Callable[..., Result]
    ) -> tuple[Series, Series]:
        """The raw gRPC push (the bytes of ``k`` calls of ``fast``, in inline chunks) and
        pull (as many bytes, into ``out``)."""
        raw = self.raw
        assert raw is not None
        flat = out.reshape(-1)
        size = fast.call_bytes

        def pull() -> None:
            filled = 0
            for chunk in raw.pull(size.to_bytes(8, "little"), timeout=600):
                flat[filled : filled + len(chunk)] = np.frombuffer(chunk, np.uint8)
                filled += len(chunk)

        def push(src: np.ndarray) -> None:
            data = src.reshape(-1)
            raw.push(
                (data[o : o + RAW_CHUNK].tobytes() for o in range(0, data.size, RAW_CHUNK)),
                timeout=600,
            )

        put = Series(
            meta("grpc-raw", "put", "inline", "-", k),
            [lambda s=s: push(s) for s in fast.source[:k]],
        )
        return put, Series(meta("grpc-raw", "get", "inline", "-", k), [pull] * k)

    def raw_echo(self, fast: Case, k: int, out: np.ndarray, meta: Callable[..., Result]) -> None:
        """The raw gRPC echo: each call's bytes there and back in one message."""
        raw = self.raw
        assert raw is not None
        if fast.call_bytes > 256 * MiB:
            return
        flat = out.reshape(-1)

        def echo(src: np.ndarray) -> None:
            back = raw.echo(src.tobytes(), timeout=600)
            np.copyto(flat, np.frombuffer(back, np.uint8))

        calls = [lambda s=s: echo(s) for s in fast.source[:k]]
        self.record(meta("grpc-raw", "echo", "inline", "-", k), *timed_passes(calls, self.s.repeat))

    def redis_series(
        self, layout: Layout, batch: int, fast: Case, k: int, meta: Callable[..., Result]
    ) -> tuple[list[Series], list[Series]]:
        """Redis SET/MSET of ``k`` calls of ``fast`` (every pass from an empty server)
        and GET/MGET of them; none without the Redis baseline."""
        redis = self.redis
        if redis is None:
            return [], []
        r = redis.client
        keys = [redis.keys(layout, c, batch) for c in range(k)]
        values = [[memoryview(block) for block in fast.source[c]] for c in range(k)]

        def put(c: int) -> None:
            if batch == 1:
                r.set(keys[c][0], values[c][0])
            else:
                r.mset(dict(zip(keys[c], values[c], strict=True)))

        def get(c: int) -> None:
            got = r.get(keys[c][0]) if batch == 1 else r.mget(keys[c])
            if got is None:
                raise RuntimeError("redis lost a block")

        puts = Series(
            meta("redis", "put", "-", "host", k),
            [lambda c=c: put(c) for c in range(k)],
            before_pass=r.flushall,
        )
        gets = Series(meta("redis", "get", "-", "host", k), [lambda c=c: get(c) for c in range(k)])
        return [puts], [gets]

    # -- the disk tier

    def disk_phase(self, combos: list[tuple[Layout, int]]) -> None:
        """Write-back first; then every disk case's chains (host full: written back),
        a restart so that every block is on disk only, the warm cases (each beside
        memcpy and the pread floor, in turns) and, after a second restart with the page
        cache dropped, the cold cases.

        A disk hit changes what it reads (a prefix read twice earns its host slot back,
        and a client reads a prefix from the file once), so every pass reads chains of
        its own: a case has one set of chains for the untimed warm-up, one per timed
        warm pass and one for the cold pass."""
        s = self.s
        assert self.daemon is not None
        # 1. sustained write-back: more than the host holds, into its own namespace;
        # first into the fresh tier's file, then again into the pages it freed. The
        # floor comes after them: on a VM, the page-cache pages it frees would make the
        # next write-back's pages cheap (see write_floor)
        self.writeback("disk")
        self.writeback("disk-reuse")
        self.write_floor()
        self.progress.step("write-back")
        # 2. the chains: per case and path, 1 + disk_passes warm sets and a cold one
        n_sets = 1 + s.disk_passes + (1 if s.cold else 0)
        plan: list[tuple[Layout, int, dict[str, list[Case]]]] = []
        # the chains go in through one path; both read them (one namespace)
        writer = "arena" if "arena" in s.paths else "inline"
        for layout, batch in combos:
            sets = {
                path: [
                    self.case(layout, batch, s.disk_bytes_per_case, calls=DISK_CALLS)
                    for _ in range(n_sets)
                ]
                for path in s.paths
            }
            ns = self.ns(writer, layout, "-disk")
            for cases in sets.values():
                for case in cases:
                    for tokens, source in zip(case.tokens, case.source, strict=True):
                        ns.put(tokens, source)
            plan.append((layout, batch, sets))
        self.progress.step("disk: chains written")
        # 3. warm: one restart for all warm cases (the first reads the tier's file whole)
        self.restart()
        for layout, batch, sets in plan:
            warm = {path: cases[: 1 + s.disk_passes] for path, cases in sets.items()}
            self.disk_warm_case(layout, batch, warm)
            self.progress.step(f"disk-warm {layout.name} x{batch}")
        # 4. cold: page cache dropped, one pass per case and path
        if s.cold:
            self.restart()
            # the daemon maps data.mdb but has touched only the metadata pages of it
            self.info["cold"] = drop_page_cache([self._disk_data_path()])
            for layout, batch, sets in plan:
                for path in s.paths:
                    self.disk_cold_case(path, layout, batch, sets[path][-1])
                    self.progress.step(f"disk-cold {path} {layout.name} x{batch}")
        self.progress.step("disk: done")

    def restart(self) -> None:
        """Restart the daemon (every block on disk only) and reconnect."""
        assert self.daemon is not None
        for client in (self.arena_client, self.inline_client):
            if client is not None:
                client.close()
        self.daemon.stop()  # persists host-only blocks, flushes the writer
        self.daemon.start()
        self._connect()
        self.warm_arena()

    def _disk_data_path(self) -> str:
        assert self.daemon is not None
        return str(self.daemon.disk_dir / "data.mdb")

    def _keep_page_cache_warm(self) -> None:
        """Read the disk tier's file whole when it was last read WARM_EVERY_S ago or
        more: some hosts page out what was not touched for a while (see
        :func:`warm_page_cache`), and the warm cases take minutes."""
        if time.monotonic() - self._warmed_at < WARM_EVERY_S:
            return
        self.info["warm"] = warm_page_cache(self._disk_data_path(), self.out)
        self._warmed_at = time.monotonic()

    def warm_arena(self) -> None:
        """Fault in the new arena's pages once, in both processes, as a long-running
        daemon's are: blocks of a scratch namespace are put inline (the daemon writes
        every slot), read back through the arena (this process maps them), cleared."""
        arena, inline = self.arena_client, self.inline_client
        assert arena is not None and inline is not None
        layout = LAYOUTS["llama16"]
        spec = ("bench-warmup", layout.block_tokens)
        ns_in = inline.namespace(*spec, **layout.spec())
        ns_ar = arena.namespace(*spec, **layout.spec()) if arena.arena_in_use else None
        batch = max(1, min(32, self.pool.size // layout.block_bytes))
        data = self.pool[: batch * layout.block_bytes].reshape(batch, layout.block_bytes)
        out = self.out[: data.nbytes].reshape(data.shape)
        # 90% of the arena: filling it whole would demote the scratch blocks to disk
        for _ in range(max(1, int(0.9 * self.s.host_bytes) // data.nbytes)):
            tokens = self.tokens.chain(batch * layout.block_tokens)
            ns_in.put(tokens, data)
            if ns_ar is not None:
                ns_ar.get(tokens, out=out)
        inline.clear(ns_in.ns_id)

    def disk_warm_case(self, layout: Layout, batch: int, sets: dict[str, list[Case]]) -> None:
        """One (layout, batch) with the page cache warm: each path's gets, memcpy of the
        same bytes and the pread floor, in turns (:func:`interleaved_passes`), as the
        host cases are measured. ``sets[path][0]`` is read by the untimed warm-up and
        ``sets[path][p]`` by timed pass p, so that every pass reads blocks that are on
        disk only and that this client has not read yet."""
        self._keep_page_cache_warm()
        cases = next(iter(sets.values()))
        first = cases[0]
        k = len(first.tokens)
        out = self.out[: first.call_bytes].reshape(batch, layout.block_bytes)

        def meta(system: str, path: str) -> Result:
            return Result(
                system, "get", path, "disk-warm", layout.name, layout.block_bytes, batch,
                k, k * batch, k * first.call_bytes,
            )  # fmt: skip

        copies = [lambda src=src: np.copyto(out, src) for src in first.source]
        series = [Series(meta("memcpy", "-"), copies)]
        found: dict[str, list[int]] = {}
        for path, path_sets in sets.items():
            ns, counter = self.ns(path, layout, "-disk"), found.setdefault(path, [0])
            series.append(self._disk_get_series(ns, path_sets, out, meta("kvstore", path), counter))
        # the floor: the same bytes from a scratch file beside the tier's (same file system)
        assert self.daemon is not None
        scratch = self.daemon.disk_dir / "pread-floor.bin"
        with open(scratch, "wb") as f:
            for source in first.source:
                f.write(source)
        fd = os.open(scratch, os.O_RDONLY)
        try:
            rows = list(out)
            series.append(
                Series(
                    meta("pread", "-"),
                    [lambda o=i * first.call_bytes: os.preadv(fd, rows, o) for i in range(k)],
                )
            )
            interleaved_passes(series, len(cases) - 1)
        finally:
            os.close(fd)
            scratch.unlink(missing_ok=True)
        for one in series:
            path = one.result.path
            if one.result.system == "kvstore" and found[path][0] != len(cases) * k * batch:
                one.result.note = f"only {found[path][0]} of {len(cases) * k * batch} blocks found"
            self.results.append(one.result)

    @staticmethod
    def _disk_get_series(
        ns: Namespace, sets: list[Case], out: np.ndarray, result: Result, found: list[int]
    ) -> Series:
        """Gets of ``sets[0]``'s chains in the warm-up, of ``sets[p]``'s in timed pass p;
        ``found[0]`` counts the blocks they found."""
        current = [0]
        k = len(sets[0].tokens)

        def get(i: int) -> None:
            found[0] += ns.get(sets[current[0]].tokens[i], out=out).n_blocks

        def next_set() -> None:
            current[0] += 1

        return Series(result, [lambda i=i: get(i) for i in range(k)], before_pass=next_set)

    def disk_cold_case(self, path: str, layout: Layout, batch: int, case: Case) -> None:
        """One pass of a case's gets with the page cache dropped (a second pass would
        find it warm)."""
        ns = self.ns(path, layout, "-disk")
        out = self.out[: case.call_bytes].reshape(batch, layout.block_bytes)
        latencies: list[float] = []
        found = 0
        start = time.perf_counter()
        for tokens in case.tokens:
            t0 = time.perf_counter()
            found += ns.get(tokens, out=out).n_blocks
            latencies.append((time.perf_counter() - t0) * 1e3)
        seconds = time.perf_counter() - start
        k = len(case.tokens)
        result = Result(
            "kvstore", "get", path, "disk-cold", layout.name, layout.block_bytes, batch,
            k, k * batch, k * case.call_bytes,
        )  # fmt: skip
        if found != k * batch:
            result.note = f"only {found} of {k * batch} blocks found"
        self.record(result, seconds, latencies)

    def write_floor(self) -> None:
        """The first fill's floor: ``writeback_bytes`` written to a fresh file beside
        the disk tier's (the same file system) in 64 MiB pieces, one fdatasync each, as
        the disk writer commits its batches; the file is removed afterwards. On the VMs
        we use, a page the guest has not touched for a while costs ~1 ms per MiB to fault
        in, and the page cache of a new file takes such pages: this is what the first
        fill of a tier pays. The pages it frees are cheap for whatever writes next."""
        assert self.daemon is not None
        path = self.daemon.disk_dir / "write-floor.bin"
        piece = self.pool[: min(self.pool.size, 64 * MiB)]
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            written = 0
            start = time.perf_counter()
            while written < self.s.writeback_bytes:
                written += os.pwrite(fd, piece, written)
                os.fdatasync(fd)
            seconds = time.perf_counter() - start
        finally:
            os.close(fd)
            path.unlink(missing_ok=True)
        layout = LAYOUTS["llama16"]
        result = Result(
            "write", "write-back", "-", "disk", layout.name, layout.block_bytes, 0, 0,
            written // layout.block_bytes, written,
        )  # fmt: skip
        self.record(result, seconds, [])

    def writeback(self, tier: str) -> None:
        """Put ``writeback_bytes`` of 2 MiB blocks through a host tier that holds less:
        once it is full every put demotes as much to disk (LMDB, fdatasync per batch).
        Rate = disk bytes in / time, from the first demotion until the queue drained.
        ``tier`` names the pass: ``disk``, the first, fills the fresh tier's file (new
        pages of a growing file); ``disk-reuse``, the same volume again after the first
        was cleared, writes into the pages LMDB freed, as a full tier does for good."""
        client = self.arena_client
        assert client is not None
        layout = LAYOUTS["llama16"]
        ns = self.ns("arena" if "arena" in self.s.paths else "inline", layout, "-writeback")
        batch = max(1, min(16, self.s.max_call_bytes // layout.block_bytes))
        data = self.pool[: batch * layout.block_bytes].reshape(batch, layout.block_bytes)
        calls = max(2, self.s.writeback_bytes // (batch * layout.block_bytes))

        def disk_in() -> tuple[int, int]:
            stats = client.stats()
            tier = stats.tier("disk")
            return (tier.bytes_in if tier else 0), stats.disk_queue_bytes

        base, _ = disk_in()
        t_first = None
        first_bytes = base
        for _ in range(calls):
            ns.put(self.tokens.chain(batch * layout.block_tokens), data)
            now, _ = disk_in()
            if t_first is None and now > base:
                t_first, first_bytes = time.perf_counter(), now
        if t_first is None:
            self.notes.append("write-back: nothing was demoted (the host tier never filled).")
            return
        wait_for(lambda: disk_in()[1] == 0, 600, "disk queue drain")
        end, _ = disk_in()
        seconds = time.perf_counter() - t_first
        result = Result(
            "kvstore",
            "write-back",
            "-",
            tier,
            layout.name,
            layout.block_bytes,
            batch,
            0,
            (end - first_bytes) // layout.block_bytes,
            end - first_bytes,
        )
        self.record(result, seconds, [])
        client.clear(ns.ns_id)


