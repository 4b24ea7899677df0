"""Block size benchmark: how much of a multi-user workload each block size reuses, and
what small blocks cost.

A program, not a test. Run: ``python benchmarks/block_size_bench.py [--requests 300]``.
Writes ``docs/benchmarks/block-size.md``.

Workload (seeded): users share a 512-token system prompt; each request continues an
earlier request (or starts fresh after the system prompt) and diverges from it at a
uniformly random token, then adds 64..512 new tokens. Each request does what an engine
does: ``lookup`` the prompt, ``get`` the cached prefix, ``put`` the new full blocks.

Measured per tokens-per-block (2, 4, 8, 16, 32, 64), through a real ``kvstored``
(started here, host tier only, arena path):

- reused tokens / prompt tokens (only full blocks can be reused);
- put and get throughput (GB/s, blocks/s) over the whole run;
- index memory per cached token, from an in-process store replaying the same puts
  (tracemalloc: Python heap of nodes, keys, dict entries, allocator bookkeeping).

The KV layout is small (2 layers x 8 KV heads x 64 dims x fp16 = 4 KiB per token) so
the run is about indexing and per-block overheads, not memory bandwidth.
"""

from __future__ import annotations

import argparse
import platform
import shutil
import sys
import tempfile
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvbench.harness import write_program_report
from kvbench.servers import OwnDaemon
from kvclient import KVClient
from kvstore.keys import NamespaceSpec
from kvstore.store import Store, StoreConfig

LAYOUT = dict(num_layers=2, num_kv_heads=8, head_dim=64, dtype="float16")
TOKEN_BYTES = 2 * 2 * 8 * 64 * 2  # K and V x layers x heads x dims x 2 bytes
SYSTEM_TOKENS = 512
BLOCK_SIZES = (2, 4, 8, 16, 32, 64)
OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks" / "block-size.md"


def workload(requests: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 32_000, SYSTEM_TOKENS).tolist()
    prompts: list[list[int]] = []
    for _ in range(requests):
        if prompts and rng.random() < 0.8:
            base = prompts[int(rng.integers(0, len(prompts)))]
            cut = int(rng.integers(SYSTEM_TOKENS, len(base) + 1))
            prefix = base[:cut]
        else:
            prefix = system
        tail = rng.integers(0, 32_000, int(rng.integers(64, 513))).tolist()
        prompts.append(prefix + tail)
    return prompts


@dataclass
class Result:
    block_tokens: int
    prompt_tokens: int
    reused_tokens: int
    put_bytes: int
    put_seconds: float
    put_blocks: int
    get_bytes: int
    get_seconds: float
    get_blocks: int
    heap_per_token: float


