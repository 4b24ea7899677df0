"""kvstore's vLLM secondary tier beside vLLM's own ``fs`` tier, through vLLM's tier
interface, on the same chunks.

A program, not a test. Each run builds an engine's scheduler side with vLLM's tiering
spec (``kvbench.tiering``: its CPU primary tier, the secondary tier its factory makes)
and, on ``--chunks`` chunks of ``--chunk-kib`` KiB (new keys each run, bytes a function
of the key), measures what vLLM waits for:

- store: every chunk cascaded from the primary tier, in jobs of ``--job-chunks``, all
  submitted at once, until ``get_finished_jobs`` says done (the primary slots free);
- lookup: one request's lookups of every chunk, step after step, until none is RETRY;
- load: every chunk promoted into other primary slots (the bytes checked);
- second process: another engine (a process of its own, vLLM imported before the
  clock starts) looks the chunks up and loads them: its hits, times and check.

kvstore's tier talks to one kvstored (host tier only); vLLM's ``fs`` tier writes under
the work directory, with vLLM's default threads. The cases run in turns, each twice a
round (an A/A pair: kvstore then kvstore, fs then fs, the order reversed every other
round), so the spread between two runs of one tier shows what the machine's noise is
worth beside the difference between the tiers. Writes ``--out`` (markdown) and its
``.json`` twin.

    nice -n 10 .venv/bin/python benchmarks/secondary_tier.py --rounds 2
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvbench.report import machine_line, write_page
from kvbench.servers import OwnDaemon

REPO = Path(__file__).resolve().parent.parent
SYSTEMS = ("kvstore", "fs")
MiB = 1 << 20


def keys_for(run: str, n: int) -> list[bytes]:
    """vLLM's keys (a 32-byte block hash and group 0) of ``n`` chunks of run ``run``."""
    from vllm.v1.kv_offload.base import make_offload_key

    return [make_offload_key(hashlib.sha256(f"{run}/{i}".encode()).digest(), 0) for i in range(n)]


def fill(rows: np.ndarray, keys: list[bytes]) -> None:
    """Each chunk's bytes, a function of its key (any process can check them)."""
    for row, key in zip(rows, keys, strict=True):
        row[:] = np.frombuffer(np.random.default_rng(list(key[:16])).bytes(rows.shape[1]), np.uint8)


def matches(rows: np.ndarray, keys: list[bytes]) -> bool:
    expected = np.empty_like(rows)
    fill(expected, keys)
    return bool(np.array_equal(rows, expected))


def tier_config(system: str, target: str) -> dict[str, Any]:
    """The ``secondary_tiers`` entry of ``system``: kvstore at address ``target``, or
    vLLM's fs tier under directory ``target``."""
    if system == "kvstore":
        from kvbench.tiering import KVSTORE_TIER

        return {"type": "kvstore", "module_path": KVSTORE_TIER, "addr": target}
    return {"type": "fs", "root_dir": target}


def timed_jobs(engine: Any, keys: list[bytes], first_row: int, job_chunks: int,
               promotion: bool) -> tuple[float, bool]:  # fmt: skip
    """Submit jobs of ``job_chunks`` chunks over rows ``first_row..`` -> (seconds until
    all are done, whether all succeeded)."""
    from kvbench.tiering import finish_jobs, transfer_job

    started = time.perf_counter()
    ids = []
    for at in range(0, len(keys), job_chunks):
        part = keys[at : at + job_chunks]
        job = transfer_job(part, range(first_row + at, first_row + at + len(part)), promotion)
        (engine.tier.submit_load if promotion else engine.tier.submit_store)(job)
        ids.append(job.job_id)
    results = finish_jobs(engine.tier, ids, timeout=600)
    return time.perf_counter() - started, all(r.success for r in results.values())


def timed_lookups(engine: Any, keys: list[bytes]) -> tuple[float, int]:
    """(seconds until one request's lookups of ``keys`` are all answered, hits)."""
    from vllm.v1.kv_offload.base import LookupResult

    from kvbench.tiering import lookup_all

    started = time.perf_counter()
    results = lookup_all(engine.tier, keys, timeout=600)
    return time.perf_counter() - started, results.count(LookupResult.HIT)


