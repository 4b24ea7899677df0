"""The first read of a disk block, in two checkouts in turns, beside its floor.

A program, not a test. Like ``benchmarks/call_cost.py``, ``--before`` is another
checkout of this repository (with the built ``kvstore/_streamcopy*.so`` copied in);
each round runs this program's ``--worker`` once per checkout (``PYTHONPATH`` naming
that checkout's packages, run from it), the order reversed every other round. A worker
starts its own kvstored (arena path, disk tier, the arena prefaulted), stores
``--chains`` chains of one 256 KiB block, restarts it (every block on disk only), reads
the disk tier's files (the page cache warm), and then, per chain, in milliseconds:

- ``first get``: the first get of the chain (the daemon promotes the block, or, before
  the client stopped reading LMDB, the client read it from the file);
- ``acquire`` / ``copy`` / ``release``: the same first read in its three steps (a
  second set of chains);
- ``host acquire``: an Acquire of a chain already in the host tier (the round trip a
  daemon-served read cannot go below).

The report gives each checkout's median of each, best round first, every round after.

    .venv/bin/python benchmarks/first_disk_read.py --before /tmp/before --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kvbench import checkouts

REPO = Path(__file__).resolve().parent.parent
BLOCK_TOKENS, BLOCK_BYTES = 2, 256 * 1024
MEASURES = ("first get", "acquire", "copy", "release", "host acquire")


def worker(chains: int) -> dict[str, float]:
    from kvbench.servers import OwnDaemon
    from kvclient import KVClient

    with tempfile.TemporaryDirectory(prefix="first-disk-read-") as tmp:
        daemon = OwnDaemon(Path(tmp), host_bytes=1 << 30, disk_bytes=2 << 30)
        daemon.workdir.mkdir(parents=True, exist_ok=True)
        daemon.start()
        try:
            sets = [[[7 + i, s * 100_000 + i] for i in range(chains)] for s in (1, 2)]
            data = np.random.default_rng(0).integers(0, 255, (1, BLOCK_BYTES), dtype=np.uint8)
            with KVClient(daemon.addr) as client:
                ns = client.namespace("first-disk-read", BLOCK_TOKENS, BLOCK_BYTES)
                for chain in sets[0] + sets[1]:
                    ns.put(chain, data)
            daemon.stop()
            daemon.start()
            for path in daemon.disk_dir.rglob("*"):
                if path.is_file():
                    path.read_bytes()  # the page cache warm
            ms: dict[str, list[float]] = {m: [] for m in MEASURES}
            with KVClient(daemon.addr) as client:
                ns = client.namespace("first-disk-read", BLOCK_TOKENS, BLOCK_BYTES)
                out = np.empty((1, BLOCK_BYTES), np.uint8)
                ns.get([1, 2], out=out)  # the call path warm (a miss)
                for chain in sets[0]:
                    t0 = time.perf_counter()
                    assert ns.get(chain, out=out).n_blocks == 1
                    ms["first get"].append(time.perf_counter() - t0)
                for chain in sets[1]:
                    t0 = time.perf_counter()
                    lease = ns.acquire(chain)
                    t1 = time.perf_counter()
                    lease.copy_to(out, 0, 1)
                    t2 = time.perf_counter()
                    lease.release()
                    t3 = time.perf_counter()
                    ms["acquire"].append(t1 - t0)
                    ms["copy"].append(t2 - t1)
                    ms["release"].append(t3 - t2)
                for chain in sets[1]:  # in the host tier now
                    t0 = time.perf_counter()
                    ns.acquire(chain).release()
                    ms["host acquire"].append(time.perf_counter() - t0)
        finally:
            daemon.cleanup()
    return {m: statistics.median(v) * 1e3 for m, v in ms.items()}


def render(runs: dict[str, list[dict[str, float]]], args: argparse.Namespace) -> str:
    lines = [
        "# The first read of a disk block: two checkouts in turns",
        "",
        f"Measured by `benchmarks/first_disk_read.py` on {time.strftime('%Y-%m-%d %H:%M')}: "
        f"before = `{args.before_label}`, after = `{args.after_label}`, {args.rounds} "
        f"rounds of {args.chains} single-block chains (256 KiB) per measure, the order "
        "reversed every other round; the page cache warm, the arena prefaulted.",
        "",
        "ms per call, median of a round; the best round, then each round's in order.",
        "",
        "| measure | before | after | before, by round | after, by round |",
        "|---|---|---|---|---|",
    ]
    for m in MEASURES:
        b = [r[m] for r in runs["before"]]
        a = [r[m] for r in runs["after"]]
        lines.append(
            f"| {m} | {min(b):.3f} | {min(a):.3f} | {' / '.join(f'{x:.3f}' for x in b)} "
            f"| {' / '.join(f'{x:.3f}' for x in a)} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    checkouts.add_arguments(parser, REPO)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chains", type=int, default=300)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=REPO / "docs/benchmarks/first_disk_read.md")
    args = parser.parse_args(argv)
    return checkouts.main_in_turns(
        parser, args, Path(__file__).resolve(), lambda: worker(args.chains),
        ["--chains", str(args.chains)], render,
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
