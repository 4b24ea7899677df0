"""``kvctl bench``: data-path speed of kvstored beside its physical and transport limits.

A program, not a test. It measures put, get and lookup of KV blocks against a running
daemon (``kvctl --addr ADDR bench``) or one it starts itself in a temp dir (and stops),
and, in the same run and on the same bytes, three baselines:

- memcpy: ``np.copyto`` of each call's bytes into a reused buffer, one thread -- the
  physical limit of moving the bytes at all;
- two floors beside it, for the cases where kvstore cannot use a reused buffer:
  ``stream`` copies each call's bytes into fresh memory (distinct destinations over a
  ring larger than the cache, with kvstore's streaming copy), what a put must do to
  land bytes in arena slots; ``pread`` reads each call's bytes from a file in the
  page cache (one ``preadv`` per call, next to the disk tier's file), what a warm disk
  hit must do;
- grpc raw: an asyncio gRPC server like kvstored's, on a unix socket, with generic
  handlers and identity (de)serializers: ``Pull`` streams N bytes to the client (like
  an inline Get), ``Push`` takes N bytes (like an inline Put), ``Echo`` sends them
  back in one message -- the transport limit of the inline path;
- redis: a real ``redis-server`` on its unix socket, started and stopped here, driven
  by redis-py with the hiredis reply parser and the Python command packer (it sends
  large values as separate buffers, without joining them): ``MSET`` / ``MGET`` of the
  same blocks per call (skipped when ``redis-server`` or redis-py is missing).

Cases: layouts (a tiny model and Llama-3-8B-shaped bf16 blocks of 2 / 8 / 16 / 64
tokens, 128 KiB per token) x batches (blocks per call) x paths (shared arena,
inline) x tiers (host hit, disk hit with the page cache warm and cold, miss). Every
case runs ``repeat`` timed passes over its chains after one untimed warm-up pass;
throughput is the best pass, latency percentiles are over every timed call. Each
pass is bounded in calls, blocks and bytes, so the default run takes a few minutes.

Disk cases need a daemon this program started: it writes their chains, restarts
the daemon (which persists the host tier and comes back with every block on disk
only) and refills the arena's pages once (a fresh arena costs ~1 ms/MiB to fault in
on the VMs we use, a one-off that is not the steady state). A disk hit changes what it
reads (a prefix read twice is promoted), so each pass reads chains of its own. The
warm cases take their passes in turns with memcpy and the pread floor, after one
restart for all of them; the LMDB file is read whole first and again every
WARM_EVERY_S, so that the page cache holds it (the VMs we use page out memory left
idle for 60 s). For the cold cases, one pass each, the daemon is restarted again and
the page cache dropped (``/proc/sys/vm/drop_caches`` and ``posix_fadvise(DONTNEED)``
on the LMDB file) when allowed. Against ``--addr`` they are skipped.

Outputs: a table on stdout, ``--json PATH`` (every result), ``--report PATH.md``
(tables with ratios to memcpy, grpc raw and Redis, the targets, a PNG plot beside it;
only the part between the ``bench:begin``/``bench:end`` markers is replaced when the
file exists). Progress goes to stderr.

    kvctl bench [--quick] [--report docs/benchmarks/datapath.md] [--json out.json]
    python -m kvclient.bench ...        (the same)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import mmap
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from kvclient.errors import KVStoreError
from kvclient.sync_client import KVClient, Namespace
from kvstore.stream_copy import copy_into

MiB = 1 << 20
GiB = 1 << 30
RAW_SERVICE = "kvbench.Raw"
RAW_CHUNK = (4 << 20) - (64 << 10)  # the same chunk size as kvstored's Get
DISK_CALLS = 16  # most calls per pass of a disk case (each pass reads chains of its own)
WARM_EVERY_S = 30.0  # the warm disk cases read the tier's file whole again after this
RAW_OPTIONS = [
    ("grpc.max_send_message_length", 512 * MiB),
    ("grpc.max_receive_message_length", 512 * MiB),
]
BEGIN_MARK = "<!-- bench:begin -->"
END_MARK = "<!-- bench:end -->"


# -- what is measured -----------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """A KV layout: ``2 (K, V) x layers x kv_heads x head_dim x dtype bytes`` per token."""

    name: str
    block_tokens: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"

    @property
    def block_bytes(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 2 * self.block_tokens

    def spec(self) -> dict[str, Any]:
        return {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
        }


def _llama(tokens: int) -> Layout:
    return Layout(f"llama3-8b/{tokens}", tokens, 32, 8, 128)


LAYOUTS: dict[str, Layout] = {
    "tiny": Layout("tiny/2", 2, 2, 2, 64),  # 1 KiB per token: a 2 KiB block
    "llama2": _llama(2),  # 256 KiB
    "llama8": _llama(8),  # 1 MiB
    "llama16": _llama(16),  # 2 MiB
    "llama64": _llama(64),  # 8 MiB
}


def layout_batch(text: str) -> tuple[str, int]:
    """``LAYOUT:BATCH`` (``llama2:16``) -> the layout's name and the blocks per call; an
    argparse type for the programs in ``benchmarks/``."""
    name, _, batch = text.partition(":")
    if name not in LAYOUTS or not batch.isdigit() or int(batch) < 1:
        raise argparse.ArgumentTypeError(
            f"expected LAYOUT:BATCH with LAYOUT one of {', '.join(LAYOUTS)}, got {text!r}"
        )
    return name, int(batch)


def program_parser(doc: str, cases: list[tuple[str, int]], per: str) -> argparse.ArgumentParser:
    """The argument parser of a program in ``benchmarks/``: its description (the first
    paragraph of ``doc``) and ``--cases LAYOUT:BATCH ...`` (blocks per ``per``)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument(
        "--cases", nargs="+", type=layout_batch, default=cases, metavar="LAYOUT:BATCH",
        help=f"layouts (as kvctl bench names them) and blocks per {per}",
    )  # fmt: skip
    return parser


