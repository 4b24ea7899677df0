"""Time to first token in vLLM with kvstore's connector, against vLLM's own options.

For each prompt length, in one run of this program (a program, not a test):

- cold: an engine with no connector, a prompt it has never seen;
- vLLM prefix cache: the same engine, the same prompt again (vLLM's in-process hit);
- ExampleConnector: vLLM's own file connector (one safetensors file per layer), the
  prompt stored by one engine and loaded by a fresh one (files in the page cache);
- kvstore, unseen prompt: an engine with kvstore's connector, a prompt nobody stored
  (the connector's cost on a miss: a lookup, and storing the blocks after);
- kvstore host hit: stored by that engine, loaded by a fresh one from the host arena;
- kvstore disk hit: the same after the daemon was restarted (the blocks on disk only).

Each engine is a fresh process (``benchmarks/vllm_engine.py``) warmed up with one short
unrelated prompt; time to first token is the time of ``generate`` with one output
token. Every case runs ``--prompts`` distinct prompts per length, and the engines of a
round run in turns (no connector, ExampleConnector, kvstore), ``--rounds`` times; each
figure is the median over rounds and prompts. Threads are pinned the same way in every
engine (``VLLM_CPU_NUM_OF_RESERVED_CPU=1``: vLLM reserves one more core whenever a
connector is set). A hit loads ``(len - 1) // block_size`` blocks and computes the rest.

``--before TREE`` (another checkout of this repository, as ``benchmarks/call_cost.py``
takes it) measures a change instead: the three kvstore cases only, each checkout with
its own daemon and connector (``PYTHONPATH`` naming that checkout's packages), the two
in turns, the order reversed every other round; the report gives each side's median,
their ratio, and the spread between one checkout's rounds (the run's own noise).

    .venv/bin/python benchmarks/vllm_ttft.py                       # CPU: ~10 minutes
    .venv/bin/python benchmarks/vllm_ttft.py --before /tmp/before --lengths 2048,8192 \
        --out docs/benchmarks/vllm_before_after.md                 # a change, A/B
    .venv/bin/python benchmarks/vllm_ttft.py --model PATH --lengths 8192,16384 \\
        --out docs/benchmarks/vllm_gpu.md                          # a GPU and a real model
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kvbench.checkouts import checkout_env, in_turns, pythonpath  # noqa: E402
from kvbench.servers import OwnDaemon  # noqa: E402

ENGINE = REPO / "benchmarks" / "vllm_engine.py"
NOTES_MARK = "<!-- notes: kept when the report is generated again -->"
ABTimes = dict[str, dict[str, dict[int, list[list[float]]]]]  # side, case, length, rounds
CASES = ("cold", "vllm_hit", "example", "kv_unseen", "kv_host", "kv_disk")
LABELS = {
    "cold": "cold (no connector)",
    "vllm_hit": "vLLM prefix cache, same process",
    "example": "ExampleConnector, fresh process",
    "kv_unseen": "kvstore connector, unseen prompt",
    "kv_host": "kvstore host hit, fresh process",
    "kv_disk": "kvstore disk hit, after a daemon restart",
}


def prompt(length: int, seed: int) -> list[int]:
    """A prompt of its own: no two (length, seed) share a first block."""
    return [3 + (seed * 7_368_787 + i * 104_729 + length) % 31_000 for i in range(length)]


def engine(
    model: Path,
    workdir: Path,
    name: str,
    prompts: list[list[int]],
    connector: str = "none",
    extra: dict[str, Any] | None = None,
    tree: Path = REPO,
) -> list[float]:
    """Run one fresh engine (of checkout ``tree``) over ``prompts`` -> the seconds to
    first token of each."""
    prompts_path = workdir / f"{name}.prompts.json"
    prompts_path.write_text(json.dumps([{"tokens": p} for p in prompts]))
    out = workdir / f"{name}.out.json"
    script = tree / ENGINE.relative_to(REPO)  # the engine of that checkout
    command = [sys.executable, str(script), "run", "--model", str(model)]
    command += ["--prompts", str(prompts_path), "--out", str(out), "--warmup"]
    command += ["--connector", connector, "--extra", json.dumps(extra or {})]
    done = subprocess.run(
        command, capture_output=True, text=True, cwd=tree, env=checkout_env(tree), timeout=1800
    )
    if done.returncode != 0:
        raise RuntimeError(f"engine {name} failed:\n{(done.stdout + done.stderr)[-4000:]}")
    results = json.loads(out.read_text())
    print(f"  {name}: cached {[r['cached'] for r in results]}", flush=True)
    return [float(r["seconds"]) for r in results]


def measure(args: argparse.Namespace, workdir: Path) -> dict[str, dict[int, list[float]]]:
    times: dict[str, dict[int, list[float]]] = {c: {n: [] for n in args.lengths} for c in CASES}
    daemon = OwnDaemon(workdir / "kvstored", host_bytes=args.host_bytes, disk_bytes=4 << 30)
    daemon.workdir.mkdir(parents=True, exist_ok=True)
    daemon.start()
    kv_extra = {"addr": daemon.addr}
    example_dir = workdir / "example-store"
    example_dir.mkdir()
    example_extra = {"shared_storage_path": str(example_dir)}
    k = args.prompts
    try:
        for r in range(args.rounds):
            print(f"round {r + 1} of {args.rounds}", flush=True)
            batches = {
                case: [prompt(n, 1000 * r + 100 * i + j) for n in args.lengths for j in range(k)]
                for i, case in enumerate(("cold", "example", "kv"))
            }
            # no connector: cold prompts, then each again (vLLM's own cache)
            cold = batches["cold"]
            seconds = engine(args.model, workdir, f"none-{r}", cold + cold)
            _record(times["cold"], args.lengths, k, seconds[: len(cold)])
            _record(times["vllm_hit"], args.lengths, k, seconds[len(cold) :])
            # ExampleConnector: one engine stores, a fresh one loads
            ex = batches["example"]
            engine(args.model, workdir, f"example-store-{r}", ex, "example", example_extra)
            seconds = engine(args.model, workdir, f"example-load-{r}", ex, "example", example_extra)
            _record(times["example"], args.lengths, k, seconds)
            # kvstore: one engine stores (unseen prompts), a fresh one loads from host
            kv = batches["kv"]
            seconds = engine(args.model, workdir, f"kv-store-{r}", kv, "kvstore", kv_extra)
            _record(times["kv_unseen"], args.lengths, k, seconds)
            seconds = engine(args.model, workdir, f"kv-load-{r}", kv, "kvstore", kv_extra)
            _record(times["kv_host"], args.lengths, k, seconds)
            # after a restart the same prompts come from the disk tier
            daemon.stop()
            daemon.start()
            seconds = engine(args.model, workdir, f"kv-disk-{r}", kv, "kvstore", kv_extra)
            _record(times["kv_disk"], args.lengths, k, seconds)
    finally:
        daemon.cleanup()  # stopped, its socket directory removed
    return times


def kv_cases(
    args: argparse.Namespace,
    workdir: Path,
    daemon: OwnDaemon,
    name: str,
    prompts: list[list[int]],
    tree: Path = REPO,
) -> dict[str, list[float]]:
    """The three kvstore cases on ``prompts``: stored by one engine (unseen), loaded by
    a fresh one (host hit), and again after a daemon restart (disk hit)."""
    extra = {"addr": daemon.addr}
    seconds: dict[str, list[float]] = {}
    for case, step in (("kv_unseen", "store"), ("kv_host", "load"), ("kv_disk", "disk")):
        if case == "kv_disk":  # the blocks on disk only
            daemon.stop()
            daemon.start()
        name_of = f"{name}-{step}"
        seconds[case] = engine(args.model, workdir, name_of, prompts, "kvstore", extra, tree)
    return seconds


def measure_ab(args: argparse.Namespace, workdir: Path) -> ABTimes:
    """side -> case -> length -> each round's seconds: two checkouts in turns."""
    trees = {"before": args.before.resolve(), "after": REPO}
    ab_cases = ("kv_unseen", "kv_host", "kv_disk")
    times = {side: {c: {n: [] for n in args.lengths} for c in ab_cases} for side in trees}
    daemons = {}
    for side, tree in trees.items():
        daemon = OwnDaemon(workdir / side, host_bytes=args.host_bytes, disk_bytes=4 << 30)
        daemon.env["PYTHONPATH"] = pythonpath(tree)  # that checkout's daemon
        daemon.cwd = tree
        daemon.workdir.mkdir(parents=True, exist_ok=True)
        daemons[side] = daemon
    k = args.prompts
    try:
        for r, i, side in in_turns(args.rounds):
            print(f"round {r + 1} of {args.rounds}: {side}", flush=True)
            seed = 1000 * r + 100 * i
            prompts = [prompt(n, seed + j) for n in args.lengths for j in range(k)]
            daemon = daemons[side]
            daemon.start()
            seconds = kv_cases(args, workdir, daemon, f"{side}-{r}", prompts, trees[side])
            daemon.stop()
            for case, values in seconds.items():
                for li, length in enumerate(args.lengths):
                    times[side][case][length].append(values[li * k : (li + 1) * k])
    finally:
        for daemon in daemons.values():
            daemon.cleanup()
    return times


