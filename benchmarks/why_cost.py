"""What ``kvctl why`` (a Lookup with ``explain``) costs another tenant: two checkouts
in turns.

A program, not a test. One daemon with two tenants. Tenant ``a`` opens ``--namespaces``
namespaces (other models) and stores the first blocks of one long prompt (8,192
blocks of 16 tokens, the most one request may name) in each but the first; then
``--explainers`` connections of ``a`` ask, without a pause, why that prompt misses in
its first namespace (each explain hashes the prompt and looks in every other
namespace). Tenant ``b`` meanwhile puts and gets one new 4 KiB block at a time, as an
engine would: the figure is its put+get median, alone and while the explains run,
and their ratio (the target: at most 2). Explains refused (RESOURCE_EXHAUSTED) and
answered are counted, with the median time of an answered one.

Each round runs ``--worker`` once per checkout (``kvbench.checkouts``), the order
reversed every other round; the report gives every round's figures and writes
``--out``.

    .venv/bin/python benchmarks/why_cost.py --before /tmp/before --rounds 2
"""

from __future__ import annotations

import argparse
import multiprocessing
import secrets
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from kvbench import checkouts
from kvbench.servers import OwnDaemon, write_secret
from kvclient import KVClient
from kvclient.errors import KVStoreError, OutOfSpaceError

REPO = Path(__file__).resolve().parent.parent
BLOCK_TOKENS = 16
BLOCK_BYTES = 4096
PROMPT_BLOCKS = 8192  # max_blocks_per_request's default
STORED_BLOCKS = 4  # of the prompt, in each other namespace
TARGET = 2.0  # the victim's median under explains / alone


def victim_p50(ns: Any, seconds: float, first: int) -> tuple[float, int]:
    """Put then get one new block, again and again for ``seconds`` -> (median ms, calls)."""
    times: list[float] = []
    end = time.monotonic() + seconds
    i = first
    while time.monotonic() < end:
        prompt = [i * BLOCK_TOKENS + j for j in range(BLOCK_TOKENS)]
        start = time.perf_counter()
        ns.put(prompt, [bytes(BLOCK_BYTES)])
        got = ns.get(prompt)
        times.append(time.perf_counter() - start)
        assert got.n_blocks == 1, got
        i += 1
    return statistics.median(times) * 1000, len(times)


def explainers(
    addr: str, token: str, ns_id: str, n: int, stop: Any, answers: Any
) -> None:
    """``n`` connections asking why the long prompt misses in ``ns_id`` until ``stop``;
    puts "started", then (answer times, refusals, other errors) on ``answers``."""
    prompt = list(range(PROMPT_BLOCKS * BLOCK_TOKENS))
    answered: list[float] = []
    refused = [0]
    other: list[str] = []
    clients = [KVClient(addr, token=token) for _ in range(n)]

    def ask(client: KVClient) -> None:
        ns = client.open_namespace(ns_id)
        while not stop.is_set():
            start = time.perf_counter()
            try:
                ns.why(prompt)
            except OutOfSpaceError:  # RESOURCE_EXHAUSTED: refused, at once
                refused[0] += 1
                time.sleep(0.001)
                continue
            except KVStoreError as exc:
                other.append(f"{type(exc).__name__}: {exc}")
                return
            answered.append(time.perf_counter() - start)

    threads = [threading.Thread(target=ask, args=(c,)) for c in clients]
    for thread in threads:
        thread.start()
    answers.put("started")
    for thread in threads:
        thread.join()
    for client in clients:
        client.close()
    answers.put((answered, refused[0], other))