def write_program_report(path: str, text: str) -> None:
    """Write a ``benchmarks/`` program's markdown report (and say where)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out}")


@dataclass
class Settings:
    layouts: list[str]
    batches: list[int]
    paths: list[str]
    repeat: int
    calls_per_pass: int  # most calls in one timed pass
    blocks_per_pass: int  # most blocks in one timed pass
    bytes_per_pass: int  # most bytes in one timed pass (arena path, memcpy)
    slow_bytes_per_pass: int  # most bytes per pass where bytes cross a socket
    max_call_bytes: int  # larger calls (batch x block) are skipped
    disk: bool
    cold: bool
    disk_bytes_per_case: int
    disk_passes: int
    redis: bool
    host_bytes: int
    disk_capacity: int
    writeback_bytes: int


def settings_for(args: argparse.Namespace) -> Settings:
    quick = args.quick
    s = Settings(
        layouts=["tiny", "llama2"] if quick else list(LAYOUTS),
        batches=[1, 16] if quick else [1, 16, 128],
        paths=["arena", "inline"],
        repeat=2 if quick else 3,
        calls_per_pass=8 if quick else 64,
        blocks_per_pass=256 if quick else 8192,
        bytes_per_pass=(16 if quick else 256) * MiB,
        slow_bytes_per_pass=(8 if quick else 64) * MiB,
        max_call_bytes=(16 if quick else 256) * MiB,
        disk=not args.no_disk,
        cold=not args.no_cold,
        disk_bytes_per_case=(8 if quick else 64) * MiB,
        disk_passes=1 if quick else 3,  # timed warm passes, as many as `repeat`
        redis=not args.no_redis,
        # room for the arena puts' and the puts sent ahead's namespaces of one case at
        # once, each with its staged slots, and the inline path's
        host_bytes=(192 if quick else 1536) * MiB,
        disk_capacity=(2 if quick else 12) * GiB,
        writeback_bytes=(288 if quick else 2304) * MiB,  # 1.5x the host tier
    )
    if args.layouts:
        unknown = set(args.layouts) - set(LAYOUTS)
        if unknown:
            raise SystemExit(f"unknown layouts {sorted(unknown)}; choose from {list(LAYOUTS)}")
        s.layouts = args.layouts
    if args.batches:
        s.batches = args.batches
    if args.paths:
        s.paths = args.paths
    if args.repeat:
        s.repeat = args.repeat
    if args.max_call_mib:
        s.max_call_bytes = args.max_call_mib * MiB
    if args.pass_mib:
        s.bytes_per_pass = args.pass_mib * MiB
        s.slow_bytes_per_pass = min(s.slow_bytes_per_pass, s.bytes_per_pass)
    return s


@dataclass
class Result:
    system: str  # kvstore | memcpy | stream | pread | write | grpc-raw | redis
    op: str  # put | get | lookup | lookup+get | acquire | miss | echo | write-back
    path: str  # arena | inline | -
    tier: str  # host | disk-warm | disk-cold | miss | -
    layout: str
    block_bytes: int
    batch: int
    calls: int = 0  # per pass
    blocks: int = 0  # per pass
    bytes: int = 0  # per pass
    seconds: float = math.inf  # best pass
    latencies_ms: list[float] = field(default_factory=list, repr=False)
    note: str = ""

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds and self.bytes else 0.0

    @property
    def blocks_per_s(self) -> float:
        return self.blocks / self.seconds if self.seconds else 0.0

    def percentile(self, q: float) -> float:
        if not self.latencies_ms:
            return math.nan
        return float(np.percentile(self.latencies_ms, q))

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        del data["latencies_ms"]
        data.update(
            gbps=self.gbps,
            blocks_per_s=self.blocks_per_s,
            p50_ms=self.percentile(50),
            p99_ms=self.percentile(99),
        )
        if not math.isfinite(data["seconds"]):
            data["seconds"] = None
        return data


# -- plumbing -------------------------------------------------------------------------


class Progress:
    """One status line on stderr: redrawn in place on a terminal, else a line per step."""

    def __init__(self, total: int, stream: Any = None) -> None:
        self.total = max(total, 1)
        self.done = 0
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.started = time.monotonic()

    def step(self, label: str, advance: int = 1) -> None:
        self.done = min(self.total, self.done + advance)
        frac = self.done / self.total
        elapsed = time.monotonic() - self.started
        eta = elapsed / frac - elapsed if frac > 0 else 0.0
        bar = "#" * int(frac * 24)
        line = f"[{bar:<24}] {frac * 100:3.0f}% {elapsed:5.0f}s eta {eta:4.0f}s  {label}"
        if self.tty:
            self.stream.write("\r\x1b[K" + line[: shutil.get_terminal_size().columns - 1])
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def note(self, text: str) -> None:
        if self.tty:
            self.stream.write("\r\x1b[K")
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def aligned_buffer(nbytes: int, fill: int | None = 0) -> np.ndarray:
    """A page-aligned ``uint8[nbytes]`` whose pages are faulted in now (not in a timed
    pass); ``fill`` None leaves a byte pattern in it."""
    region = mmap.mmap(-1, max(nbytes, 1))
    arr = np.frombuffer(region, dtype=np.uint8)[:nbytes]
    if fill is None:
        pattern = np.random.default_rng(7).integers(0, 256, MiB, dtype=np.uint8)
        for offset in range(0, nbytes, MiB):
            piece = arr[offset : offset + MiB]
            piece[:] = pattern[: piece.size]
    else:
        arr.fill(fill)
    return arr


class TokenSource:
    """Fresh, distinct token ids for every chain of the run (ids < 2**31)."""

    def __init__(self) -> None:
        self._next = 1

    def chain(self, n_tokens: int) -> np.ndarray:
        first = self._next
        self._next += n_tokens + 7
        return np.arange(first, first + n_tokens, dtype=np.int64) % (1 << 31)


def _timed_pass(calls: Sequence[Callable[[], object]], latencies: list[float]) -> float:
    """One timed pass over ``calls``: its seconds; each call's latency (ms) is appended."""
    clock = time.perf_counter
    start = clock()
    for call in calls:
        t0 = clock()
        call()
        latencies.append((clock() - t0) * 1e3)
    return clock() - start