def report_ab(args: argparse.Namespace, times: ABTimes) -> str:
    """Each side's median, after / before, and the spread of one side's round medians."""
    lines = [
        "# vLLM time to first token through kvstore's connector: two checkouts in turns",
        "",
        f"Generated by `benchmarks/vllm_ttft.py --before` on {time.strftime('%Y-%m-%d')}: "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"{args.device_note}. Model: {args.model_note}. before = `{args.before_label}`, "
        f"after = `{args.after_label}`; {args.rounds} rounds in turns (order reversed "
        f"every other round), {args.prompts} prompts per case and length, each engine a "
        "fresh process, each checkout its own daemon and connector. Noise: the largest "
        "difference between two round medians of one checkout, relative to the smaller.",
        "",
        "| case | tokens | before | after | after / before | noise before | noise after |",
        "|---|---|---|---|---|---|---|",
    ]
    for case in times["before"]:
        for n in args.lengths:
            med = {s: statistics.median(sum(times[s][case][n], [])) for s in times}
            noise = {s: _spread([statistics.median(r) for r in times[s][case][n]]) for s in times}
            lines.append(
                f"| {LABELS[case]} | {n} | {med['before'] * 1e3:.1f} ms | "
                f"{med['after'] * 1e3:.1f} ms | {med['after'] / med['before']:.2f} | "
                f"{noise['before']:.0%} | {noise['after']:.0%} |"
            )
    lines += ["", "Raw seconds (side, case, length: one list per round):", "", "```json"]
    lines += [json.dumps(times, indent=1), "```", ""]
    return "\n".join(lines)


