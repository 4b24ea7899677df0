"""What one small client call costs, in two checkouts, in turns: a change's per-call
before/after, where ``kvctl bench``'s cases are too large to show it.

A program, not a test. Like ``benchmarks/before_after.py``, ``--before`` is another
checkout of this repository (``git worktree add /tmp/before <commit>``, with the built
``kvstore/_streamcopy*.so`` copied in); ``--after`` defaults to this one. Each round
runs this program's ``--worker`` once per checkout (``PYTHONPATH`` naming that
checkout's packages), the order reversed every other round. A worker starts its own
kvstored, stores one chain of 16 blocks of 256 KiB, and times, after a warm-up:

- ``get``: a get of that chain from known slots (no call: the client's own Python);
- ``miss``: a get of a chain that is not stored (one Acquire over local calls);
- ``acquire``: an Acquire of the chain and the release of its lease (one call);
- ``lookup``: a Lookup of the chain (one call).

Per op: wall and CPU time of the client process per call (CPU counts all its
threads), the best of the rounds, and each round's, in the order they ran.

    .venv/bin/python benchmarks/call_cost.py --before /tmp/before --rounds 3
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvbench import checkouts

REPO = Path(__file__).resolve().parent.parent
OPS = ("get", "miss", "acquire", "lookup")
BLOCK_TOKENS, BLOCK_BYTES, BLOCKS = 2, 256 * 1024, 16


def worker(calls: int) -> dict[str, tuple[float, float]]:
    """Time each op in this process (this checkout's packages): op -> (wall us, CPU us)."""
    import numpy as np

    from kvclient import KVClient

    with tempfile.TemporaryDirectory(prefix="kvcallcost-") as work:
        addr = f"unix://{work}/kvstored.sock"
        daemon = subprocess.Popen(
            [sys.executable, "-m", "kvstored", "--listen", addr, "--host_bytes", "256MiB",
             "--disk_bytes", "0", "--metrics_listen", "off", "--disk_dir", work,
             "--arena_dir", work],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            with KVClient(addr, timeout=30) as client:
                deadline = time.monotonic() + 60
                while True:
                    try:
                        client.server_info()
                        break
                    except Exception:
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.05)
                ns = client.namespace("call-cost", BLOCK_TOKENS, BLOCK_BYTES)
                tokens = np.arange(BLOCK_TOKENS * BLOCKS, dtype=np.int64)
                other = tokens + 10**6
                ns.put(tokens, np.ones((BLOCKS, BLOCK_BYTES), np.uint8))
                out = np.empty((BLOCKS, BLOCK_BYTES), np.uint8)
                ops: dict[str, Callable[[], object]] = {
                    "get": lambda: ns.get(tokens, out=out),
                    "miss": lambda: ns.get(other, out=out),
                    "acquire": lambda: ns.acquire(tokens).release(),
                    "lookup": lambda: ns.lookup(tokens),
                }
                return {name: _timed(ops[name], calls) for name in OPS}
        finally:
            daemon.terminate()
            daemon.wait()


def _timed(call: Callable[[], object], calls: int) -> tuple[float, float]:
    for _ in range(calls // 10):
        call()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        call()
    return (
        (time.perf_counter() - wall) / calls * 1e6,
        (time.process_time() - cpu) / calls * 1e6,
    )


def render(runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> str:
    lines = [
        "# Per-call cost of the client: two checkouts in turns",
        "",
        f"Measured by `benchmarks/call_cost.py` on {time.strftime('%Y-%m-%d %H:%M')}: "
        f"before = `{args.before_label}`, after = `{args.after_label}`, {args.rounds} "
        f"rounds of {args.calls} calls per op, the order reversed every other round.",
        "",
        "- ops: a chain of 16 blocks of 256 KiB over local calls; `get` from known slots "
        "(no call), `miss` (one Acquire), `acquire` + release (one call), `lookup` (one "
        "call)",
        "- us per call: wall, and CPU of the client process (all its threads); best of "
        "the rounds, then each round's in the order they ran",
        "",
        "| op | before wall | after wall | after / before | before CPU | after CPU "
        "| before wall, by round | after wall, by round |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for op in OPS:
        walls = {side: [run[op][0] for run in runs[side]] for side in runs}
        cpus = {side: [run[op][1] for run in runs[side]] for side in runs}
        b, a = min(walls["before"]), min(walls["after"])
        lines.append(
            f"| {op} | {b:.0f} | {a:.0f} | {a / b:.2f} | {min(cpus['before']):.0f} "
            f"| {min(cpus['after']):.0f} | {' / '.join(f'{x:.0f}' for x in walls['before'])} "
            f"| {' / '.join(f'{x:.0f}' for x in walls['after'])} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    checkouts.add_arguments(parser, REPO)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--out", default="docs/benchmarks/call_cost.md")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.calls)))
        return 0
    if args.before is None:
        parser.error("--before is required")
    runs = checkouts.workers_in_turns(
        Path(__file__).resolve(), args, ["--calls", str(args.calls)]
    )
    text = render(runs, args)
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
