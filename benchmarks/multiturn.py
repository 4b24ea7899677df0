"""Many multi-turn chats whose history no longer fits in vLLM's KV cache: vLLM alone
against vLLM + kvstore, on a real chat model (SmolLM2-135M-Instruct, :mod:`kvclient.smollm2`).

The scenario kvstore exists for: N conversations, each with a long system document of
real English text (:mod:`kvbench.chats`), served round-robin for T turns (each turn's
prompt is the whole conversation so far; greedy replies of at most ``--reply-tokens``,
shorter only where the model ends its reply). vLLM's KV
cache is sized to hold only a fraction of the conversations (``num_gpu_blocks_override``,
prefix caching on), so by the time a user comes back their history has been evicted.

Cases, each an engine process of its own, run in turns (``--rounds`` times):

- ``alone``: vLLM alone: every later turn recomputes the evicted history;
- ``kv_host``: vLLM + kvstore (a fresh daemon): history and replies from the host tier;
- ``kv_disk``: vLLM + kvstore, the daemon restarted between turns (write-through
  admission, so the restart keeps every block): history from the disk tier;
- ``fit_alone`` / ``fit_kv``: vLLM's cache holds every conversation: the connector's
  overhead where it cannot help; ``fit_alone`` is also the ideal (the best any offload
  can do);
- ``alone_aa``: vLLM alone again, the A/A control: how far two runs of one case differ;
- ``lmcache``, ``lmcache_32``: vLLM + LMCache (the peer, :mod:`kvbench.lmcache_peer`),
  its L1 as large as kvstore's host tier, chunks of 256 tokens (its default) or of 32
  (kvstore's granularity: vLLM's block);
- ``lmcache_disk``: vLLM + LMCache with an ``fs`` L2, its server restarted between
  turns (as ``kv_disk``), and the engine with it (an engine does not survive its
  LMCache server's restart): history from its disk.

Time to first token is vLLM's own (``RequestOutput.metrics.first_token_latency``). The
report gives TTFT mean / p50 / p99 per turn, total time, the cached share of each prompt
(``num_cached_tokens / prompt tokens``) and how many replies equal vLLM alone's.

    .venv/bin/python benchmarks/multiturn.py --rounds 2 --out docs/benchmarks/multiturn.md
    .venv/bin/python benchmarks/multiturn.py --conversations 4 --turns 2 --cases alone,kv_host

The first is the record (about 25 minutes on 2 cores); the second a look in a few
minutes. The report goes to ``--out`` (a scratch file by default) after every case
that ends, so a run stopped early keeps what it measured; the order of the cases turns
from round to round, so that none always runs first.

The engines are :mod:`kvbench.vllm_chat`'s (float32, 32-token blocks, one process each).
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

from kvbench.cases import chosen, in_turns
from kvbench.chats import QUESTIONS, make_chats
from kvbench.servers import OwnDaemon
from kvbench.vllm_chat import BLOCK_TOKENS, Engine

REPO = Path(__file__).resolve().parent.parent

CASES = (
    "alone", "kv_host", "kv_disk", "fit_alone", "fit_kv",
    "alone_aa", "lmcache", "lmcache_32", "lmcache_disk",
)  # fmt: skip
DEFAULT_CASES = CASES[:5]  # (the peers' need `benchmarks/peers/prepare_lmcache.py`)
LABELS = {
    "alone": "vLLM alone",
    "kv_host": "vLLM + kvstore (host tier)",
    "kv_disk": "vLLM + kvstore, daemon restarted between turns (disk tier)",
    "fit_alone": "everything fits: vLLM alone",
    "fit_kv": "everything fits: vLLM + kvstore",
    "alone_aa": "vLLM alone, again (A/A control)",
    "lmcache": "vLLM + LMCache (L1, 256-token chunks)",
    "lmcache_32": "vLLM + LMCache (L1, 32-token chunks)",
    "lmcache_disk": "vLLM + LMCache, server (and engine) restarted between turns (fs L2)",
}
GiB = 1 << 30
HOST_BYTES = 2 * GiB  # kvstore's host tier, and LMCache's L1
LMCACHE_CHUNKS = {"lmcache": 256, "lmcache_32": 32, "lmcache_disk": 256}


# -- the program ----------------------------------------------------------------------


def cache_blocks(args: argparse.Namespace, *, fits: bool) -> int:
    """vLLM's KV cache in blocks: room for every conversation at its longest, or for
    ``--cache-conversations`` of them (one more block: vLLM keeps a null block)."""
    conversations = args.conversations if fits else args.cache_conversations
    return conversations * args.max_model_len // BLOCK_TOKENS + 1


def run_case(args: argparse.Namespace, case: str, workdir: Path) -> list[dict[str, Any]]:
    workdir.mkdir(parents=True, exist_ok=True)
    daemon = None
    peer = None
    if case in ("kv_host", "kv_disk", "fit_kv"):
        extra = ["--admission", "write-through"] if case == "kv_disk" else []
        (workdir / case).mkdir()
        daemon = OwnDaemon(workdir / case, HOST_BYTES, 16 * GiB, extra_args=extra)
        daemon.start()
    if case in LMCACHE_CHUNKS:
        from kvbench.lmcache_peer import LMCacheServer

        (workdir / case).mkdir()
        l2 = workdir / case / "l2" if case == "lmcache_disk" else None
        chunk = LMCACHE_CHUNKS[case]
        peer = LMCacheServer(workdir / case / "lmcache.log", HOST_BYTES / GiB, chunk, l2)
        peer.start()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(args.model))
    chats = make_chats(tokenizer, args.conversations, args.doc_tokens)
    def start_engine() -> Engine:
        return Engine(
            args.model, workdir / "engines.log", addr=daemon.addr if daemon else None,
            extra={"codec": args.codec} if args.codec != "exact" else None,
            lmcache=peer.connector_settings() if peer else None,
            blocks=cache_blocks(args, fits=case.startswith("fit")),
            max_model_len=args.max_model_len, reply_tokens=args.reply_tokens,
            warmup=args.doc_tokens,
        )  # fmt: skip

    engine_proc = None
    try:
        engine_proc = start_engine()
        results = []
        for turn in range(args.turns):
            if case == "kv_disk" and turn > 0:
                daemon.stop()  # type: ignore[union-attr]
                daemon.start()  # type: ignore[union-attr]
            if case == "lmcache_disk" and turn > 0:
                # an engine does not survive its LMCache server's restart (its lookups
                # fail: "no GPU context", each after mq_timeout): a fresh one each turn
                engine_proc.close()
                engine_proc = None
                peer.restart()  # type: ignore[union-attr]
                engine_proc = start_engine()
            question = QUESTIONS[turn % len(QUESTIONS)]
            answers = engine_proc.reply([chat.ask(question) for chat in chats])
            for index, (chat, answer) in enumerate(zip(chats, answers, strict=True)):
                chat.answer(answer["text"])
                results.append({"chat": index, "turn": turn, **answer})
            progress(f"  {case}: turn {turn + 1} of {args.turns} done")
        return results
    finally:
        if engine_proc is not None:
            engine_proc.close()
        if daemon is not None:
            daemon.cleanup()
        if peer is not None:
            peer.stop()


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def summarise(runs: dict[str, list[list[dict[str, Any]]]], turns: int) -> dict[str, Any]:
    """Per case and turn: TTFT mean / p50 / p99 (ms) over rounds and chats, cached
    share, total seconds per round (median), replies equal to the reference's."""
    out: dict[str, Any] = {}
    reference = {case: "alone" for case in CASES}
    reference.update(fit_alone="fit_alone", fit_kv="fit_alone")
    for case, rounds in runs.items():
        row: dict[str, Any] = {"turns": [], "total_s": statistics.median(
            sum(r["seconds"] for r in results) for results in rounds)}  # fmt: skip
        for turn in range(turns):
            items = [r for results in rounds for r in results if r["turn"] == turn]
            ttft = [r["ttft"] * 1e3 for r in items]
            row["turns"].append(
                {
                    "mean": statistics.fmean(ttft),
                    "p50": statistics.median(ttft),
                    "p99": percentile(ttft, 0.99),
                    "cached": statistics.fmean(r["cached"] / r["prompt"] for r in items),
                    "prompt": statistics.fmean(r["prompt"] for r in items),
                }
            )
        every = [r["ttft"] * 1e3 for results in rounds for r in results]
        row["mean"], row["p50"] = statistics.fmean(every), statistics.median(every)
        ref_rounds = runs.get(reference[case], [])  # (a run of some cases may lack it)
        same = total = 0
        for results, ref in zip(rounds, ref_rounds, strict=False):
            for got, want in zip(results, ref, strict=True):
                total += 1
                same += got["reply"] == want["reply"]
        row["same"], row["compared"] = same, total
        # replies against the fit case's (history from vLLM's own prefix cache)
        if not case.startswith("fit") and "fit_alone" in runs:
            fit_same = sum(
                got["reply"] == want["reply"]
                for results, ref in zip(rounds, runs["fit_alone"], strict=False)
                for got, want in zip(results, ref, strict=True)
            )
            row["same_as_fit"] = fit_same
        out[case] = row
    return out