def _spread(values: list[float]) -> float:
    return max(values) / min(values) - 1 if len(values) > 1 else 0.0


def _record(into: dict[int, list[float]], lengths: list[int], k: int, seconds: list[float]) -> None:
    for i, length in enumerate(lengths):
        into[length].extend(seconds[i * k : (i + 1) * k])


def report(args: argparse.Namespace, times: dict[str, dict[int, list[float]]]) -> str:
    med = {c: {n: statistics.median(times[c][n]) for n in args.lengths} for c in CASES}
    lines = [
        "# Time to first token in vLLM: kvstore's connector against vLLM's own options",
        "",
        f"Generated by `benchmarks/vllm_ttft.py` on {time.strftime('%Y-%m-%d')}: "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"{args.device_note}. Model: {args.model_note}. "
        f"Median of {args.rounds} rounds x {args.prompts} prompts per case and length; "
        "each engine a fresh process, warmed up with one unrelated prompt as long as its "
        "longest, one reserved core in every engine (`VLLM_CPU_NUM_OF_RESERVED_CPU=1`).",
        "",
        "| case | " + " | ".join(f"{n} tokens" for n in args.lengths) + " |",
        "|---|" + "---|" * len(args.lengths),
    ]
    for case in CASES:
        cells = [f"{med[case][n] * 1000:.1f} ms" for n in args.lengths]
        lines.append(f"| {LABELS[case]} | " + " | ".join(cells) + " |")
    lines += ["", "## Targets", "", "| target | measured | met |", "|---|---|---|"]

    def row(target: str, measured: str, met: bool) -> None:
        lines.append(f"| {target} | {measured} | {'yes' if met else 'NO'} |")

    for n in args.lengths:
        for case in ("kv_host", "kv_disk"):
            ratio = med[case][n] / med["example"][n]
            row(
                f"{LABELS[case]} <= ExampleConnector, {n} tokens",
                f"{ratio:.2f}x ({med[case][n] * 1000:.1f} vs {med['example'][n] * 1000:.1f} ms)",
                ratio <= 1.0,
            )
    mid = 8192 if 8192 in args.lengths else args.lengths[len(args.lengths) // 2]
    ratio = med["kv_host"][mid] / med["vllm_hit"][mid]
    row(
        f"kvstore host hit <= 1.25x vLLM's in-process hit, {mid} tokens",
        f"{ratio:.2f}x",
        ratio <= 1.25,
    )
    speedup = med["cold"][mid] / med["kv_host"][mid]
    row(f"kvstore host hit >= 15x faster than cold, {mid} tokens", f"{speedup:.1f}x", speedup >= 15)
    for n in args.lengths:
        extra = med["kv_unseen"][n] / med["cold"][n] - 1
        row(
            f"an unseen prompt costs <= 3% more with the connector, {n} tokens",
            f"{extra:+.1%}",
            extra <= 0.03,
        )
    lines += [
        "",
        "Raw seconds per case and length (all rounds and prompts):",
        "",
        "```json",
        json.dumps({c: {str(n): times[c][n] for n in args.lengths} for c in CASES}, indent=1),
        "```",
        "",
    ]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="model dir (default: a tiny random Llama)")
    parser.add_argument("--lengths", default="2048,8192,16384")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=3, help="distinct prompts per case")
    parser.add_argument("--host-bytes", type=int, default=2 << 30)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks" / "vllm.md")
    parser.add_argument("--before", type=Path, help="another checkout: A/B of kvstore's cases")
    parser.add_argument("--before-label", default="before")
    parser.add_argument("--after-label", default="after")
    args = parser.parse_args(argv)
    try:
        args.lengths = [int(n) for n in args.lengths.split(",")]
    except ValueError:
        parser.error(f"--lengths must be comma-separated integers, got {args.lengths!r}")
    if args.rounds < 1 or args.prompts < 1:
        parser.error("--rounds and --prompts must be >= 1")
    with tempfile.TemporaryDirectory(prefix="vllm-ttft-") as tmp:
        workdir = Path(tmp)
        if args.model is None:
            args.model = workdir / "tiny-llama"
            subprocess.run(
                [sys.executable, str(ENGINE), "make-model", str(args.model)],
                check=True,
                capture_output=True,
            )
            args.model_note = (
                "tiny random Llama (4 layers, 2 KV heads of 64, bfloat16: 2 KiB of KV a "
                "token), vLLM's CPU backend (128-token blocks)"
            )
        else:
            args.model_note = str(args.model)
        args.device_note = _device_note()
        if args.before is not None:
            text = report_ab(args, measure_ab(args, workdir))
        else:
            text = report(args, measure(args, workdir))
    if args.out.exists() and NOTES_MARK in args.out.read_text():  # keep the notes
        text += "\n" + NOTES_MARK + args.out.read_text().split(NOTES_MARK, 1)[1]
    args.out.write_text(text)
    print(text)
    return 0


def _device_note() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return f"GPU {torch.cuda.get_device_name(0)}"
    except ImportError:
        pass
    import vllm

    return f"no GPU, vLLM {vllm.__version__} (CPU)"


if __name__ == "__main__":
    sys.exit(main())