def timed_passes(
    calls: Sequence[Callable[[], object]],
    repeat: int,
    warmup: Callable[[], None] | None = None,
    before_pass: Callable[[], None] | None = None,
) -> tuple[float, list[float]]:
    """Run ``calls`` once untimed (or ``warmup``), then ``repeat`` timed passes ->
    (best pass seconds, every timed call's latency in ms)."""
    if warmup is not None:
        warmup()
    else:
        for call in calls:
            call()
    best = math.inf
    latencies: list[float] = []
    for _ in range(repeat):
        if before_pass is not None:
            before_pass()
        best = min(best, _timed_pass(calls, latencies))
    return best, latencies


@dataclass
class Series:
    """One series of an interleaved measurement: ``calls`` is one pass of it."""

    result: Result  # its best pass and latencies land here (two series may share one)
    calls: Sequence[Callable[[], object]]
    warmup: Callable[[], None] | None = None
    before_pass: Callable[[], None] | None = None


def interleaved_passes(series: Sequence[Series], repeat: int) -> None:
    """Measure ``series`` in turns: one untimed warm-up of each, in order (``warmup``,
    else one pass of its calls), then ``repeat`` rounds of one timed pass of each.

    Why in turns: this host's speed drifts by up to 2x within a minute (other tenants).
    A ratio of two figures measured minutes apart measures that drift as much as the
    code; taken in turns, every series of a ratio sees the same slow and quick spells,
    and each keeps its best pass.
    """
    for one in series:
        if one.warmup is not None:
            one.warmup()
        else:
            for call in one.calls:
                call()
    for _ in range(repeat):
        for one in series:
            if one.before_pass is not None:
                one.before_pass()
            seconds = _timed_pass(one.calls, one.result.latencies_ms)
            one.result.seconds = min(one.result.seconds, seconds)


