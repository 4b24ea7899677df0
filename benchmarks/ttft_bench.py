"""Time to first token with and without kvstore prefix reuse (HF transformers). A program.

For each prompt length it measures, on a Llama with seeded random weights:

- prefill: the plain model on the whole prompt (no kvstore at all);
- miss: the adapter's first call (lookup miss, full prefill); the put of the prompt's
  blocks that follows is timed apart (it is not on the path to the first token);
- host hit: the same prompt again, its prefix served from the daemon's host arena
  (best of ``--repeat``: the machine may be shared); on CUDA the adapter copies
  straight from the pinned arena slots into the cache's tensors, layer by layer while
  the model runs (the default), and the same hit is also timed with the whole prefix
  loaded before the model runs (``stream_layers=False``, the path before) and through
  host memory (``direct_copies=False``: the bytes path a remote daemon takes), all in
  turns; on CPU the path before is the bytes path (``stream_layers=False``);
- disk hit: the same prompt after the daemon was restarted (SIGTERM persists the host
  tier to LMDB) and LMDB's data file was dropped from the page cache, so the prefix is
  read from disk (best of ``--disk-repeat`` restarts); then the disk's own rate on the
  same file, cold: parallel reads of LMDB's data file after dropping it from the page
  cache (``--disk-threads`` readers), the floor of any disk hit.

A hit reuses ``(len - 1) // block_tokens`` blocks and computes the rest (at least one
token: the model must produce the last position's logits). Each length uses its own
random prompt, so no two lengths share blocks. The program starts its own ``kvstored``
in a temp dir (host arena in /dev/shm when it has room) and stops it at the end. It
writes a markdown report with a table and a PNG plot (matplotlib).

    .venv/bin/python benchmarks/ttft_bench.py --threads 1           # CPU: 5-8 minutes
    .venv/bin/python benchmarks/ttft_bench.py --device cuda --preset llama3-8b \\
        --out docs/benchmarks/ttft_gpu.md                             # H100 / H200
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvbench.cuda_copy import copy_gbs  # noqa: E402
from kvbench.disk_floor import disk_read_gbs, drop_disk_cache  # noqa: E402
from kvbench.models import LLAMA_PRESETS, random_llama  # noqa: E402
from kvbench.servers import OwnDaemon  # noqa: E402
from kvclient import KVClient  # noqa: E402
from kvclient.hf import HFPrefixCache  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CPU_LENGTHS = [512, 1024, 2048, 4096, 8192]
GPU_LENGTHS = [8192, 16384, 32768]
GPU_COMMAND = (
    ".venv/bin/python benchmarks/ttft_bench.py --device cuda --preset llama3-8b "
    "--dtype bfloat16 --lengths 8192,16384,32768 --out docs/benchmarks/ttft_gpu.md"
)


@dataclass
class Row:
    length: int
    prefix_bytes: int
    computed_on_hit: int
    prefill_s: float
    miss_s: float
    put_s: float
    host_s: float
    host_load_s: float
    via_host_s: float = float("nan")  # CUDA: the host hit through host memory
    via_host_load_s: float = float("nan")
    again_s: float = float("nan")  # the host hit again, a second instance: the A/A pair
    other_s: float = float("nan")  # the path before layer-wise loading, timed in turns
    other_load_s: float = float("nan")
    compute_s: float = float("nan")  # the hit's own compute: the whole load's TTFT - load
    link_s: float = float("nan")  # CUDA: the prefix bytes over the link, one large copy
    disk_floor_s: float = float("nan")  # the prefix bytes at the disk's cold read rate
    disk_s: float = float("nan")
    disk_load_s: float = float("nan")
    disk_blocks: int = 0
    max_abs_diff: float = float("nan")
    max_abs_logit: float = float("nan")  # the plain prefill's, to read the diff against

    @property
    def baseline_s(self) -> float:
        """No reuse: the better of the two full prefills (plain, and the adapter's miss)."""
        return min(self.prefill_s, self.miss_s)

    @property
    def floor_s(self) -> float:
        """CUDA: what a hit needs at least when loading overlaps compute: the larger of
        the prefix bytes over the link and the hit's own compute."""
        return max(self.link_s, self.compute_s)

    @property
    def serial_floor_s(self) -> float:
        """CUDA: what a load-then-compute hit needs at least: the two one after another."""
        return self.link_s + self.compute_s


def arena_dir_for(workdir: Path, host_bytes: int) -> Path:
    """/dev/shm when it has room for the arena, else the work dir."""
    shm = Path("/dev/shm")
    room = shutil.disk_usage(shm).free if shm.is_dir() else 0
    return shm if room > host_bytes * 1.25 else workdir


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def h2d_link_gbs(device: torch.device, nbytes: int = 1 << 30) -> float:
    """One large pinned host -> device copy (median of 5, CUDA events): the link's rate."""
    host = torch.ones(nbytes, dtype=torch.uint8).pin_memory()
    return copy_gbs(torch.empty(nbytes, dtype=torch.uint8, device=device), host)


def plain_prefill(model: torch.nn.Module, ids: torch.Tensor) -> tuple[float, torch.Tensor]:
    device = model.device
    sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        logits = model(ids.to(device).unsqueeze(0), logits_to_keep=1).logits
    sync(device)
    return time.perf_counter() - t0, logits[0, -1].float().cpu()


def run(args: argparse.Namespace) -> list[Row]:
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = getattr(torch, args.dtype)
    print(
        f"building random-weight Llama '{args.preset}' ({args.dtype}) on {device} ...", flush=True
    )
    model = random_llama(
        args.preset,
        seed=0,
        dtype=dtype,
        device=device,
        max_position_embeddings=max(args.lengths) + 16,
    )
    vocab = model.config.vocab_size
    model_id = f"random-llama-{args.preset}-seed0"
    # KV bytes of each prompt: 2 * layers * kv_heads * head_dim * dtype bytes per token
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    token_bytes = (
        2
        * cfg.num_hidden_layers
        * cfg.num_key_value_heads
        * head_dim
        * torch.empty((), dtype=dtype).element_size()
    )
    total = sum(args.lengths) * token_bytes
    host_bytes = max(256 << 20, int(total * 1.3))
    workdir = Path(tempfile.mkdtemp(prefix="ttft-", dir=args.tmp))
    arena_dir = arena_dir_for(workdir, host_bytes)
    # the whole index loads before the daemon answers: a disk hit right after a restart
    # must not race a background index load (which would turn part of it into misses)
    extra = ["--arena_dir", str(arena_dir), "--sync_index_bytes", str(int(total * 4))]
    daemon = OwnDaemon(workdir, host_bytes, int(total * 2) + (1 << 30), extra_args=extra)
    print(
        f"kvstored in {workdir}: host {host_bytes >> 20} MiB (arena in {arena_dir}), "
        f"{token_bytes >> 10} KiB of KV per token",
        flush=True,
    )
    prompts = {
        n: torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n))
        for n in args.lengths
    }
    rows: list[Row] = []
    link_gbs = h2d_link_gbs(device) if cuda else float("nan")
    if cuda:
        print(f"link: one pinned 1 GiB host -> device copy at {link_gbs:.1f} GB/s", flush=True)
    daemon.start()
    try:
        with (
            KVClient(daemon.addr, timeout=600) as client,
            HFPrefixCache(client, model, model_id, block_tokens=args.block_tokens) as kv,
        ):
            via_host = HFPrefixCache(
                client, model, model_id, block_tokens=args.block_tokens, direct_copies=False
            )
            # the path before layer-wise loading: CUDA: the whole prefix straight from
            # the arena, then the model; CPU: the bytes path, then the model
            other = HFPrefixCache(
                client, model, model_id, block_tokens=args.block_tokens, stream_layers=False
            )
            # the default path again, in its own adapter: the A/A control of the turns
            again = HFPrefixCache(client, model, model_id, block_tokens=args.block_tokens)
            T = kv.block_tokens
            # warm-up: first calls allocate and pick kernels, at the first length too
            warm = torch.randint(0, vocab, (2 * T + 3,))
            kv.prefill(warm)
            kv.prefill(warm)
            via_host.prefill(warm, store=False)
            other.prefill(warm, store=False)
            again.prefill(warm, store=False)
            plain_prefill(model, prompts[args.lengths[0]])
            for n in args.lengths:
                ids = prompts[n]
                prefill_s, ref = plain_prefill(model, ids)
                miss = kv.prefill(ids)
                assert miss.stats.reused_tokens == 0, "prompts must not share blocks"
                hits, host_hits, other_hits, again_hits = [], [], [], []
                for _ in range(args.repeat):  # in turns: the machine may be shared
                    hits.append(kv.prefill(ids, store=False))
                    other_hits.append(other.prefill(ids, store=False))
                    again_hits.append(again.prefill(ids, store=False))
                    if cuda:
                        host_hits.append(via_host.prefill(ids, store=False))
                reused = hits[0].stats.reused_tokens
                assert reused == (n - 1) // T * T, (reused, n)
                diff = float((hits[0].logits[0, -1].float().cpu() - ref).abs().max())
                row = Row(
                    length=n,
                    prefix_bytes=reused * token_bytes,
                    computed_on_hit=hits[0].stats.computed_tokens,
                    prefill_s=prefill_s,
                    miss_s=miss.stats.ttft_s,
                    put_s=miss.stats.store_s,
                    host_s=min(h.stats.ttft_s for h in hits),
                    host_load_s=min(h.stats.load_s for h in hits),
                    max_abs_diff=diff,
                    max_abs_logit=float(ref.abs().max()),
                )
                assert all(h.stats.reused_tokens == reused for h in other_hits + host_hits)
                assert torch.equal(other_hits[0].logits, hits[0].logits)  # the same bytes
                row.again_s = min(h.stats.ttft_s for h in again_hits)
                row.other_s = min(h.stats.ttft_s for h in other_hits)
                row.other_load_s = min(h.stats.load_s for h in other_hits)
                if host_hits:
                    assert torch.equal(host_hits[0].logits, hits[0].logits)  # the same bytes
                    row.via_host_s = min(h.stats.ttft_s for h in host_hits)
                    row.via_host_load_s = min(h.stats.load_s for h in host_hits)
                    # the whole load's compute: its TTFT less its (complete) load
                    row.compute_s = min(h.stats.ttft_s - h.stats.load_s for h in other_hits)
                    row.link_s = row.prefix_bytes / (link_gbs * 1e9)
                rows.append(row)
                print(
                    f"{n:>6} tokens: prefill {prefill_s:8.3f} s | miss {row.miss_s:8.3f} s "
                    f"(+ put {row.put_s:.3f} s) | host hit {row.host_s:.3f} s "
                    f"({row.baseline_s / row.host_s:.1f}x, load {row.host_load_s:.3f} s) | "
                    f"other path {row.other_s:.3f} s | via host memory {row.via_host_s:.3f} s | "
                    f"max |dlogit| {diff:.2e}",
                    flush=True,
                )
                del miss, hits, host_hits, other_hits, again_hits
        disk_times: dict[int, list[float]] = {n: [] for n in args.lengths}
        disk_loads: dict[int, list[float]] = {n: [] for n in args.lengths}
        for attempt in range(args.disk_repeat):
            daemon.stop()
            drop_disk_cache(daemon.disk_dir)
            daemon.start()
            with (
                KVClient(daemon.addr, timeout=600) as client,
                HFPrefixCache(client, model, model_id, block_tokens=args.block_tokens) as kv,
            ):
                for row in rows:
                    out = kv.prefill(prompts[row.length], store=False)
                    assert out.stats.reused_tokens == (row.length - 1) // T * T
                    row.disk_blocks = out.stats.disk_blocks
                    disk_times[row.length].append(out.stats.ttft_s)
                    disk_loads[row.length].append(out.stats.load_s)
                    print(
                        f"{row.length:>6} tokens: disk hit {out.stats.ttft_s:.3f} s, load "
                        f"{out.stats.load_s:.3f} s "
                        f"({out.stats.disk_blocks} blocks from disk, restart {attempt + 1})",
                        flush=True,
                    )
        for row in rows:
            row.disk_s = min(disk_times[row.length])
            row.disk_load_s = min(disk_loads[row.length])
        daemon.stop()  # LMDB's file at rest: nobody else reads it while it is timed
        args.disk_gbs = disk_read_gbs(daemon.disk_dir / "data.mdb", args.disk_threads)
        print(f"disk: {args.disk_threads} readers read LMDB's data file cold at "
              f"{args.disk_gbs:.2f} GB/s", flush=True)
        for row in rows:
            row.disk_floor_s = row.prefix_bytes / (args.disk_gbs * 1e9)
    finally:
        daemon.cleanup()
        shutil.rmtree(workdir, ignore_errors=True)
    return rows


