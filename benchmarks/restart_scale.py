"""Start-up time against the size of the disk tier: two checkouts in turns, beside the
floor.

A program, not a test. For each size (``--records``, e.g. 1M and 10M) it fills a disk
directory with synthetic records written straight into LMDB in the disk tier's format
(:mod:`kvbench.disk_fill`: chains of 16 blocks of 64 bytes under the keys their tokens
give, one namespace, times of last use spread over the chains), then, in turns, per
checkout (``--before``: another checkout of this repository, ``PYTHONPATH`` naming its
packages, run from it, as in ``benchmarks/first_disk_read.py``), a worker process
opens a store on it as the daemon does (the deep check in a child process included)
and reports, in seconds from the call that opens it:

- ``first answer``: the store answered a lookup (a chain's blocks, found or not);
- ``loaded``: the whole index is loaded (before the background load, both are the
  same: the index was rebuilt before the store answered);
- ``blocks``: how many blocks the index holds then (all of them, both times).

Beside them, ``floor``: LMDB's own sequential scan of the same records (every key and
value of the ``meta`` database read with a cursor in one read transaction), the least
any index rebuild from these records costs; and ``kvstored``: the current checkout's
daemon, from its process start to its first answered Lookup over its socket.

    .venv/bin/python benchmarks/restart_scale.py --before /tmp/before \\
        --records 1000000 10000000
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvbench import checkouts
from kvbench.disk_fill import chain_tokens, fill_disk

REPO = Path(__file__).resolve().parent.parent
CHAIN = 16
SIZE = 64  # payload bytes of a synthetic record
FOOTPRINT = 3 * 4096  # disk bytes a record is accounted as, with room to spare


SPEC = {"model": "restart-scale", "block_tokens": 16, "block_bytes": SIZE}


def fill(directory: Path, records: int) -> None:
    """Write ``records`` synthetic records (see the module docstring)."""
    shown = [time.monotonic()]

    def progress(chains: int) -> None:
        if time.monotonic() - shown[0] > 10:
            shown[0] = time.monotonic()
            print(f"  filled {chains * CHAIN:,} of {records:,}", flush=True)

    fill_disk(directory, records // CHAIN, CHAIN, SPEC, lambda c, i: b"x" * SIZE, progress)


def worker(directory: str, records: int) -> dict[str, Any]:
    """Open a store on ``directory`` as the daemon does; the times (module docstring)."""
    from kvstore.keys import NamespaceSpec
    from kvstore.store import Store, StoreConfig

    spec = NamespaceSpec(**SPEC)  # type: ignore[arg-type]
    config = StoreConfig(
        host_bytes=64 << 20,
        disk_dir=directory,
        disk_bytes=records * FOOTPRINT + (1 << 30),
        shared_arena=False,
        check_disk_in_child=True,
    )
    t0 = time.perf_counter()
    store = Store(config)
    ns = store.open_namespace(spec).ns_id
    store.lookup(ns, store.keys_for(ns, chain_tokens(records // CHAIN - 1, CHAIN, 16)))
    first = time.perf_counter() - t0
    wait = getattr(store, "wait_loaded", None)  # the background load's, when there is one
    if wait is not None:
        wait()
    loaded = time.perf_counter() - t0
    blocks = store.stats().tiers[1].blocks
    store.close()
    return {"first answer": first, "loaded": loaded, "blocks": blocks}


def floor(directory: str) -> float:
    import lmdb

    env = lmdb.open(directory, readonly=True, lock=False, max_dbs=8)
    meta = env.open_db(b"meta", create=False)
    t0 = time.perf_counter()
    n = 0
    with env.begin() as txn:
        for _key, _value in txn.cursor(db=meta):
            n += 1
    took = time.perf_counter() - t0
    env.close()
    return took


def daemon_first_answer(directory: Path, records: int) -> float:
    """The current checkout's kvstored on ``directory``: process start to first Lookup."""
    from kvbench.servers import OwnDaemon
    from kvclient import KVClient
    from kvclient.errors import KVStoreError

    work = Path(tempfile.mkdtemp(prefix="restart-scale-"))
    daemon = OwnDaemon(work, host_bytes=64 << 20, disk_bytes=records * FOOTPRINT + (1 << 30))
    daemon.disk_dir = directory
    daemon.args[daemon.args.index("--disk_dir") + 1] = str(directory)
    t0 = time.perf_counter()
    daemon.start()
    try:
        while True:
            try:
                with KVClient(daemon.addr, timeout=5) as client:
                    client.namespace("restart-scale", 16, SIZE).lookup(list(range(16)))
                return time.perf_counter() - t0
            except (KVStoreError, OSError):
                time.sleep(0.01)
    finally:
        daemon.cleanup()
        shutil.rmtree(work, ignore_errors=True)