def wait_for(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready after {timeout:.0f} s")
        time.sleep(0.05)


def drop_page_cache(paths: Sequence[str]) -> str:
    """Evict ``paths`` (and, if allowed, the whole page cache) -> what was done."""
    done = []
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            done.append("fadvise")
        except OSError:
            pass
        finally:
            os.close(fd)
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        done.append("drop_caches")
    except OSError:
        pass
    return "+".join(sorted(set(done))) or "none (not permitted)"


def warm_page_cache(path: str, buffer: np.ndarray) -> str:
    """Read ``path`` whole (through ``buffer``) so that the page cache holds it -> what
    was done. A warm pass must find the disk tier's file cached, and some hosts page
    out memory left idle for a while (the VMs we use: a DAMON pageout of whatever was
    not accessed for 60 s), so the chains written minutes before are not."""
    started = time.perf_counter()
    done = 0
    chunk = buffer[: min(buffer.size, 64 * MiB)]
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        return f"not read ({exc.strerror})"
    try:
        while True:
            got = os.readv(fd, [chunk])
            if got <= 0:
                break
            done += got
    finally:
        os.close(fd)
    seconds = time.perf_counter() - started
    return f"data.mdb read whole before the warm cases ({done / GiB:.1f} GiB in {seconds:.1f} s)"


# -- daemons ----------------------------------------------------------------------------


class OwnDaemon:
    """A kvstored this program starts in a temp dir, restarts, and stops."""

    def __init__(
        self,
        workdir: Path,
        host_bytes: int,
        disk_bytes: int,
        listen: str = "",
        extra_args: Sequence[str] = (),
        credentials: grpc.ChannelCredentials | None = None,
        client_options: dict[str, Any] | None = None,
    ) -> None:
        """``listen``: a TCP address instead of a socket of its own; ``extra_args`` go
        on its command line; ``credentials`` (TLS) and ``client_options`` (a token, TLS:
        KVClient keywords) are how this program's own calls reach it."""
        self.workdir = workdir
        self.sock_dir = Path(tempfile.mkdtemp(prefix="kvb", dir="/tmp"))
        self.addr = listen or f"unix://{self.sock_dir}/kvstored.sock"
        self.credentials = credentials
        self.client_options = client_options or {}
        self.disk_dir = workdir / "disk"
        self.log_path = workdir / "kvstored.log"
        self.args = [
            sys.executable,
            "-m",
            "kvstored",
            "--listen",
            self.addr,
            "--host_bytes",
            str(host_bytes),
            "--disk_dir",
            str(self.disk_dir),
            "--disk_bytes",
            str(disk_bytes),
            "--max_transfer_bytes",
            str(GiB),
            "--log_level",
            "warning",
            *extra_args,
        ]
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORED_")}
        from kvstored.config import KEYS_BY_NAME

        if "metrics_listen" in KEYS_BY_NAME:  # no metrics endpoint (its port may be taken)
            self.args += ["--metrics_listen", "off"]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child owns it
        self.proc = subprocess.Popen(
            self.args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=self.env
        )
        log.close()
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        def serving() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvstored exited: {self.log_path.read_text()[-2000:]}")
            channel = (
                grpc.secure_channel(self.addr, self.credentials) if self.credentials
                else grpc.insecure_channel(self.addr)
            )
            with channel:
                try:
                    reply = health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(), timeout=0.5
                    )
                except grpc.RpcError:
                    return False
                return reply.status == health_pb2.HealthCheckResponse.SERVING

        wait_for(serving, 60, "kvstored")
        self.wait_prefaulted()

    def wait_prefaulted(self) -> None:
        """Let the daemon's background prefault of its arena finish (it would compete
        with the first cases for the CPU): tmpfs counts a file's blocks as its pages
        are faulted in. Gives up when the count stops growing (prefault off)."""
        with KVClient(self.addr, **self.client_options) as client:
            info = client.server_info()
        if not info.arena_path:
            return
        last, still_since = -1, time.monotonic()
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                populated = os.stat(info.arena_path).st_blocks * 512
            except OSError:
                return
            if populated >= info.arena_bytes:
                return
            if populated != last:
                last, still_since = populated, time.monotonic()
            elif time.monotonic() - still_since > 1.0:
                return
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(300)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.sock_dir, ignore_errors=True)


class RawGrpcServer:
    """The transport baseline: ``python -m kvclient.bench --serve-raw SOCK`` (grpc.aio,
    generic handlers, identity serializers), as kvstored serves its Get and Put."""

    def __init__(self) -> None:
        self.sock_dir = Path(tempfile.mkdtemp(prefix="kvr", dir="/tmp"))
        self.addr = f"unix://{self.sock_dir}/raw.sock"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvclient.bench", "--serve-raw", self.addr],
            stdin=subprocess.DEVNULL,
        )
        self.channel = grpc.insecure_channel(self.addr, options=RAW_OPTIONS)
        grpc.channel_ready_future(self.channel).result(timeout=30)
        self.pull = self.channel.unary_stream(f"/{RAW_SERVICE}/Pull")
        self.push = self.channel.stream_unary(f"/{RAW_SERVICE}/Push")
        self.echo = self.channel.unary_unary(f"/{RAW_SERVICE}/Echo")

    def close(self) -> None:
        self.channel.close()
        self.proc.terminate()
        self.proc.wait(10)
        shutil.rmtree(self.sock_dir, ignore_errors=True)


def serve_raw(addr: str) -> None:
    """The raw gRPC baseline server (runs in its own process)."""
    cache: dict[int, bytes] = {}

    def chunk(n: int) -> bytes:
        if n not in cache:
            cache[n] = bytes(n)
        return cache[n]

    async def pull(request: bytes, context: Any) -> Any:
        remaining = int.from_bytes(request, "little")
        while remaining > 0:
            n = min(remaining, RAW_CHUNK)
            yield chunk(n)
            remaining -= n

    async def push(requests: Any, context: Any) -> bytes:
        total = 0
        async for msg in requests:
            total += len(msg)
        return total.to_bytes(8, "little")

    async def echo(request: bytes, context: Any) -> bytes:
        return request

    async def main() -> None:
        handlers = grpc.method_handlers_generic_handler(
            RAW_SERVICE,
            {
                "Pull": grpc.unary_stream_rpc_method_handler(pull),
                "Push": grpc.stream_unary_rpc_method_handler(push),
                "Echo": grpc.unary_unary_rpc_method_handler(echo),
            },
        )
        server = grpc.aio.server(options=RAW_OPTIONS)
        server.add_generic_rpc_handlers((handlers,))
        server.add_insecure_port(addr)
        await server.start()
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
        await server.stop(None)

    asyncio.run(main())