def later_mean(row: dict[str, Any]) -> float:
    later = row["turns"][1:] or row["turns"]
    return statistics.fmean(t["mean"] for t in later)


def report(args: argparse.Namespace, summary: dict[str, Any], blocks: dict[str, int]) -> str:
    peers = " and LMCache" if summary.keys() & LMCACHE_CHUNKS.keys() else ""
    lines = [
        f"# Multi-turn chat on a real model: vLLM alone vs vLLM + kvstore{peers}",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} by `benchmarks/multiturn.py` on "
        f"{platform.machine()} with {os.cpu_count()} CPUs, vLLM's CPU backend (float32), "
        f"SmolLM2-135M-Instruct (`kvclient.smollm2`). {args.conversations} conversations, "
        f"each with its own system document of ~{args.doc_tokens} tokens of license text, "
        f"served round-robin for {args.turns} turns, greedy replies of at most {args.reply_tokens} "
        f"tokens, {BLOCK_TOKENS}-token blocks, {args.rounds} round(s) of the cases in turns. "
        f"vLLM's KV cache: {blocks.get('alone', 0)} blocks "
        f"({(blocks.get('alone', 1) - 1) * BLOCK_TOKENS} tokens) in the small cases, "
        f"{blocks.get('fit_alone', 0)} when everything fits; kvstore's host arena 2 GiB.",
        "",
        "| case | turn | prompt tokens | cached share | TTFT mean ms | p50 | p99 |",
        "|---|---|---|---|---|---|---|",
    ]
    for case, row in summary.items():
        for turn, t in enumerate(row["turns"]):
            lines.append(
                f"| {LABELS[case]} | {turn + 1} | {t['prompt']:.0f} | {t['cached']:.0%} | "
                f"{t['mean']:.0f} | {t['p50']:.0f} | {t['p99']:.0f} |"
            )
    lines += ["", "| case | total s (one round) | replies equal to the reference |",
              "|---|---|---|"]  # fmt: skip
    for case, row in summary.items():
        ref = "vLLM alone" if not case.startswith("fit") else "fits: vLLM alone"
        extra = ""
        if "same_as_fit" in row:
            extra = f"; {row['same_as_fit']} of {row['compared']} equal to 'fits: vLLM alone'"
        lines.append(
            f"| {LABELS[case]} | {row['total_s']:.1f} | {row['same']} of {row['compared']} "
            f"equal to {ref}{extra} |"
        )
    lines += ["", "## Targets", ""]
    if {"alone", "kv_host", "kv_disk"} <= summary.keys():
        alone = later_mean(summary["alone"])
        host, disk = later_mean(summary["kv_host"]), later_mean(summary["kv_disk"])
        lines.append(
            f"- Turns after the first, mean TTFT: vLLM alone {alone:.0f} ms, with kvstore "
            f"{host:.0f} ms: **{alone / host:.1f}x** (target 10x); from the disk tier after "
            f"restarts {disk:.0f} ms: **{alone / disk:.1f}x** (target 5x)."
        )
    if {"fit_alone", "fit_kv"} <= summary.keys():
        fa, fk = summary["fit_alone"], summary["fit_kv"]
        lines.append(
            f"- Everything fits in vLLM's cache, TTFT with kvstore / without, mean over all "
            f"requests: {fk['mean'] / fa['mean']:.3f}x ({fk['mean']:.0f} vs {fa['mean']:.0f} "
            f"ms); median: {fk['p50'] / fa['p50']:.3f}x ({fk['p50']:.0f} vs {fa['p50']:.0f} "
            f"ms); turn 1 alone (a miss: the lookup and storing every block): "
            f"{fk['turns'][0]['mean'] / fa['turns'][0]['mean']:.3f}x (target at most 1.05x)."
        )
    lines += peer_targets(summary)
    compared = [summary[c] for c in ("kv_host", "kv_disk", "fit_kv") if c in summary]
    if compared:
        same = sum(r["same"] for r in compared)
        total = sum(r["compared"] for r in compared)
        lines.append(
            f"- Greedy replies identical to the same engine without kvstore: **{same} of "
            f"{total}** ({same / max(total, 1):.0%}; target 90%)."
        )
    lines.append("")
    return "\n".join(lines)


