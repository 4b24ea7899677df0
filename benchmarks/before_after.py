"""``kvctl bench`` of two checkouts, in turns, on one machine: a change's before/after.

A program, not a test. ``--before`` is another checkout of this repository (for
instance ``git worktree add /tmp/before <commit>``; copy the built
``kvstore/_streamcopy*.so`` into it); ``--after`` defaults to this one. Each round runs
``python -m kvbench`` once per checkout (its own daemon, client and harness, with
``PYTHONPATH`` naming that checkout's packages), the order reversed every other round,
so that the host's drift hits both alike. Per kvstore case (op, path, tier, layout,
batch) the best GB/s over the rounds is kept (blocks/s for lookups), and the table
gives after / before; the spread of the memcpy baseline between the runs is the noise
to read it against.

    .venv/bin/python benchmarks/before_after.py --before /tmp/before --rounds 2 \\
        -- --layouts llama2 llama8 --batches 1 16 --no-disk --no-redis
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvbench import checkouts
from kvbench.checkouts import checkout_env

REPO = Path(__file__).resolve().parent.parent
Case = tuple[str, str, str, str, int]  # op, path, tier, layout, batch


def run_bench(tree: Path, bench_args: list[str], out: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "kvbench", *bench_args, "--json", str(out)]
    subprocess.run(cmd, cwd=tree, env=checkout_env(tree), check=True, stdout=subprocess.DEVNULL)
    data: dict[str, Any] = json.loads(out.read_text())
    return data


def by_round(runs: list[dict[str, Any]], system: str) -> dict[Case, list[float]]:
    """Per case, its rate in each run, in the order of the runs (GB/s, or blocks/s
    where no bytes move)."""
    rates: dict[Case, list[float]] = {}
    for run in runs:
        for r in run["results"]:
            if r["system"] != system or r["note"].startswith("only"):
                continue
            case = (r["op"], r["path"], r["tier"], r["layout"], r["batch"])
            rates.setdefault(case, []).append(r["gbps"] or r["blocks_per_s"])
    return rates


def render(
    before: list[dict[str, Any]], after: list[dict[str, Any]], args: argparse.Namespace
) -> str:
    b_rounds, a_rounds = by_round(before, "kvstore"), by_round(after, "kvstore")
    b = {case: max(rates) for case, rates in b_rounds.items()}
    a = {case: max(rates) for case, rates in a_rounds.items()}
    memcpy = [
        r["gbps"] for run in before + after for r in run["results"] if r["system"] == "memcpy"
    ]
    lines = [
        "# Before / after: `kvctl bench` of two checkouts in turns",
        "",
        f"Measured by `benchmarks/before_after.py` on {time.strftime('%Y-%m-%d %H:%M')}: "
        f"before = `{args.before_label}`, after = `{args.after_label}`, {args.rounds} "
        f"rounds, the order reversed every other round; bench arguments "
        f"`{' '.join(args.bench_args)}`.",
        "",
        f"- machine: {after[-1]['machine']}",
        "- each row: the best pass of each checkout over the rounds, and each round's in "
        "the order they ran; GB/s of block bytes (blocks/s for lookups); after / before "
        "above 1 is faster",
        f"- noise: one-thread memcpy of the same cases ranged {min(memcpy):.2f} to "
        f"{max(memcpy):.2f} GB/s over the runs"
        if memcpy
        else "- noise: no memcpy rows",
        "",
        "| op | path | tier | layout | batch | before | after | after / before "
        "| before, by round | after, by round |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for case in sorted(set(b) & set(a)):
        op, path, tier, layout, batch = case
        unit = "GB/s" if op not in ("lookup", "miss") else "blocks/s"
        fmt = "{:.2f}" if unit == "GB/s" else "{:,.0f}"
        rounds = [" / ".join(fmt.format(x) for x in side[case]) for side in (b_rounds, a_rounds)]
        lines.append(
            f"| {op} | {path} | {tier} | {layout} | {batch} | {fmt.format(b[case])} "
            f"| {fmt.format(a[case])} | {a[case] / b[case]:.2f} | {rounds[0]} | {rounds[1]} |"
        )
    ratios = [a[c] / b[c] for c in set(a) & set(b) if b[c]]
    if ratios:
        lines += ["", f"Cases: {len(ratios)}; after / before from {min(ratios):.2f} to "
                  f"{max(ratios):.2f}, median {sorted(ratios)[len(ratios) // 2]:.2f}."]  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    checkouts.add_arguments(parser, REPO)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="docs/benchmarks/before_after.md")
    parser.add_argument("bench_args", nargs="*", help="after --: arguments of kvctl bench")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.before is None:
        parser.error("--before is required")
    runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    with tempfile.TemporaryDirectory(prefix="kvbeforeafter-") as tmp:
        for r, _, side in checkouts.in_turns(args.rounds):
            print(f"round {r + 1}: {side}", flush=True)
            out = Path(tmp) / f"{side}-{r}.json"
            runs[side].append(run_bench(trees[side], args.bench_args, out))
    text = render(runs["before"], runs["after"], args)
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