def write_report(args: argparse.Namespace, rows: list[Row], elapsed_s: float) -> None:
    out = Path(args.out)
    png = out.with_suffix(".png")
    plot(rows, png, args)
    cfg = LLAMA_PRESETS[args.preset]
    device_name = (
        torch.cuda.get_device_name()
        if args.device == "cuda"
        else f"{platform.processor() or platform.machine()}, "
        f"torch threads: {torch.get_num_threads()}"
    )
    lines = [
        "# Time to first token: HF transformers with kvstore prefix reuse",
        "",
        f"Measured by `benchmarks/ttft_bench.py` (run: `{' '.join(sys.argv)}`), "
        f"{time.strftime('%Y-%m-%d')}, {elapsed_s / 60:.1f} minutes in all (1-minute load "
        f"average {args.load_before:.1f} before, {args.load_after:.1f} after: the machine may "
        "be shared, so single numbers carry noise).",
        "",
        f"- device: {args.device} ({device_name}); torch {torch.__version__}; "
        f"transformers {_transformers_version()}",
        f"- model: random-weight Llama, preset `{args.preset}`: hidden {cfg['hidden_size']}, "
        f"{cfg['num_hidden_layers']} layers, {cfg['num_attention_heads']} heads / "
        f"{cfg['num_key_value_heads']} KV heads (GQA), intermediate {cfg['intermediate_size']}, "
        f"vocab {cfg['vocab_size']}, {args.dtype}, SDPA attention",
        f"- kvstore: {args.block_tokens} tokens per block; the daemon runs beside the "
        "benchmark on the same host, blocks move through the shared host arena "
        "(zero-copy client path); the put after a miss is not on the TTFT path",
        "- prefill: the plain model on the whole prompt; miss: the adapter's first call "
        "(lookup miss + full prefill); host hit: the prefix from the host arena "
        f"(best of {args.repeat}); disk hit: after a daemon restart with LMDB's data file "
        f"dropped from the page cache (best of {args.disk_repeat} restarts); speed-up: "
        "the better of prefill and miss over the hit",
        "- a hit reuses `(len - 1) // block_tokens` blocks and computes the rest (the last "
        "prompt token must be computed to get logits); `max |dlogit|` compares the host "
        "hit's last logits with the plain prefill's",
        "- `(load)`: of a hit's TTFT, the part before the model runs: lookup and get or "
        "acquire (loading the whole prefix first: also the copies and building the "
        "`DynamicCache`; layer by layer: the copies run inside the rest); the rest is "
        "the model on the computed tokens (attending to the "
        "whole prefix)",
        "",
    ]
    cuda = args.device == "cuda"
    other = "whole load first (before)" if cuda else "bytes path (before)"
    lines += [
        "- `A/A`: the host hit again, by a second adapter on the same path, in the same "
        "turns: how far two runs of one path differ here",
        "- host hit: "
        + (
            "the adapter's default on CUDA: the prefix copied layer by layer on a side "
            "stream (one kernel launch per layer) while the model runs, each decoder layer "
            "waiting only for its own layer; `whole load first`: the same hit with "
            "`stream_layers=False`, the path before (every layer copied, then the model), "
            "timed in turns with it"
            if cuda
            else "the adapter's default: each layer copied from the mapped arena just "
            "before the model reads it; `bytes path`: the same hit with "
            "`stream_layers=False`, the path before (the prefix copied out of the arena, "
            "then gathered into a `DynamicCache`), timed in turns with it"
        ),
    ]
    if cuda:
        lines += [
            "- `via host memory`: the same host hit with `direct_copies=False` (the bytes "
            "path: arena -> numpy -> `.to(device)` from pageable memory, as for a remote "
            "daemon), timed in turns with the others",
            "- floor: `link` is the prefix bytes over one large pinned host -> device copy "
            "measured in the same run; `compute` is the hit's own compute (the whole "
            "load's TTFT less its load); `floor` is the larger of the two (what a hit that "
            "overlaps loading and compute needs at least; one that loads first needs their "
            "sum); `floor x`: the prefill over that floor",
        ]
    lines += [
        "",
        "| prompt tokens | cached prefix | computed on hit | prefill | miss (+put) | "
        f"host hit (load) | speed-up | A/A | {other} (load) | speed-up | "
        + ("via host memory (load) | link | compute | floor | floor x | " if cuda else "")
        + "max abs dlogit (max abs logit) |",
        "|" + "---:|" * (16 if cuda else 11),
    ]
    for r in rows:
        lines.append(
            f"| {r.length} | {_size(r.prefix_bytes)} | {r.computed_on_hit} | "
            f"{_ms(r.prefill_s)} | {_ms(r.miss_s)} (+{_ms(r.put_s)}) | "
            f"{_ms(r.host_s)} ({_ms(r.host_load_s)}) | {r.baseline_s / r.host_s:.1f}x | "
            f"{_ms(r.again_s)} | {_ms(r.other_s)} ({_ms(r.other_load_s)}) | "
            f"{r.baseline_s / r.other_s:.1f}x | "
            + (
                f"{_ms(r.via_host_s)} ({_ms(r.via_host_load_s)}) | {_ms(r.link_s)} | "
                f"{_ms(r.compute_s)} | {_ms(r.floor_s)} | {r.baseline_s / r.floor_s:.1f}x | "
                if cuda
                else ""
            )
            + f"{r.max_abs_diff:.1e} ({r.max_abs_logit:.1f}) |"
        )
    disk_gbs = getattr(args, "disk_gbs", float("nan"))
    lines += [
        "",
        "### The disk tier against the disk's own rate",
        "",
        f"`disk floor`: the prefix bytes at the rate {args.disk_threads} parallel readers "
        f"read LMDB's data file with a cold page cache, measured after the disk hits: "
        f"**{disk_gbs:.2f} GB/s**. The disk tier pays off where that floor is under the "
        "prefill.",
        "",
        "| prompt tokens | cached prefix | prefill | disk hit (load) | speed-up | disk floor | "
        "floor x | pays off at the floor |",
        "|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.length} | {_size(r.prefix_bytes)} | {_ms(r.baseline_s)} | "
            f"{_ms(r.disk_s)} ({_ms(r.disk_load_s)}) | {r.baseline_s / r.disk_s:.1f}x | "
            f"{_ms(r.disk_floor_s)} | {r.baseline_s / r.disk_floor_s:.1f}x | "
            f"{'yes' if r.disk_floor_s < r.baseline_s else 'no'} |"
        )
    if rows:
        per_token = rows[0].prefix_bytes / max(1, rows[0].length - rows[0].computed_on_hit)
        need = per_token / (rows[-1].baseline_s / rows[-1].length) / 1e9
        lines += [
            "",
            f"Where it pays: a token's KV is {_size(int(per_token))}; at the longest prompt "
            f"the prefill takes {rows[-1].baseline_s / rows[-1].length * 1e6:.1f} us a token, "
            f"so a disk hit can only beat it from a cold read rate of {need * 1e3:,.0f} MB/s up "
            "(prefill per token grows with the prompt, so longer prompts need less).",
        ]
    lines += ["", f"![TTFT vs prompt length]({png.name})", ""]
    last = rows[-1]
    load_how = (
        "(lookup, acquire, and every layer's copy enqueued on a side stream, one kernel "
        "launch per layer from the mapped arena into the cache's tensors: the copies "
        "themselves run during the forward, inside the rest of the hit)"
        if args.device == "cuda"
        else "(lookup and acquire; each layer is copied from the arena when the model "
        "reaches it, inside the rest of the hit)"
    )
    lines += [
        "Reading it: at the longest prompt, "
        f"{last.length} tokens, a hit gives the first token in {_ms(last.host_s)} from the "
        f"host tier and {_ms(last.disk_s)} from disk, against {_ms(last.baseline_s)} of "
        f"prefill ({last.baseline_s / last.host_s:.1f}x and "
        f"{last.baseline_s / last.disk_s:.1f}x)."
        f" Loading the {_size(last.prefix_bytes)} prefix takes {_ms(last.host_load_s)} from the "
        f"arena {load_how} and "
        f"{_ms(last.disk_load_s)} from LMDB with a cold page cache (then promoted to host); "
        f"the rest of a hit is the model running {last.computed_on_hit} tokens that attend to "
        "the whole prefix (its `DynamicCache` also copies the prefix once more per layer as "
        "it appends, on the whole-load path). Prefill grows faster than linearly with the "
        "prompt (attention), loading linearly, so the speed-up grows with the prompt. Raw numbers: "
        f"`{out.with_suffix('.json').name}`.",
        "",
    ]
    if args.device == "cpu":
        lines += [
            "## GPU",
            "",
            "The Llama-3-8B-shaped run on a lent GPU (last: an H200; 8k, 16k and 32k "
            "tokens) is in [ttft_gpu.md](ttft_gpu.md); its command:",
            "",
            "```bash",
            GPU_COMMAND,
            "```",
            "",
        ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    raw = {
        "argv": sys.argv,
        "device": device_name,
        "preset": args.preset,
        "dtype": args.dtype,
        "block_tokens": args.block_tokens,
        "rows": [asdict(r) for r in rows],
    }
    out.with_suffix(".json").write_text(json.dumps(raw, indent=1) + "\n")
    print(f"wrote {out}, {png.name} and {out.with_suffix('.json').name}")


def plot(rows: list[Row], png: Path, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r.length for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    ax.plot(x, [r.baseline_s * 1e3 for r in rows], "o-", label="no reuse (full prefill)")
    ax.plot(x, [r.disk_s * 1e3 for r in rows], "s-", label="reuse from disk tier (LMDB)")
    ax.plot(x, [r.host_s * 1e3 for r in rows], "^-", label="reuse from host tier (arena)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(x, [str(n) for n in x])
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title(f"TTFT, random-weight Llama '{args.preset}' ({args.dtype}, {args.device})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png)
    plt.close(fig)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.0f} ms" if seconds >= 0.1 else f"{seconds * 1e3:.1f} ms"


def _size(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):,.0f} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument(
        "--preset",
        default=None,
        choices=sorted(LLAMA_PRESETS),
        help="model shape (default: cpu-250m on cpu, llama3-8b on cuda)",
    )
    parser.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="default: float32 on cpu, bfloat16 on cuda",
    )
    parser.add_argument(
        "--lengths",
        default=None,
        help="comma-separated prompt lengths (default: 512..8192 on cpu, 8192,16384,32768 on cuda)",
    )
    parser.add_argument("--block-tokens", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=5, help="host-hit repetitions (best)")
    parser.add_argument("--disk-repeat", type=int, default=2, help="restarts for disk hits (best)")
    parser.add_argument("--disk-threads", type=int, default=8, help="readers of the disk floor")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: all)")
    parser.add_argument("--tmp", default=None, help="directory for the daemon's files")
    parser.add_argument("--out", default=str(REPO / "docs" / "benchmarks" / "ttft.md"))
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no CUDA device")
    if args.disk_threads < 1:
        parser.error(f"--disk-threads must be at least 1, got {args.disk_threads}")
    args.preset = args.preset or ("llama3-8b" if cuda else "cpu-250m")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    lengths = args.lengths.split(",") if args.lengths else (GPU_LENGTHS if cuda else CPU_LENGTHS)
    args.lengths = [int(n) for n in lengths]
    if args.threads:
        torch.set_num_threads(args.threads)
    # SIGTERM / SIGINT (even where a background job ignores SIGINT) unwind through the
    # `finally` that stops the daemon and removes its files
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    start = time.perf_counter()
    args.load_before = os.getloadavg()[0]
    rows = run(args)
    args.load_after = os.getloadavg()[0]
    write_report(args, rows, time.perf_counter() - start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