def peer_targets(summary: dict[str, Any]) -> list[str]:
    """The peer race's lines (#57): kvstore's later-turn mean TTFT against LMCache's
    (target at most 0.8x) and the ideal's (vLLM holding every conversation: at most
    1.1x), from host and from disk after restarts; and the A/A control's spread."""
    lines = []
    if {"alone", "alone_aa"} <= summary.keys():
        a, b = later_mean(summary["alone"]), later_mean(summary["alone_aa"])
        lines.append(
            f"- A/A control: the two vLLM-alone cases' later-turn mean TTFT differ by "
            f"{abs(a - b) / min(a, b):.0%} ({a:.0f} vs {b:.0f} ms): a smaller difference "
            "between two cases is not an effect."
        )
    for ours, peers in (("kv_host", ("lmcache", "lmcache_32")), ("kv_disk", ("lmcache_disk",))):
        if ours not in summary:
            continue
        mine = later_mean(summary[ours])
        for peer in peers:
            if peer in summary:
                theirs = later_mean(summary[peer])
                met = "met" if mine <= 0.8 * theirs else "missed"
                lines.append(
                    f"- Later turns, {LABELS[ours]} against {LABELS[peer]}: {mine:.0f} vs "
                    f"{theirs:.0f} ms, **{mine / theirs:.2f}x** (target at most 0.8x: {met})."
                )
        if "fit_alone" in summary:
            ideal = later_mean(summary["fit_alone"])
            met = "met" if mine <= 1.1 * ideal else "missed"
            lines.append(
                f"- Later turns, {LABELS[ours]} against the ideal (vLLM holding every "
                f"conversation): {mine:.0f} vs {ideal:.0f} ms, **{mine / ideal:.2f}x** "
                f"(target at most 1.1x: {met})."
            )
    peer_rows = [summary[c] for c in LMCACHE_CHUNKS if c in summary]
    if peer_rows:
        same = sum(r["same"] for r in peer_rows)
        total = sum(r["compared"] for r in peer_rows)
        lines.append(f"- LMCache's greedy replies equal to vLLM alone's: {same} of {total}.")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="a model directory (default: SmolLM2)")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--doc-tokens", type=int, default=1400)
    parser.add_argument(
        "--cache-conversations",
        type=int,
        default=2,
        help="vLLM's KV cache holds this many conversations at their longest",
    )
    parser.add_argument("--reply-tokens", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--codec", default="exact",
                        help="the kvstore cases' namespace codec (kvstore.codecs)")
    parser.add_argument(
        "--cases", default=",".join(DEFAULT_CASES), help=f"of {', '.join(CASES)}"
    )
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "multiturn.md")
    parser.add_argument("--json", type=Path, help="every result, as JSON")
    args = parser.parse_args(argv)
    if args.model is None:
        from kvclient.smollm2 import model_dir

        args.model = model_dir()
    cases = chosen(parser, args.cases, CASES)
    if set(cases) & LMCACHE_CHUNKS.keys():
        from kvbench.lmcache_peer import missing

        problem = missing()
        if problem:
            parser.error(problem)
    runs: dict[str, list[list[dict[str, Any]]]] = {case: [] for case in cases}
    blocks = {"alone": cache_blocks(args, fits=False), "fit_alone": cache_blocks(args, fits=True)}
    text = ""
    with tempfile.TemporaryDirectory(prefix="kvstore-multiturn-") as tmp:
        for round_, case in in_turns(cases, args.rounds):
            progress(f"round {round_ + 1} of {args.rounds}: {LABELS[case]}")
            runs[case].append(run_case(args, case, Path(tmp) / f"r{round_}"))
            text = write_report(args, runs, blocks)
    print(text)
    return 0


def write_report(
    args: argparse.Namespace, runs: dict[str, list[list[dict[str, Any]]]], blocks: dict[str, int]
) -> str:
    """The report of the cases run so far, to ``--out`` (and ``--json``); its text."""
    summary = summarise({case: rounds for case, rounds in runs.items() if rounds}, args.turns)
    text = report(args, summary, blocks)
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "summary": summary}))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    notes_mark = "<!-- notes: kept when the report is generated again -->"
    notes = ""
    if args.out.exists() and notes_mark in args.out.read_text():
        notes = args.out.read_text().split(notes_mark, 1)[1]
    args.out.write_text(text + "\n" + notes_mark + notes)
    return text


if __name__ == "__main__":
    sys.exit(main())
