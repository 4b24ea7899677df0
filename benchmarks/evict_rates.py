"""Eviction and demotion through the near tiers: two checkouts in turns.

A program, not a test. Puts of 64-block prompts into a store whose host tier is full,
so that every block put makes one leave, with tiny blocks so that the tiers' own
bookkeeping is what is timed, not copies:

- ``host``: host tier only; each block put evicts one (dropped);
- ``host+disk``: write-back to a disk tier; each block put demotes one host block into
  the disk tier (written back first), and once the disk tier is full, each demotion
  evicts a disk leaf.

Each round runs ``--worker`` once per checkout (``kvbench.checkouts``), the order
reversed every other round; the table gives blocks/s, the best round of each checkout
and every round's in order, and writes ``--out``.

    .venv/bin/python benchmarks/evict_rates.py --before /tmp/before --rounds 3
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kvbench import checkouts
from kvstore.keys import NamespaceSpec
from kvstore.store import Store, StoreConfig

REPO = Path(__file__).resolve().parent.parent
TOKENS_PER_BLOCK = 16
PAYLOAD = 256  # bytes per block: the tiers' bookkeeping is what is measured
HOST_BLOCKS = 8192
DISK_BLOCKS = 2 * HOST_BLOCKS
DISK_FOOTPRINT = 8192  # what LMDB accounts one small record as: a page, and one for the key
PROMPT_BLOCKS = 64
CASES = ("host", "host+disk")


def prompts(count: int, seed: int) -> list[list[int]]:
    """``count`` prompts of PROMPT_BLOCKS blocks; groups of 16 share 8 blocks."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        shared = np.random.default_rng(i // 16).integers(0, 128_000, 8 * TOKENS_PER_BLOCK)
        own = rng.integers(0, 128_000, (PROMPT_BLOCKS - 8) * TOKENS_PER_BLOCK)
        out.append(np.concatenate([shared, own]).tolist())
    return out


def rate(case: str, directory: str) -> float:
    """Blocks/s of puts into a full host tier (see the module docstring)."""
    disk = case == "host+disk"
    config = StoreConfig(
        host_bytes=HOST_BLOCKS * PAYLOAD,
        shared_arena=False,
        max_blocks_per_request=4096,
        disk_bytes=DISK_BLOCKS * DISK_FOOTPRINT if disk else 0,
        disk_dir=directory if disk else None,
        admission="write-back",
    )
    store = Store(config)
    try:
        ns = store.open_namespace(NamespaceSpec("evict", TOKENS_PER_BLOCK, PAYLOAD)).ns_id
        blob = bytes(PAYLOAD)
        fill = HOST_BLOCKS // PROMPT_BLOCKS * (4 if disk else 2)  # past full (and disk's)
        for tokens in prompts(fill, 1):
            keys = store.keys_for(ns, tokens)
            store.put(ns, keys, [blob] * len(keys))
        stored = 0
        t0 = time.perf_counter()
        for tokens in prompts(HOST_BLOCKS // PROMPT_BLOCKS * 2, 2):
            keys = store.keys_for(ns, tokens)
            stored += store.put(ns, keys, [blob] * len(keys)).stored
        seconds = time.perf_counter() - t0
        tiers = store.stats().tiers
        assert tiers[0].evictions > 0 and (not disk or tiers[1].evictions > 0), tiers
        return stored / seconds
    finally:
        store.close()


def worker() -> dict[str, float]:
    out = {}
    for case in CASES:
        with tempfile.TemporaryDirectory(prefix="evict-rates-") as directory:
            out[case] = rate(case, directory)
    return out


def render(runs: dict[str, list[dict[str, float]]], args: argparse.Namespace) -> str:
    lines = [
        "# Eviction and demotion through the near tiers: two checkouts in turns",
        "",
        f"Measured by `benchmarks/evict_rates.py` on {time.strftime('%Y-%m-%d %H:%M')}: "
        f"before = `{args.before_label}`, after = `{args.after_label}`, {args.rounds} rounds, "
        "the order reversed every other round. Puts of 64-block prompts into a full host "
        f"tier of {HOST_BLOCKS} blocks of {PAYLOAD} B: `host`, each block put evicts one; "
        "`host+disk`, write-back, each block put demotes one into a full disk tier, which "
        "evicts one of its own leaves.",
        "",
        "Blocks put per second: the best round of each checkout, then each round's in order.",
        "",
        "| case | before | after | after / before | before, by round | after, by round |",
        "|---|---|---|---|---|---|",
    ]
    for case in CASES:
        b = [r[case] for r in runs["before"]]
        a = [r[case] for r in runs["after"]]
        lines.append(
            f"| {case} | {max(b):,.0f} | {max(a):,.0f} | {max(a) / max(b):.2f} "
            f"| {' / '.join(f'{x:,.0f}' for x in b)} | {' / '.join(f'{x:,.0f}' for x in a)} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    checkouts.add_arguments(parser, REPO)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=REPO / "docs/benchmarks/evict_rates.md")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    return checkouts.main_in_turns(parser, args, Path(__file__).resolve(), worker, [], render)


if __name__ == "__main__":
    sys.exit(main())