class RedisBaseline:
    """``redis-server`` on a unix socket (no persistence), and a redis-py client with
    the hiredis parser and the Python command packer."""

    def __init__(self, server: str) -> None:
        import redis
        from redis.connection import PythonRespSerializer, UnixDomainSocketConnection

        class PythonPackerConnection(UnixDomainSocketConnection):  # type: ignore[misc]
            def _construct_command_packer(self, packer: Any) -> Any:
                return PythonRespSerializer(self._buffer_cutoff, self.encoder.encode)

        self.dir = Path(tempfile.mkdtemp(prefix="kvredis", dir="/tmp"))
        self.sock = str(self.dir / "redis.sock")
        self.proc = subprocess.Popen(
            [
                server,
                "--port",
                "0",
                "--unixsocket",
                self.sock,
                "--unixsocketperm",
                "700",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.dir),
                "--proto-max-bulk-len",
                "1gb",
                "--client-query-buffer-limit",
                "1gb",
                "--loglevel",
                "warning",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
        pool = redis.ConnectionPool(
            connection_class=PythonPackerConnection, path=self.sock, socket_timeout=120
        )
        self.client = redis.Redis(connection_pool=pool)
        wait_for(lambda: os.path.exists(self.sock) and self._ping(), 30, "redis-server")
        self.version = self.client.info("server").get("redis_version", "?")
        from redis.utils import HIREDIS_AVAILABLE

        self.parser = "hiredis" if HIREDIS_AVAILABLE else "python"

    @staticmethod
    def keys(layout: Layout, call: int, batch: int) -> list[bytes]:
        """The Redis keys of the blocks of one call."""
        return [f"{layout.name}:{call}:{i}".encode() for i in range(batch)]

    def check(self, layout: Layout, case: Case) -> None:
        """The first block of the case's first call reads back as put."""
        first = self.client.get(self.keys(layout, 0, 1)[0])
        if first is None or first != case.source[0][0].tobytes():
            raise RuntimeError("redis returned other bytes")

    def _ping(self) -> bool:
        try:
            return bool(self.client.ping())
        except Exception:
            return False

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.close()
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def redis_unavailable() -> str:
    """Why the Redis baseline cannot run here ('' when it can)."""
    if shutil.which("redis-server") is None:
        return "redis-server is not on PATH"
    try:
        import redis  # noqa: F401
    except ImportError:
        return "redis-py is not installed (pip install redis hiredis)"
    return ""


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


# -- reports ----------------------------------------------------------------------------


def _find(results: Sequence[Result], **match: Any) -> Result | None:
    for r in results:
        if all(getattr(r, k) == v for k, v in match.items()):
            return r
    return None


def _baseline(results: Sequence[Result], system: str, op: str, r: Result) -> Result | None:
    """The ``system`` row of ``r``'s case: the one measured beside it (the same tier:
    the warm disk cases have their own memcpy) where there is one, else the host
    cases' (tier ``-``)."""
    case = dict(system=system, op=op, layout=r.layout, batch=r.batch)
    return _find(results, tier=r.tier, **case) or _find(results, tier="-", **case)


def _fmt_size(n: int) -> str:
    if n >= MiB:
        return f"{n / MiB:g} MiB"
    if n >= 1024:
        return f"{n / 1024:g} KiB"
    return f"{n} B"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def _num(x: float, digits: int = 2) -> str:
    return "-" if not x or math.isnan(x) else f"{x:,.{digits}f}"


def result_rows(
    chosen: Sequence[Result], results: Sequence[Result] | None = None
) -> list[list[str]]:
    """Table rows of ``chosen``, with ratios to the baselines of each one's case among
    ``results`` (the whole run; ``chosen`` by default)."""
    if results is None:
        results = chosen
    rows = []
    for r in chosen:
        memcpy = _baseline(results, "memcpy", "get", r)
        redis_op = "put" if r.op in ("put", "put-nowait") else "get"
        redis = _find(results, system="redis", op=redis_op, layout=r.layout, batch=r.batch)
        raw = _baseline(results, "grpc-raw", r.op, r) if r.path == "inline" else None
        rows.append(
            [
                r.system,
                r.op,
                r.path,
                r.tier,
                r.layout,
                _fmt_size(r.block_bytes),
                str(r.batch),
                _num(r.gbps),
                _num(r.blocks_per_s, 0),
                _num(r.percentile(50), 3),
                _num(r.percentile(99), 3),
                _ratio(r.gbps, memcpy.gbps) if memcpy and r.bytes else "-",
                _ratio(r.gbps, redis.gbps) if redis and r.bytes and r.system == "kvstore" else "-",
                _ratio(r.gbps, raw.gbps) if raw and r.system == "kvstore" else "-",
                r.note,
            ]
        )
    return rows


HEADERS = [
    "system",
    "op",
    "path",
    "tier",
    "layout",
    "block",
    "batch",
    "GB/s",
    "blocks/s",
    "p50 ms",
    "p99 ms",
    "x memcpy",
    "x Redis",
    "x grpc raw",
    "note",
]


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


@dataclass
class Target:
    name: str
    goal: str
    measured: str
    met: bool | None  # None: not measured in this run
    floor: str = "-"  # the same case's floor on this machine, where one applies


def targets(results: Sequence[Result]) -> list[Target]:
    """The data-path targets, each from this run's results (worst qualifying case)."""
    out: list[Target] = []

    def worst_ratio(
        op: str,
        path: str,
        tier: str,
        base_system: str,
        base_op: str,
        keep: Callable[[Result], bool],
    ) -> tuple[float, str, Result] | None:
        worst = None
        for r in results:
            if r.system != "kvstore" or (r.op, r.path, r.tier) != (op, path, tier) or not keep(r):
                continue
            base = _baseline(results, base_system, base_op, r)
            if base is None or not base.gbps or not r.gbps:
                continue
            ratio = r.gbps / base.gbps
            label = f"{ratio:.2f}x ({r.layout} x{r.batch}: {r.gbps:.2f} vs {base.gbps:.2f} GB/s)"
            if worst is None or ratio < worst[0]:
                worst = (ratio, label, r)
        return worst

    big = lambda r: r.block_bytes >= 256 * 1024 and r.batch >= 16  # noqa: E731

    def ratio_target(
        name: str,
        goal: str,
        least: float,
        worst: tuple[float, str, Result] | None,
        floor_system: str = "",
    ) -> None:
        """A target met when the worst qualifying ratio is at least ``least``; with
        ``floor_system``, the ratio of that floor to memcpy in the same case beside it."""
        met = None if worst is None else worst[0] >= least
        floor = "-"
        if worst is not None and floor_system:
            r = worst[2]
            found = _find(results, system=floor_system, layout=r.layout, batch=r.batch)
            memcpy = _baseline(results, "memcpy", "get", found) if found else None
            if found and memcpy and found.gbps and memcpy.gbps:
                floor = f"{floor_system} {found.gbps / memcpy.gbps:.2f}x memcpy"
        out.append(Target(name, goal, worst[1] if worst else "not measured", met, floor))

    for op in ("get", "put", "put-nowait"):
        name = "arena put sent ahead (put_nowait)" if op == "put-nowait" else f"arena {op}"
        ratio_target(
            f"{name}, host hit, blocks >= 256 KiB, batch >= 16",
            ">= 0.7x memcpy",
            0.7,
            worst_ratio(op, "arena", "host", "memcpy", "get", big),
            "" if op == "get" else "stream",
        )
    ratio_target(
        "arena get, host hit, vs Redis MGET of the same blocks (>= 256 KiB, batch >= 16)",
        ">= 4x Redis",
        4,
        worst_ratio("get", "arena", "host", "redis", "get", big),
    )
    for op in ("get", "put"):
        ratio_target(
            f"inline {op} vs raw grpc bytes, same size and direction (>= 256 KiB, batch >= 16)",
            ">= 0.8x grpc raw",
            0.8,
            worst_ratio(op, "inline", "host", "grpc-raw", op, big),
        )
    ratio_target(
        "disk warm hit (arena get), blocks >= 256 KiB, batch >= 16",
        ">= 0.5x memcpy",
        0.5,
        worst_ratio("get", "arena", "disk-warm", "memcpy", "get", big),
        "pread",
    )
    floor = _find(results, system="write", op="write-back")
    for tier, name in (
        ("disk", "sustained write-back (host full, demotions to LMDB), first fill of the tier"),
        ("disk-reuse", "sustained write-back, again into the pages the first fill freed"),
    ):
        wb = _find(results, system="kvstore", op="write-back", tier=tier)
        out.append(
            Target(
                name,
                ">= 1 GB/s",
                f"{wb.gbps:.2f} GB/s" if wb else "not measured",
                None if wb is None else wb.gbps >= 1.0,
                f"fresh-file write {floor.gbps:.2f} GB/s" if floor and tier == "disk" else "-",
            )
        )
    best = None
    for r in results:
        tiny = r.system == "kvstore" and r.op == "lookup+get" and r.layout.startswith("tiny")
        if tiny and (best is None or r.blocks_per_s > best.blocks_per_s):
            best = r
    out.append(
        Target(
            "2-token blocks (tiny layout), batched, lookup + get per client",
            ">= 100,000 blocks/s",
            f"{best.blocks_per_s:,.0f} blocks/s ({best.path} x{best.batch})"
            if best
            else "not measured",
            None if best is None else best.blocks_per_s >= 100_000,
        )
    )
    return out


def machine_line() -> str:
    load = os.getloadavg() if hasattr(os, "getloadavg") else (0, 0, 0)
    return (
        f"{platform.machine()}, {os.cpu_count()} CPUs, Linux {platform.release()}, "
        f"Python {platform.python_version()}, numpy {np.__version__}, grpcio {grpc.__version__}; "
        f"load average at the end {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}"
    )


def render_markdown(bench: Bench, argv: Sequence[str], elapsed: float, png: str | None) -> str:
    results = bench.results
    lines = [
        f"Generated by `{' '.join(argv)}` on {time.strftime('%Y-%m-%d %H:%M')} in {elapsed:.0f} s.",
        "",
        f"- machine: {machine_line()}",
        f"- daemon: kvstored {bench.info.get('daemon', '?')}, host arena "
        f"{_fmt_size(int(bench.info.get('arena_bytes', 0)))}"
        + (", started by the benchmark in a temp dir" if bench.daemon else f" at {bench.addr}"),
        "- floors: stream = each call's bytes into fresh memory with kvstore's streaming copy "
        "(what a put does); pread = each call's bytes from a file in the page cache, one "
        "`preadv` per call (what a warm disk hit does); write = the write-back volume into a "
        "fresh file beside the disk tier's, 64 MiB per `pwrite` + `fdatasync` (what the "
        "first fill of the tier does)",
        f"- baselines: memcpy = one-thread `np.copyto` into a reused buffer; grpc raw = "
        f"grpc.aio server, unix socket, identity serializers, {RAW_CHUNK // 1024} KiB chunks; "
        f"redis = {bench.info.get('redis', 'skipped')}",
        f"- warm disk passes: {bench.info.get('warm', 'n/a')}; cold disk passes: page "
        f"cache dropped with {bench.info.get('cold', 'n/a')}",
        "- GB/s = 1e9 bytes/s of block bytes moved; best of the timed passes; p50/p99 per "
        "call over every timed call; the puts (kvstore, grpc raw push, redis, memcpy) take "
        "their passes in turns, and so do the gets, and the warm disk gets (kvstore, memcpy, "
        "pread: each kvstore pass reads chains of its own, after an untimed warm-up pass); "
        "a cold disk case is one pass",
    ]
    for note in bench.notes:
        lines.append(f"- {note}")
    for skipped in bench.skipped():
        lines.append(f"- skipped: {skipped}")
    lines += ["", "### Targets", ""]
    lines.append(
        markdown_table(
            ["target", "goal", "measured (worst qualifying case)", "met", "floor (same case)"],
            [
                [
                    t.name,
                    t.goal,
                    t.measured,
                    "-" if t.met is None else ("yes" if t.met else "**no**"),
                    t.floor,
                ]
                for t in targets(results)
            ],
        )
    )
    if png:
        lines += ["", f"![throughput against block size]({png})"]
    sections = [
        ("Get, host hit", lambda r: r.op == "get" and r.tier in ("host", "-")),
        (
            "Get, disk hit (warm and cold page cache)",
            lambda r: r.op == "get" and r.tier.startswith("disk"),
        ),
        ("Put", lambda r: r.op in ("put", "put-nowait")),
        (
            "Lookup, lookup + get, acquire (zero-copy views), miss",
            lambda r: r.op in ("lookup", "lookup+get", "acquire", "miss"),
        ),
        ("Raw gRPC echo (both directions, one message)", lambda r: r.op == "echo"),
        ("Sustained write-back", lambda r: r.op == "write-back"),
    ]
    for title, keep in sections:
        chosen = [r for r in results if keep(r)]
        if chosen:
            lines += ["", f"### {title}", "", markdown_table(HEADERS, result_rows(chosen, results))]
    return "\n".join(lines) + "\n"


def write_report(path: Path, body: str) -> None:
    block = f"{BEGIN_MARK}\n{body}{END_MARK}\n"
    if path.exists():
        text = path.read_text()
        if BEGIN_MARK in text and END_MARK in text:
            head, rest = text.split(BEGIN_MARK, 1)
            _, tail = rest.split(END_MARK, 1)
            path.write_text(head + block + tail.lstrip("\n"))
            return
        path.write_text(text.rstrip("\n") + "\n\n" + block)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("# Data-path throughput\n\n" + block)


def plot(results: Sequence[Result], path: Path) -> bool:
    """Throughput against block size, one panel per batch size; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    batches = sorted({r.batch for r in results if r.op in ("get", "put") and r.batch})
    if not batches:
        return False
    series = [
        ("memcpy", dict(system="memcpy", op="get"), "k-", None),
        ("stream into fresh memory (put floor)", dict(system="stream"), "k--", None),
        ("pread, page cache (disk warm floor)", dict(system="pread"), "k:", None),
        (
            "kvstore get arena",
            dict(system="kvstore", op="get", path="arena", tier="host"),
            "C0-",
            "o",
        ),
        ("kvstore put arena", dict(system="kvstore", op="put", path="arena"), "C0--", "s"),
        (
            "kvstore put arena, sent ahead",
            dict(system="kvstore", op="put-nowait", path="arena"),
            "C5--",
            "s",
        ),
        (
            "kvstore get arena, disk warm",
            dict(system="kvstore", op="get", path="arena", tier="disk-warm"),
            "C4-",
            "v",
        ),
        (
            "kvstore get inline",
            dict(system="kvstore", op="get", path="inline", tier="host"),
            "C1-",
            "o",
        ),
        ("kvstore put inline", dict(system="kvstore", op="put", path="inline"), "C1--", "s"),
        ("grpc raw pull", dict(system="grpc-raw", op="get"), "C2:", "^"),
        ("grpc raw push", dict(system="grpc-raw", op="put"), "C2-.", "^"),
        ("redis MGET", dict(system="redis", op="get"), "C3-", "D"),
        ("redis MSET", dict(system="redis", op="put"), "C3--", "D"),
    ]
    fig, axes = plt.subplots(1, len(batches), figsize=(5.2 * len(batches), 4.6), sharey=True)
    axes = np.atleast_1d(axes)
    for ax, batch in zip(axes, batches, strict=True):
        for label, match, style, marker in series:
            points = sorted(
                (r.block_bytes, r.gbps)
                for r in results
                if r.batch == batch and r.gbps and all(getattr(r, k) == v for k, v in match.items())
            )
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, style, marker=marker, label=label, markersize=4)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{batch} block{'s' if batch > 1 else ''} per call")
        ax.set_xlabel("block size (bytes)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("GB/s (best pass)")
    axes[-1].legend(fontsize=7, loc="lower right")
    fig.suptitle("kvstore data path beside memcpy, raw gRPC and Redis")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def print_table(results: Sequence[Result], stream: Any = None) -> None:
    stream = stream or sys.stdout
    rows = result_rows(results)
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(HEADERS)
    ]
    print("  ".join(h.ljust(w) for h, w in zip(HEADERS, widths, strict=True)), file=stream)
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)), file=stream)


def unmeasured_reason(target: Target, notes: Sequence[str], quick: bool) -> str:
    """Why a goal has no figure in this run, in words a reader acts on."""
    if "Redis" in target.name:
        skipped = [n for n in notes if n.startswith("Redis baseline skipped")]
        if skipped:
            return skipped[0].rstrip(".")
    if quick:
        return "a quick run has no case of that size (run without --quick)"
    return "no case of that size ran (see --layouts / --batches)"


def print_summary(bench: Bench, elapsed: float, quick: bool, stream: Any = None) -> None:
    """What a reader needs first: what ran, the goals, and why anything was skipped."""
    stream = stream or sys.stdout
    where = "its own daemon (a temp dir)" if bench.daemon is not None else bench.addr
    print(f"kvctl bench: {len(bench.results)} cases in {elapsed:.0f} s against {where}",
          file=stream)
    goals = targets(bench.results)
    if quick:
        print("quick run: a smoke check at small sizes; goals are judged by a full run "
              "(kvctl bench, ~10 minutes; docs/benchmarks/datapath.md)", file=stream)
    else:
        met = sum(t.met is True for t in goals)
        missed = sum(t.met is False for t in goals)
        print(f"goals: {met} met, {missed} missed, {len(goals) - met - missed} not measured",
              file=stream)
    for t in goals:
        if t.met is None:
            state, figure = "-", f"not measured: {unmeasured_reason(t, bench.notes, quick)}"
        else:
            state = "ran" if quick else ("met" if t.met else "MISSED")
            floor = "" if t.floor == "-" else f"; floor {t.floor}"
            figure = f"{t.measured} (goal {t.goal}{floor})"
        print(f"  {state:7} {t.name}: {figure}", file=stream)
    for note in bench.notes:
        print(f"note: {note}", file=stream)


# -- entry points -----------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="tiny sizes, a smoke run (seconds)")
    p.add_argument("--layouts", nargs="+", metavar="L", help=f"of {', '.join(LAYOUTS)}")
    p.add_argument("--batches", nargs="+", type=int, metavar="N", help="blocks per call")
    p.add_argument("--paths", nargs="+", choices=["arena", "inline"])
    p.add_argument("--repeat", type=int, help="timed passes per case (best is kept)")
    p.add_argument("--max-call-mib", type=int, help="skip calls larger than this")
    p.add_argument("--pass-mib", type=int, help="bytes per timed pass (arena path, memcpy)")
    p.add_argument("--no-disk", action="store_true", help="skip the disk-tier cases")
    p.add_argument("--no-cold", action="store_true", help="skip the cold page-cache pass")
    p.add_argument("--no-redis", action="store_true", help="skip the Redis baseline")
    p.add_argument("--report", metavar="FILE.md", help="write the markdown report (and a PNG)")
    p.add_argument("--json", metavar="FILE", help="write every result as JSON")
    p.add_argument("--table", action="store_true", help="print every case, after the summary")
    p.add_argument("--workdir", help="where an own daemon keeps its files (default: a temp dir)")


def run_bench(args: argparse.Namespace, addr: str | None, argv: Sequence[str]) -> int:
    settings = settings_for(args)
    started = time.monotonic()
    workdir_ctx: Any = (
        contextlib.nullcontext(args.workdir)
        if args.workdir
        else tempfile.TemporaryDirectory(prefix="kvbench-", dir="/tmp")
    )
    with workdir_ctx as workdir:
        bench = Bench(settings, addr, Path(workdir))
        try:
            bench.open()
            bench.run()
        except KVStoreError as exc:
            print(f"kvctl bench: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 130
        finally:
            bench.close()
    elapsed = time.monotonic() - started
    print_summary(bench, elapsed, args.quick)
    if args.table:
        print(file=sys.stdout)
        print_table(bench.results)
    elif not args.report and not args.json:
        print("every case: add --table, or --report FILE.md / --json FILE")
    if args.json:
        data = {
            "argv": list(argv),
            "machine": machine_line(),
            "info": bench.info,
            "notes": bench.notes,
            "results": [r.to_dict() for r in bench.results],
            "targets": [asdict(t) for t in targets(bench.results)],
        }
        Path(args.json).write_text(json.dumps(data, indent=1))
    if args.report:
        report = Path(args.report)
        png = report.with_suffix(".png")
        drawn = plot(bench.results, png)
        body = render_markdown(bench, argv, elapsed, png.name if drawn else None)
        write_report(report, body)
        print(f"wrote {report}" + (f" and {png}" if drawn else ""), file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--serve-raw"]:
        serve_raw(argv[1])
        return 0
    parser = argparse.ArgumentParser(
        prog="python -m kvclient.bench", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--addr", help="a running kvstored (default: start one in a temp dir)")
    add_arguments(parser)
    args = parser.parse_args(argv)
    return run_bench(args, args.addr, ["python -m kvclient.bench", *argv])


if __name__ == "__main__":
    sys.exit(main())