def run_one(block_tokens: int, prompts: list[list[int]], host_bytes: int) -> Result:
    daemon = OwnDaemon(Path(tempfile.mkdtemp(prefix="kvbs")), host_bytes, disk_bytes=0)
    daemon.start()
    addr = daemon.addr
    block_bytes = TOKEN_BYTES * block_tokens
    pool = np.random.default_rng(1).integers(
        0, 256, (4096 // block_tokens + 8, block_bytes), dtype=np.uint8
    )
    prompt_tokens = reused = 0
    put_b = get_b = put_n = get_n = 0
    put_s = get_s = 0.0
    try:
        with KVClient(addr, use_arena=True) as client:
            ns = client.namespace("bench", block_tokens=block_tokens, **LAYOUT)
            for tokens in prompts:
                prompt_tokens += len(tokens)
                hit = ns.lookup(tokens)
                if hit.blocks:
                    t0 = time.perf_counter()
                    got = ns.get(tokens[: hit.tokens])
                    get_s += time.perf_counter() - t0
                    get_n += got.blocks.shape[0]
                    get_b += got.blocks.nbytes
                    reused += got.tokens
                new = len(tokens) // block_tokens - hit.blocks
                if new > 0:
                    t0 = time.perf_counter()
                    ns.put(tokens, pool[:new], start=hit.blocks)
                    put_s += time.perf_counter() - t0
                    put_n += new
                    put_b += new * block_bytes
    finally:
        daemon.cleanup()
        shutil.rmtree(daemon.workdir, ignore_errors=True)
    return Result(
        block_tokens,
        prompt_tokens,
        reused,
        put_b,
        put_s,
        put_n,
        get_b,
        get_s,
        get_n,
        index_heap_per_token(block_tokens, prompts),
    )


def index_heap_per_token(block_tokens: int, prompts: list[list[int]]) -> float:
    """Replay the puts into an in-process store with 1-byte blocks; heap per cached token."""
    config = StoreConfig(host_bytes=64 << 20, shared_arena=False, max_blocks_per_request=8192)
    with Store(config) as store:
        ns = store.open_namespace(
            NamespaceSpec("m", block_tokens=block_tokens, block_bytes=64)
        ).ns_id
        blob = bytes(64)
        tracemalloc.start()
        for tokens in prompts:
            keys = store.keys_for(ns, tokens)
            store.put(ns, keys, [blob] * len(keys))
        heap = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        cached = store.stats().tiers[0].blocks * block_tokens
    return heap / max(cached, 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--sizes", default=",".join(map(str, BLOCK_SIZES)))
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    prompts = workload(args.requests)
    total = sum(len(p) for p in prompts)
    host_bytes = max(256 << 20, total * TOKEN_BYTES * 2)
    results = []
    for bt in (int(s) for s in args.sizes.split(",")):
        print(f"block_tokens={bt} ...", file=sys.stderr, flush=True)
        results.append(run_one(bt, prompts, host_bytes))
    header = (
        "| tokens/block | reused / prompt tokens | put GB/s | put blocks/s | get GB/s "
        "| get blocks/s | index heap per cached token |"
    )
    rows = [header, "|---|---|---|---|---|---|---|"]
    for r in results:
        rows.append(
            f"| {r.block_tokens} | {r.reused_tokens / r.prompt_tokens:.1%} "
            f"({r.reused_tokens:,} / {r.prompt_tokens:,}) "
            f"| {r.put_bytes / r.put_seconds / 1e9:.2f} | {r.put_blocks / r.put_seconds:,.0f} "
            f"| {r.get_bytes / max(r.get_seconds, 1e-9) / 1e9:.2f} "
            f"| {r.get_blocks / max(r.get_seconds, 1e-9):,.0f} | {r.heap_per_token:.1f} B |"
        )
    print("\n".join(rows))
    if args.no_write:
        return 0
    doc = [
        "# Block size: reuse against per-block cost",
        "",
        f"`python benchmarks/block_size_bench.py --requests {args.requests}` on "
        f"{platform.machine()}, Python {platform.python_version()}, {time.strftime('%Y-%m-%d')}, "
        "2 cores; real `kvstored` on a unix socket, arena path, host tier only.",
        "",
        f"Workload: {args.requests} requests, {total:,} prompt tokens; a shared "
        f"{SYSTEM_TOKENS}-token system prompt; 80% of requests continue an earlier one and "
        "diverge from it at a uniformly random token, then add 64..512 new tokens. KV layout "
        f"{TOKEN_BYTES // 1024} KiB per token.",
        "",
        *rows,
        "",
        "Throughput here is per request, not per byte limit: each request puts only its new",
        "64..512 tokens (0.25-2 MiB) and gets its reused prefix, and a put costs two gRPC round",
        "trips (Reserve, Commit) of ~1 ms each on this VM, so GB/s grows with block size mostly",
        "because blocks/s falls more slowly than bytes per block rises (docs/benchmarks/",
        "datapath.md has the per-call limits).",
        "",
        "## How to choose",
        "",
        "Only full blocks are reused, so a prompt that diverges from a cached one at a random",
        "token loses on average half a block: reuse falls as blocks grow (the table's first",
        "column). Small blocks cost more per byte: one key to hash, one index node and one",
        "slot per block, and one arena run per contiguous group when copying, so blocks per",
        "second matter more than GB/s below ~64 KiB per block, and index memory per cached",
        "token grows as 1/tokens-per-block. For chat and agent workloads whose prompts",
        "diverge anywhere, 8-16 tokens per block keeps nearly all of the reuse of 2-4 at a",
        "fraction of the per-block cost; for cache-augmented generation over fixed",
        "documents (prompts that diverge only after the document), 32-64 tokens per block",
        "moves the same bytes in far fewer, larger copies. Beware tiny blocks of a big model",
        "on the GPU path: every block is a separate gather/scatter unit.",
        "",
    ]
    write_program_report(str(OUT), "\n".join(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