def render(results: dict[int, dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        "# Start-up time against the size of the disk tier",
        "",
        f"Measured by `benchmarks/restart_scale.py` on {time.strftime('%Y-%m-%d %H:%M')}: "
        f"before = `{args.before_label}`, after = `{args.after_label}`, in turns in one "
        f"run ({args.rounds} round(s), the order reversed every other round); synthetic "
        f"records written straight into LMDB (chains of {CHAIN} blocks of {SIZE} bytes), "
        "the page cache warm; a store opened as the daemon opens it (the deep check in "
        "a child process included). Seconds from the open; the best round.",
        "",
        "| records | before: first answer | before: loaded | after: first answer "
        "| after: loaded | loaded, before / after | floor (LMDB scan) | kvstored after: "
        "process start to first Lookup |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for records, r in results.items():
        b = min(r["before"], key=lambda x: x["loaded"])
        a = min(r["after"], key=lambda x: x["loaded"])
        af = min(x["first answer"] for x in r["after"])
        lines.append(
            f"| {records:,} | {b['first answer']:.2f} | {b['loaded']:.2f} | {af:.3f} | "
            f"{a['loaded']:.2f} | {b['loaded'] / a['loaded']:.1f}x | {r['floor']:.2f} | "
            f"{r['daemon']:.2f} |"
        )
    lines += ["", "Every run, in order (seconds):", ""]
    for records, r in results.items():
        for side in ("before", "after"):
            runs = ", ".join(
                f"first answer {x['first answer']:.3f} / loaded {x['loaded']:.2f} "
                f"({x['blocks']:,} blocks)"
                for x in r[side]
            )
            lines.append(f"- {records:,} records, {side}: {runs}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    checkouts.add_arguments(parser, REPO)
    parser.add_argument("--records", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--dir", type=Path, help="where the disk tiers go (a temp dir)")
    parser.add_argument("--worker", nargs=2, metavar=("DIR", "RECORDS"), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=REPO / "docs/benchmarks/restart.md")
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker[0], int(args.worker[1]))))
        return 0
    if args.before is None:
        parser.error("--before is required")
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    base = Path(tempfile.mkdtemp(prefix="restart-scale-", dir=args.dir))
    results: dict[int, dict[str, Any]] = {}
    try:
        for records in args.records:
            directory = base / f"disk-{records}"
            print(f"filling {records:,} records into {directory}", flush=True)
            fill(directory, records)
            r: dict[str, Any] = {"before": [], "after": []}
            for n, _, side in checkouts.in_turns(args.rounds):
                print(f"{records:,} records, round {n + 1}: {side}", flush=True)
                r[side].append(
                    checkouts.run_worker(
                        Path(__file__).resolve(), trees[side], [str(directory), str(records)]
                    )
                )
                print(f"  {r[side][-1]}", flush=True)
            r["floor"] = floor(str(directory))
            r["daemon"] = daemon_first_answer(directory, records)
            print(f"  floor {r['floor']:.2f} s, kvstored first answer {r['daemon']:.2f} s")
            results[records] = r
            shutil.rmtree(directory)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    text = render(results, args)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