def second_engine(spec: dict[str, Any]) -> dict[str, Any]:
    """The other process: an engine of its own looks the chunks up and loads them."""
    from kvbench.tiering import TierEngine

    keys = keys_for(spec["run"], spec["chunks"])
    engine = TierEngine(spec["tier"], spec["chunk_bytes"], len(keys))
    try:
        lookup_s, hits = timed_lookups(engine, keys)
        load_s, ok = timed_jobs(engine, keys, 0, spec["job_chunks"], promotion=True)
        checked = ok and matches(engine.rows[: len(keys)], keys)
    finally:
        engine.close()
    return {"lookup_s": lookup_s, "hits": hits, "load_s": load_s, "load_ok": checked}


def run_case(system: str, target: str, run: str, args: argparse.Namespace) -> dict[str, Any]:
    """One run of ``system``'s tier (see the module docstring) -> its figures."""
    from kvbench.tiering import TierEngine

    chunk_bytes, n = args.chunk_kib << 10, args.chunks
    keys = keys_for(run, n)
    tier = tier_config(system, target)
    engine = TierEngine(tier, chunk_bytes, 2 * n)
    try:
        fill(engine.rows[:n], keys)
        store_s, stored = timed_jobs(engine, keys, 0, args.job_chunks, promotion=False)
        lookup_s, hits = timed_lookups(engine, keys)
        engine.rows[n:] = 0
        load_s, loaded = timed_jobs(engine, keys, n, args.job_chunks, promotion=True)
        loaded = loaded and matches(engine.rows[n:], keys)
    finally:
        engine.close()
    spec = {"run": run, "chunks": n, "chunk_bytes": chunk_bytes, "tier": tier,
            "job_chunks": args.job_chunks}  # fmt: skip
    done = subprocess.run(
        [sys.executable, __file__, "--second", json.dumps(spec)],
        check=True, capture_output=True, text=True, cwd=REPO,
    )  # fmt: skip
    second = json.loads(done.stdout.splitlines()[-1])
    gb = n * chunk_bytes / 1e9
    return {
        "system": system, "run": run, "stored": stored, "store_gbps": gb / store_s,
        "lookup_ms": lookup_s * 1e3, "lookup_us_per_chunk": lookup_s / n * 1e6, "hits": hits,
        "loaded": loaded, "load_gbps": gb / load_s,
        "second_hits": second["hits"], "second_lookup_ms": second["lookup_s"] * 1e3,
        "second_load_gbps": gb / second["load_s"], "second_loaded": second["load_ok"],
    }  # fmt: skip


def in_turns(rounds: int) -> list[tuple[int, str]]:
    """(round, system) in the order the runs go: each system twice in a row (the A/A
    pair), the systems' order reversed every other round."""
    order = []
    for r in range(rounds):
        for system in SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]:
            order += [(r, system), (r, system)]
    return order


def filesystem(path: Path) -> str:
    """The type of the file system holding ``path`` (from /proc/mounts)."""
    best, kind = "", "unknown"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            _, mount, fstype = line.split()[:3]
            if str(path).startswith(mount) and len(mount) > len(best):
                best, kind = mount, fstype
    except OSError:
        pass
    return kind


def spread(values: list[float]) -> str:
    """``median (min..max)`` of a column."""
    return f"{statistics.median(values):.2f} ({min(values):.2f}..{max(values):.2f})"


