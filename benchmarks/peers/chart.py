"""The peer race's chart (``docs/benchmarks/peers.png``) from the two benchmarks' JSON:
later-turn mean time to first token of multi-turn chat (``benchmarks/multiturn.py
--json``) and mean TTFT under ``vllm bench serve`` at concurrency 4
(``benchmarks/serve.py --json``), per case, each bar the mean of the rounds and its
whisker the rounds' range.

    .venv/bin/python benchmarks/peers/chart.py MULTITURN.json SERVE.json docs/benchmarks/peers.png
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

MULTITURN = {  # case -> label, in the chart's order
    "alone": "vLLM alone",
    "alone_aa": "vLLM alone (A/A)",
    "lmcache": "LMCache, 256-token chunks",
    "lmcache_32": "LMCache, 32-token chunks",
    "kv_host": "kvstore, host",
    "lmcache_disk": "LMCache, fs L2 after restarts",
    "kv_disk": "kvstore, disk after restarts",
    "fit_alone": "ideal (vLLM holds all)",
}
SERVE = {
    "alone": "vLLM alone",
    "alone_aa": "vLLM alone (A/A)",
    "lmcache": "LMCache",
    "kvstore": "kvstore",
    "ideal": "ideal (vLLM holds all)",
}


def multiturn_rounds(runs: dict[str, list[list[dict[str, Any]]]]) -> dict[str, list[float]]:
    """Per case, each round's mean TTFT (ms) over the turns after the first."""
    return {
        case: [statistics.fmean(r["ttft"] * 1e3 for r in results if r["turn"] > 0)
               for results in rounds]
        for case, rounds in runs.items()
    }  # fmt: skip


def serve_rounds(runs: dict[str, list[dict[str, Any]]], concurrency: str) -> dict[str, list[float]]:
    """Per case, each round's mean TTFT (ms) at ``concurrency``."""
    return {case: [r[concurrency]["mean_ttft_ms"] for r in rounds] for case, rounds in runs.items()}


def bars(ax: Any, rounds: dict[str, list[float]], labels: dict[str, str], title: str) -> None:
    cases = [case for case in labels if rounds.get(case)]
    means = [statistics.fmean(rounds[c]) for c in cases]
    low = [m - min(rounds[c]) for m, c in zip(means, cases, strict=True)]
    high = [max(rounds[c]) - m for m, c in zip(means, cases, strict=True)]
    colors = ["#c44e52" if c.startswith(("kv", "kvstore")) else "#8c8c8c" for c in cases]
    colors = [("#4c72b0" if "lmcache" in c else col) for c, col in zip(cases, colors, strict=True)]
    ax.barh(range(len(cases)), means, xerr=[low, high], color=colors, capsize=3)
    ax.set_yticks(range(len(cases)), [labels[c] for c in cases])
    ax.invert_yaxis()
    ax.set_xlabel("mean time to first token (ms)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, axis="x", alpha=0.3)
    for i, m in enumerate(means):
        ax.text(m + high[i], i, f"  {m:,.0f}", va="center", fontsize=8)


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: chart.py MULTITURN.json SERVE.json OUT.png", file=sys.stderr)
        return 2
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    multiturn = json.loads(Path(argv[0]).read_text())["runs"]
    serve = json.loads(Path(argv[1]).read_text())
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8), dpi=110)
    bars(left, multiturn_rounds(multiturn), MULTITURN,
         "Multi-turn chat, turns 2-3 (vLLM offline engine)")  # fmt: skip
    bars(right, serve_rounds(serve, "4"), SERVE,
         "vllm bench serve, prefix_repetition, concurrency 4")  # fmt: skip
    fig.suptitle("kvstore beside LMCache and vLLM alone: SmolLM2-135M, vLLM CPU, 2 cores "
                 "(bars: mean of rounds; whiskers: their range)", fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(argv[2])
    plt.close(fig)
    print(f"wrote {argv[2]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
