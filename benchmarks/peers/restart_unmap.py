"""The first read after a daemon restart, with the old arena unmapped in the call or
behind it: an A/B in turns, in one process (#57's disk case).

A client maps the daemon's arena; after a restart it maps the new one, and the
mapping of the old one may be the last reference to that arena's pages, so unmapping
it frees them (in proportion to the arena). Each round restarts the daemon (write-
through, so the blocks are on disk) once per variant, the order reversed every other
round, and times the first request after it as the vLLM connector makes one: a
lookup on one client, a load window by window on another (a scheduler's and a
worker's). ``in the call`` is ``ClientArena.close``, ``behind`` is
``ClientArena.close_behind`` (a thread of its own, at the lowest priority).

    .venv/bin/python benchmarks/peers/restart_unmap.py --rounds 4 \\
        --out docs/benchmarks/restart-unmap.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kvbench.servers import OwnDaemon  # noqa: E402
from kvclient import KVClient  # noqa: E402
from kvclient.arena_path import ClientArena  # noqa: E402

GiB = 1 << 30
BLOCK_TOKENS, BLOCK_BYTES = 32, 720 << 10  # SmolLM2's block of 32 tokens in bfloat16
LAYOUT = dict(num_layers=30, num_kv_heads=3, head_dim=64, dtype="bfloat16")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=60)
    parser.add_argument("--host-gib", type=float, default=2.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    variants = {"in the call": ClientArena.close, "behind": ClientArena.close_behind}
    tokens = [(i * 7919) % 30000 for i in range(args.blocks * BLOCK_TOKENS)]
    rows = np.random.default_rng(0).integers(0, 255, (args.blocks, BLOCK_BYTES), np.uint8)
    out = np.empty_like(rows)
    took: dict[str, list[float]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as work:
        through = ["--admission", "write-through"]
        daemon = OwnDaemon(Path(work), int(args.host_gib * GiB), 16 * GiB, extra_args=through)
        daemon.start()
        scheduler, worker = KVClient(daemon.addr, timeout=0.5), KVClient(daemon.addr)
        try:
            names = list(variants)
            worker.namespace("restart", BLOCK_TOKENS, BLOCK_BYTES, **LAYOUT).put(tokens, rows)
            for r in range(args.rounds):
                for name in names if r % 2 == 0 else names[::-1]:
                    ClientArena.close_behind = variants[name]  # type: ignore[method-assign]
                    daemon.stop()
                    daemon.start()
                    started = time.perf_counter()
                    ns = scheduler.namespace("restart", BLOCK_TOKENS, BLOCK_BYTES, **LAYOUT)
                    assert ns.lookup(tokens).blocks == args.blocks
                    ns = worker.namespace("restart", BLOCK_TOKENS, BLOCK_BYTES, **LAYOUT)
                    got = 0
                    for lease in ns.windows(tokens, window_blocks=88):
                        lease.copy_to(out[got:], 0, lease.n_blocks)
                        got += lease.n_blocks
                    took[name].append((time.perf_counter() - started) * 1e3)
                    assert got == args.blocks and np.array_equal(out, rows)
        finally:
            ClientArena.close_behind = variants["behind"]  # type: ignore[method-assign]
            scheduler.close()
            worker.close()
            daemon.cleanup()
    lines = [
        f"First request after a daemon restart ({args.blocks} blocks of {BLOCK_BYTES >> 10} "
        f"KiB from disk, a {args.host_gib:g} GiB arena), {args.rounds} rounds in turns, "
        f"measured {time.strftime('%Y-%m-%d')} by `benchmarks/peers/restart_unmap.py`:",
        "",
        "| old arena unmapped | ms, each round | median |",
        "|---|---|---|",
    ]
    for name, values in took.items():
        each = ", ".join(f"{v:.0f}" for v in values)
        lines.append(f"| {name} | {each} | {statistics.median(values):.0f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text("# The old arena's unmapping after a restart\n\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