def render(runs: list[dict[str, Any]], args: argparse.Namespace, fs_kind: str) -> list[str]:
    import vllm
    from vllm.v1.kv_offload.tiering.fs import manager as fs_manager

    gib = args.chunks * args.chunk_kib / 1024 / 1024
    lines = [
        "# kvstore's vLLM secondary tier beside vLLM's fs tier",
        "",
        f"`benchmarks/secondary_tier.py`: vLLM {vllm.__version__}'s tiering offloading "
        f"built without an engine (`kvbench.tiering`), one secondary tier each: kvstore's "
        f"(`{{\"type\": \"kvstore\", \"module_path\": "
        f"\"kvclient.integrations.vllm.secondary_tier\"}}`, one kvstored, host tier) or "
        f"vLLM's `fs` (root on {fs_kind}, {'C' if fs_manager._HAS_BATCH_LOOKUP_C else 'Python'}"
        f" batch lookup, 16 read and 16 write threads). Each run: {args.chunks} new chunks of "
        f"{args.chunk_kib} KiB ({gib:.2f} GiB), jobs of {args.job_chunks} chunks submitted at "
        "once; store and load until `get_finished_jobs` says done, one request's lookups "
        "of every chunk until none is RETRY (polled each millisecond, as steps would), then "
        "a second process (another engine) looks them up and loads them. Runs in turns, "
        "each tier twice a round (A/A), the order reversed every other round.",
        "",
        f"Machine: {machine_line()}.",
        "",
        "| round | tier | store GB/s | lookup ms (µs a chunk) | load GB/s | 2nd process: "
        "hits, lookup ms, load GB/s | checked |",
        "|---|---|---|---|---|---|---|",
    ]
    for r, run in zip((r for r, _ in in_turns(args.rounds)), runs, strict=True):
        ok = run["stored"] and run["loaded"] and run["second_loaded"]
        lines.append(
            f"| {r + 1} | {run['system']} | {run['store_gbps']:.2f} | {run['lookup_ms']:.1f} "
            f"({run['lookup_us_per_chunk']:.0f}) | {run['load_gbps']:.2f} | "
            f"{run['second_hits']}/{args.chunks}, {run['second_lookup_ms']:.1f}, "
            f"{run['second_load_gbps']:.2f} | {'yes' if ok else 'NO'} |"
        )
    lines += ["", "Median (lowest..highest) of each tier's runs:", "",
              "| tier | store GB/s | lookup µs a chunk | load GB/s | 2nd process load GB/s |",
              "|---|---|---|---|---|"]  # fmt: skip
    for system in SYSTEMS:
        mine = [run for run in runs if run["system"] == system]
        lines.append(
            f"| {system} | {spread([m['store_gbps'] for m in mine])} "
            f"| {spread([m['lookup_us_per_chunk'] for m in mine])} "
            f"| {spread([m['load_gbps'] for m in mine])} "
            f"| {spread([m['second_load_gbps'] for m in mine])} |"
        )
    return lines + ["", *NOTES]


NOTES = [
    "How each tier works, for reading the figures: vLLM hands a secondary tier chunks "
    "without their prefix, so kvstore's tier keeps each chunk as a chain of one block "
    "and asks about a step's chunks in one LookupBatch (one call per "
    "max_blocks_per_request chunks, 8192 by default), then makes one call per chunk "
    "for the bytes: a `put_nowait` each (the bytes copied into an arena slot, the commit "
    "not waited for), a `get` each (the bytes copied from the arena into the primary "
    "slot). vLLM's `fs` tier checks a batch of files in one C call and reads and writes "
    "with 16 threads each. The second process's figures include its first call's "
    "connection, arena mapping and namespace.",
    "",
    "Before lookups were batched (a Lookup a chunk, commit d7eb6c5, same sizes, same "
    "machine): kvstore's lookup 221.54 µs a chunk (180.90..304.52) beside fs's 13.17.",
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--chunks", type=int, default=256)
    parser.add_argument("--chunk-kib", type=int, default=512)
    parser.add_argument("--job-chunks", type=int, default=32)
    parser.add_argument("--second", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=REPO / "docs/benchmarks/secondary_tier.md")
    args = parser.parse_args(argv)
    if args.second:
        print(json.dumps(second_engine(json.loads(args.second))))
        return 0
    if min(args.rounds, args.chunks, args.chunk_kib, args.job_chunks) < 1:
        parser.error("--rounds, --chunks, --chunk-kib and --job-chunks must be >= 1")
    work = Path(tempfile.mkdtemp(prefix="tier-bench", dir=os.environ.get("TMPDIR")))
    # the daemon's host tier holds every run's chunks (no disk tier: both tiers' stores
    # end in memory or the page cache, fs's files aside)
    runs_bytes = len(in_turns(args.rounds)) * args.chunks * (args.chunk_kib << 10)
    daemon = OwnDaemon(work, runs_bytes + 256 * MiB, 0)
    daemon.start()
    runs = []
    try:
        for i, (r, system) in enumerate(in_turns(args.rounds)):
            print(f"round {r + 1} of {args.rounds}: {system}", flush=True)
            root = work / f"fs-{i}"
            target = daemon.addr if system == "kvstore" else str(root)
            runs.append(run_case(system, target, f"{system}-{i}-{time.time_ns()}", args))
            shutil.rmtree(root, ignore_errors=True)
        lines = render(runs, args, filesystem(work))
    finally:
        daemon.cleanup()
        shutil.rmtree(work, ignore_errors=True)
    write_page(args.out, lines)
    args.out.with_suffix(".json").write_text(json.dumps(
        {"args": {k: v for k, v in vars(args).items() if k != "out"} | {"out": str(args.out)},
         "machine": machine_line(), "runs": runs}, indent=1,
    ) + "\n")  # fmt: skip
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
