"""Where a warm disk hit's time goes, part by part. A program, not a test.

A same-host client serves the first read of a prefix that is all on disk and in the
page cache with no call (``kvclient.disk_index``): the chain keys, one read transaction
with a ``meta`` record per block, then per block a ``preadv2(RWF_NOWAIT)`` into the
caller's buffer and an xxh3-64 check. ``kvctl bench`` holds it to 0.5x the memcpy of the
same bytes. This program starts a kvstored in a temp dir, puts chains that end up on
disk only (it restarts the daemon, which keeps its disk tier), reads the tier's file
whole into the page cache, and then measures per call, the modes in turns (call after
call, so that the host's drift hits every mode alike), each reading chains of its own:

- ``memcpy``: one-thread ``np.copyto`` of the call's bytes into a reused buffer;
- ``pread``: one ``preadv`` per block from the tier's file (the floor: no lookup, no
  check);
- ``pread+check``: the same, each block checked against its xxh3-64 as the client does;
- ``index read``: ``DiskIndex.read`` of the chain's keys (computed beforehand): the read
  transaction, the ``meta`` records, then the reads and checks
  (``DiskFile.read_cached``);
- ``chain keys``: ``kvstore.keys.chain_keys`` of the chain (SHA-256 per block);
- ``get``: ``ns.get(tokens, out=buffer)``, the whole call as an engine makes it;
- ``get, no index``: the same from a client that opens no disk index of its own
  (``KVCLIENT_DISK_INDEX=0``): its Acquire asks the daemon for the blocks' extents in
  the file, then it reads them (the A/B of :mod:`kvclient.disk_index`).

The differences between rows are what each layer adds: the check, the lookups, the
keys and the rest of the get. A row's ratio is memcpy's p50 over its own.

    .venv/bin/python benchmarks/disk_hit_parts.py                  # 16 x 256 KiB
    .venv/bin/python benchmarks/disk_hit_parts.py --cases llama2:16 llama8:16 --calls 60
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from unittest import mock

import numpy as np
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvbench.harness import (
    LAYOUTS,
    GiB,
    Layout,
    MiB,
    TokenSource,
    aligned_buffer,
    program_parser,
    warm_page_cache,
    write_program_report,
)
from kvbench.report import machine_line
from kvbench.servers import OwnDaemon
from kvclient import KVClient, Namespace  # noqa: E402
from kvclient.disk_index import DiskIndex  # noqa: E402
from kvclient.disk_reads import DiskFile  # noqa: E402
from kvstore.disk_format import DiskExtent  # noqa: E402
from kvstore.keys import NamespaceSpec, chain_keys  # noqa: E402

MODES = ("memcpy", "pread", "pread+check", "index read", "chain keys", "get", "get, no index")
# each reads chains of its own
CHAIN_MODES = ("pread", "pread+check", "index read", "get", "get, no index")
WRITE_BACK_LAG = 16 * MiB  # queued write-back bytes after which the puts wait
SOURCES = 8  # call-sized sources that memcpy and the puts cycle through


class ExtentRecorder:
    """A reader for ``DiskIndex.read`` that only notes the extents it is given."""

    def __init__(self) -> None:
        self.extents: list[DiskExtent] = []

    def read_cached(self, blocks: np.ndarray, extents: Sequence[DiskExtent]) -> bool:
        self.extents = list(extents)
        return True


def locate(
    index: DiskIndex, spec: NamespaceSpec, tokens: np.ndarray, out: np.ndarray
) -> list[DiskExtent]:
    """Where the chain's blocks (all on disk) lie in the tier's file, and their checksums."""
    recorder = ExtentRecorder()
    if not index.read(chain_keys(spec, tokens), out, recorder):
        raise RuntimeError("a block of a chain put before the restart is not on disk")
    return recorder.extents


def pread_blocks(fd: int, out: np.ndarray, extents: list[DiskExtent], check: bool) -> None:
    for row, extent in zip(out, extents, strict=True):
        os.preadv(fd, [row], extent.offset)
        if check and xxhash.xxh3_64_intdigest(row) != extent.checksum:
            raise RuntimeError(f"the block at offset {extent.offset} failed its check")


def put_chains(
    daemon: OwnDaemon, ns_name: str, layout: Layout, chains: list[np.ndarray], sources: np.ndarray
) -> None:
    """Put every chain (its blocks from ``sources[i % SOURCES]``), then restart the
    daemon: its host tier starts empty, so every chain is on disk only."""
    with KVClient(daemon.addr) as client:
        ns = client.namespace(ns_name, layout.block_tokens, **layout.spec())
        for i, tokens in enumerate(chains):
            blocks = sources[i % SOURCES][: len(tokens) // layout.block_tokens]
            deadline = time.monotonic() + 60
            while ns.put(tokens, blocks).refused:  # the host tier is full until write-back
                if time.monotonic() > deadline:
                    raise RuntimeError("the daemon refused puts for 60 s")
                time.sleep(0.01)
            # keep pace with the write-back: a host block evicted while the disk queue
            # is full is dropped, not written (the daemon never waits for the disk there)
            while client.stats().disk_queue_bytes > WRITE_BACK_LAG:
                if time.monotonic() > deadline:
                    raise RuntimeError("the disk write queue did not drain for 60 s")
                time.sleep(0.005)
    daemon.stop()
    daemon.start()


def measure_case(workdir: Path, layout_name: str, batch: int, calls: int) -> dict[str, list[float]]:
    """Per mode, the milliseconds of each timed call."""
    layout = LAYOUTS[layout_name]
    size = layout.block_bytes
    call_bytes = batch * size
    token_source = TokenSource()
    # per chain mode: one warm-up chain, then one chain per timed call
    chains = {
        mode: [token_source.chain(batch * layout.block_tokens) for _ in range(calls + 1)]
        for mode in CHAIN_MODES
    }
    spare = token_source.chain(layout.block_tokens)
    volume = (len(CHAIN_MODES) * (calls + 1) + 1) * call_bytes
    ns_name = f"disk-parts-{layout_name}-{batch}"
    daemon = OwnDaemon(workdir, 256 * MiB, max(GiB, 2 * volume))
    daemon.start()
    try:
        sources = aligned_buffer(SOURCES * call_bytes, fill=None).reshape(SOURCES, batch, size)
        every_chain = [spare, *(t for m in CHAIN_MODES for t in chains[m])]
        put_chains(daemon, ns_name, layout, every_chain, sources)
        out = aligned_buffer(call_bytes).reshape(batch, size)
        print(f"  {warm_page_cache(str(daemon.disk_dir / 'data.mdb'), out.reshape(-1))}")
        with KVClient(daemon.addr) as client, KVClient(daemon.addr) as other:
            info = client.server_info()
            ns = client.namespace(ns_name, layout.block_tokens, **layout.spec())
            ns.get(spare, out=out[:1])  # the client's one-time costs: its index, the specs
            # KVCLIENT_DISK_INDEX=0 while it connects: it maps the arena and opens no disk
            # index of its own, so its first disk reads ask the daemon for the extents
            with mock.patch.dict(os.environ, {"KVCLIENT_DISK_INDEX": "0"}):
                ns_other = other.namespace(ns_name, layout.block_tokens, **layout.spec())
            disk = DiskFile.open(info.disk_path)
            if disk is None:
                raise RuntimeError(f"this process cannot read the disk tier ({info.disk_path})")
            fd = os.open(info.disk_path, os.O_RDONLY)
            try:
                times = time_modes(disk, fd, ns, ns_other, chains, sources, out, calls)
            finally:
                os.close(fd)
                disk.close()
        return times
    finally:
        daemon.cleanup()


def time_modes(
    disk: DiskFile,
    fd: int,
    ns: Namespace,
    ns_other: Namespace,
    chains: dict[str, list[np.ndarray]],
    sources: np.ndarray,
    out: np.ndarray,
    calls: int,
) -> dict[str, list[float]]:
    """Per mode, the milliseconds of each timed call (the modes in turns)."""
    index = disk.index
    spec = index.spec(ns.ns_id) if index is not None else None
    if index is None or spec is None:
        raise RuntimeError(f"this process cannot read the disk tier's index ({disk.path})")
    batch = out.shape[0]
    extents = {
        mode: [locate(index, spec, tokens, out) for tokens in chains[mode]]
        for mode in ("pread", "pread+check")
    }
    index_keys = [chain_keys(spec, tokens) for tokens in chains["index read"]]

    def index_read(i: int) -> None:
        if not index.read(index_keys[i], out, disk):
            raise RuntimeError("a warm disk block could not be read with no call")

    def get(i: int, mode: str = "get", handle: Namespace = ns) -> None:
        n = handle.get(chains[mode][i], out=out).n_blocks
        if n != batch:
            raise RuntimeError(f"{mode} found {n} of {batch} blocks")

    runs: dict[str, Callable[[int], object]] = {
        "memcpy": lambda i: np.copyto(out, sources[i % SOURCES]),
        "pread": lambda i: pread_blocks(fd, out, extents["pread"][i], check=False),
        "pread+check": lambda i: pread_blocks(fd, out, extents["pread+check"][i], check=True),
        "index read": index_read,
        "chain keys": lambda i: chain_keys(spec, chains["index read"][i]),
        "get": get,
        "get, no index": lambda i: get(i, "get, no index", ns_other),
    }
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for i in range(calls + 1):  # call 0 of each mode warms up, untimed
        for mode in MODES:
            start = time.perf_counter()
            runs[mode](i)
            elapsed = (time.perf_counter() - start) * 1e3
            if i:
                times[mode].append(elapsed)
    return times


def render(cases: list[tuple[str, int, dict[str, list[float]]]], calls: int) -> str:
    lines = [
        "# Where a warm disk hit's time goes",
        "",
        "Measured by `benchmarks/disk_hit_parts.py` (re-run it to refresh this file).",
        "",
        f"- machine: {machine_line()}",
        f"- {calls} timed calls per mode after one untimed, the modes in turns call after "
        "call, each mode reading chains of its own; every chain on disk only (the daemon "
        "restarted after the puts), the tier's file read whole into the page cache first",
        "- GB/s at the p50; x memcpy = memcpy's p50 over the row's p50",
        "",
        "| case | mode | p50 ms | min ms | mean ms | GB/s | x memcpy |",
        "|---|---|---|---|---|---|---|",
    ]
    readings = []
    for layout_name, batch, times in cases:
        layout = LAYOUTS[layout_name]
        label = f"{batch} x {layout.block_bytes >> 10} KiB ({layout.name})"
        call_bytes = batch * layout.block_bytes
        p50 = {mode: statistics.median(times[mode]) for mode in MODES}
        for mode in MODES:
            moved = "-" if mode == "chain keys" else f"{call_bytes / p50[mode] / 1e6:.2f}"
            ratio = "-" if mode == "chain keys" else f"{p50['memcpy'] / p50[mode]:.2f}x"
            lines.append(
                f"| {label} | {mode} | {p50[mode]:.3f} | {min(times[mode]):.3f} "
                f"| {statistics.fmean(times[mode]):.3f} | {moved} | {ratio} |"
            )
        rest = p50["get"] - p50["index read"] - p50["chain keys"]
        readings.append(
            f"- {label}, differences of the p50s: the check adds "
            f"{p50['pread+check'] - p50['pread']:.3f} ms to the reads, the read transaction "
            f"and the `meta` records {p50['index read'] - p50['pread+check']:.3f} ms, the "
            f"chain keys {p50['chain keys']:.3f} ms, and the rest of the get {rest:.3f} ms. "
            f"The 0.5x target allows {2 * p50['memcpy']:.3f} ms per call."
        )
        slower = p50["get, no index"] / p50["get"]
        readings.append(
            f"- {label}, A/B of the client's own disk index: a first read with it "
            f"{p50['get']:.3f} ms, asking the daemon for the extents instead "
            f"{p50['get, no index']:.3f} ms ({slower:.2f}x as long)."
        )
    lines += [
        "",
        "Reading it: the reads from the page cache (`pread`) are the floor of a warm disk "
        "hit; what the other rows add is the check and the Python around the reads.",
        "",
        *readings,
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = program_parser(__doc__, [("llama2", 16)], "call")
    parser.add_argument("--calls", type=int, default=100, help="timed calls per mode")
    parser.add_argument("--out", default="docs/benchmarks/disk_hit_parts.md")
    args = parser.parse_args()
    if args.calls < 1:
        parser.error("--calls must be at least 1")
    cases = []
    for name, batch in args.cases:
        print(f"{name} x{batch}: putting chains, restarting the daemon", flush=True)
        with tempfile.TemporaryDirectory(prefix="kvdiskparts-", dir="/tmp") as workdir:
            times = measure_case(Path(workdir), name, batch, args.calls)
        cases.append((name, batch, times))
        memcpy = statistics.median(times["memcpy"])
        for mode in MODES:
            p50 = statistics.median(times[mode])
            print(f"  {mode:12s} p50 {p50:.3f} ms  min {min(times[mode]):.3f} ms  "
                  f"x memcpy {memcpy / p50:.2f}", flush=True)  # fmt: skip
    write_program_report(args.out, render(cases, args.calls))
    return 0


if __name__ == "__main__":
    sys.exit(main())
