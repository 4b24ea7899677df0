"""What is measured and how: layouts, settings, results, timed passes in turns, and
the page-cache helpers (the harness of ``kvctl bench`` and of ``benchmarks/``)."""

from __future__ import annotations

import argparse
import math
import mmap
import os
import shutil
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from kvclient.namespace import Namespace

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
        """The layout fields of ``KVClient.namespace``."""
        return {f: getattr(self, f) for f in ("num_layers", "num_kv_heads", "head_dim", "dtype")}


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


def namespace_calls(
    ns: Namespace, op: str, blocks: int, source: TokenSource, n: int
) -> list[Callable[[], object]]:
    """``n`` calls of one case on ``ns``: gets (``op == "get"``) of one stored prefix of
    ``blocks`` blocks, or puts of as many new ones (a fresh chain each)."""
    payload = np.full((blocks, ns.block_bytes), 7, dtype=np.uint8)
    if op == "get":
        tokens = source.chain(blocks * ns.block_tokens)
        # kept above the puts' blocks: reads served from known slots are reported
        # (and so touched for eviction) in batches, after the fact
        ns.put(tokens, payload, priority=90)
        out = np.empty_like(payload)

        def get() -> None:
            if ns.get(tokens, out=out).n_blocks != blocks:
                raise RuntimeError(f"a get of {blocks} stored blocks missed: the run is void")

        return [get] * n

    def put() -> None:
        ns.put(source.chain(blocks * ns.block_tokens), payload)

    return [put] * n


@dataclass
class Series:
    """One series of an interleaved measurement: ``calls`` is one pass of it."""

    result: Result  # its best pass and latencies land here (two series may share one)
    calls: Sequence[Callable[[], object]]
    warmup: Callable[[], None] | None = None
    before_pass: Callable[[], None] | None = None


def interleaved_passes(series: Sequence[Series], repeat: int, alternate: bool = False) -> None:
    """Measure ``series`` in turns: one untimed warm-up of each, in order (``warmup``,
    else one pass of its calls), then ``repeat`` rounds of one timed pass of each.

    Why in turns: this host's speed drifts by up to 2x within a minute (other tenants).
    A ratio of two figures measured minutes apart measures that drift as much as the
    code; taken in turns, every series of a ratio sees the same slow and quick spells,
    and each keeps its best pass. ``alternate``: every other round runs the series in
    reverse order, so that no series is always the one that follows another (the
    first pass after a switch of daemon or case pays for it).
    """
    for one in series:
        if one.warmup is not None:
            one.warmup()
        else:
            for call in one.calls:
                call()
    for round_ in range(repeat):
        for one in series[::-1] if alternate and round_ % 2 else series:
            if one.before_pass is not None:
                one.before_pass()
            seconds = _timed_pass(one.calls, one.result.latencies_ms)
            one.result.seconds = min(one.result.seconds, seconds)


def free_tcp_port() -> int:
    """A TCP port on loopback that was free a moment ago (for a daemon to listen on)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


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