def worker(namespaces: int, explainers_n: int, seconds: float) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="why-cost"))
    tokens = {who: secrets.token_hex(16) for who in "ab"}
    for who, token in tokens.items():
        write_secret(work / f"{who}.token", token)
    config = work / "kvstored.toml"
    config.write_text(
        "".join(f'[tenants.{w}]\ntoken_file = "{work / f"{w}.token"}"\n' for w in "ab")
    )
    daemon = OwnDaemon(work, 256 << 20, 0, extra_args=["--config", str(config)],
                       client_options={"token": tokens["a"]})  # fmt: skip
    daemon.start()
    prompt = list(range(PROMPT_BLOCKS * BLOCK_TOKENS))
    answered: list[float] = []
    refused, other = 0, []
    try:
        with KVClient(daemon.addr, token=tokens["a"]) as a, \
                KVClient(daemon.addr, token=tokens["b"]) as b:  # fmt: skip
            spaces = [a.namespace(f"why-{i}", BLOCK_TOKENS, BLOCK_BYTES) for i in range(namespaces)]
            stored = prompt[: STORED_BLOCKS * BLOCK_TOKENS]
            for ns in spaces[1:]:
                ns.put(stored, [bytes(BLOCK_BYTES)] * STORED_BLOCKS)
            victim = b.namespace("victim", BLOCK_TOKENS, BLOCK_BYTES)
            victim_p50(victim, 0.5, 10**6)  # warm up
            alone, alone_calls = victim_p50(victim, seconds, 0)
            # the explainers run in a process of their own: in this one they would
            # take the GIL from the victim's client, not the daemon's from its calls
            spawn = multiprocessing.get_context("spawn")
            stop, answers = spawn.Event(), spawn.Queue()
            asker = spawn.Process(
                target=explainers,
                args=(daemon.addr, tokens["a"], spaces[0].ns_id, explainers_n, stop, answers),
            )
            asker.start()
            ready = answers.get(timeout=120)  # every explainer connected
            assert ready == "started", ready
            time.sleep(1.0)  # every explainer under way
            busy, busy_calls = victim_p50(victim, seconds, 10**5)
            stop.set()
            answered, refused, other = answers.get(timeout=300)
            asker.join(60)
    finally:
        daemon.cleanup()
    return {
        "alone_ms": alone,
        "alone_calls": alone_calls,
        "busy_ms": busy,
        "busy_calls": busy_calls,
        "ratio": busy / alone,
        "answered": len(answered),
        "explain_ms": statistics.median(answered) * 1000 if answered else None,
        "refused": refused,
        "errors": other[:3],
    }


def render(runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> str:
    labels = {"before": args.before_label, "after": args.after_label}
    lines = [
        "# What `why` costs another tenant",
        "",
        f"`benchmarks/why_cost.py --rounds {args.rounds} --namespaces {args.namespaces} "
        f"--explainers {args.explainers} --seconds {args.seconds}`: tenant `a` has "
        f"{args.namespaces} namespaces and {args.explainers} connections asking why a "
        f"{PROMPT_BLOCKS}-block prompt misses, without a pause; tenant `b` puts and gets "
        f"one {BLOCK_BYTES // 1024} KiB block at a time. Median of `b`'s put+get alone "
        f"and under the explains (target: ratio <= {TARGET}).",
        "",
        "| checkout | round | b alone ms | b under explains ms | ratio | explains answered "
        "| explain median ms | refused |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for side in ("before", "after"):
        for r, run in enumerate(runs[side]):
            ms = run["explain_ms"]
            lines.append(
                f"| {labels[side]} | {r + 1} | {run['alone_ms']:.2f} | {run['busy_ms']:.2f} "
                f"| {run['ratio']:.1f} | {run['answered']} "
                f"| {'-' if ms is None else f'{ms:.0f}'} | {run['refused']} |"
            )
            if run["errors"]:
                lines.append(f"| | | errors: {'; '.join(run['errors'])} | | | | | |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    checkouts.add_arguments(parser, REPO)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--namespaces", type=int, default=64)
    parser.add_argument("--explainers", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=REPO / "docs/benchmarks/why-cost.md")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.namespaces < 2 or args.explainers < 1 or args.seconds <= 0:
        parser.error("--rounds, --explainers and --seconds must be positive, --namespaces >= 2")
    worker_args = ["--namespaces", str(args.namespaces), "--explainers", str(args.explainers),
                   "--seconds", str(args.seconds)]  # fmt: skip
    return checkouts.main_in_turns(
        parser, args, Path(__file__).resolve(),
        lambda: worker(args.namespaces, args.explainers, args.seconds), worker_args, render,
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
