"""KV codecs on a real model: what fp8, int8 and int4 cost in accuracy, and what they save.

A program, not a test. On SmolLM2-135M-Instruct (:mod:`kvclient.smollm2`, bfloat16 on
CPU) and real English text the project ships (LICENSE, README.md, docs/design.md: the
README alone became too short for the default lengths when it shrank to a page, #69):

1. The model computes the KV of a prefix of ``--prefix`` tokens once; the adapter
   (:class:`kvclient.hf.HFPrefixCache`) stores it in one namespace per codec of a real
   kvstored, which is then restarted: its host tier is empty, every block is read back
   from the disk tier, where the coded namespaces keep them encoded.
2. Perplexity: for each codec, the next ``--score`` tokens are scored with the prefix's
   KV loaded through the adapter (decoded on the way out of the disk tier); against
   the exact namespace (target: fp8 and int8 within 1%; int4 reported) and against the
   model alone (no kvstore: the exact path must match it).
3. The largest absolute error of the loaded K and V tensors against the exact ones.
4. Bytes per block on disk (the records' payloads; target: at most 0.53x of bfloat16
   for the 8-bit codecs) and encode / decode throughput on one core (a 2 MiB block;
   target: decode at least 2 GB/s of output).
5. The multi-turn benchmark (``benchmarks/multiturn.py``, vLLM, case ``kv_disk``: the
   daemon restarted between turns, history from the disk tier) once per codec: time to
   first token of the later turns, and greedy replies equal to the exact codec's.
6. The shared-tier benchmark's second node (``benchmarks/shared_tier.py``: node B
   reads a prompt node A computed from a Valkey Cluster) once per codec: bytes read
   and time to first token.

    .venv/bin/python benchmarks/codec_accuracy.py            # writes docs/benchmarks/codecs.md
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import lmdb
import ml_dtypes
import numpy as np
import torch

from kvbench.harness import write_program_report
from kvbench.servers import OwnDaemon
from kvclient import KVClient
from kvclient.hf import HFPrefixCache
from kvstore.codecs import CODECS, Codec
from kvstore.disk.format import META_DB, unpack_record

REPO = Path(__file__).resolve().parent.parent
REPORT = REPO / "docs" / "benchmarks" / "codecs.md"
MiB = 1 << 20
BLOCK_TOKENS = 16
TARGET_PPL = 0.01
TARGET_RATIO = 0.53
TARGET_DECODE = 2e9


def text_tokens(tokenizer: Any, n: int) -> list[int]:
    names = ("LICENSE", "README.md", "docs/design.md")
    text = "\n\n".join((REPO / name).read_text() for name in names)
    ids = tokenizer(text)["input_ids"]
    if len(ids) < n:
        raise SystemExit(f"the shipped text has {len(ids)} tokens, fewer than {n}")
    return list(ids[:n])


def nll(logits: torch.Tensor, targets: list[int]) -> float:
    """Mean negative log-likelihood of ``targets`` under ``logits`` [1, n, vocab]."""
    logp = torch.log_softmax(logits[0].float(), dim=-1)
    picked = logp[torch.arange(len(targets)), torch.tensor(targets)]
    return float(-picked.mean())


def kv_tensors(cache: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """All layers' K and V of a transformers cache, stacked."""
    layers = cache.layers if hasattr(cache, "layers") else None
    if layers is not None:
        keys = torch.stack([layer.keys for layer in layers])
        return keys, torch.stack([layer.values for layer in layers])
    return torch.stack(list(cache.key_cache)), torch.stack(list(cache.value_cache))


def throughput(dtype: str = "bfloat16") -> dict[str, dict[str, float]]:
    """Encode and decode GB/s (of the block as the engine has it) on one thread."""
    rng = np.random.default_rng(0)
    block = (rng.standard_normal(MiB) * 2).astype(ml_dtypes.bfloat16).tobytes()  # 2 MiB
    out: dict[str, dict[str, float]] = {}
    copy_to = memoryview(bytearray(len(block)))
    floor = {"encode": 0.0, "decode": 0.0, "decode_numpy": 0.0}
    for _ in range(20):  # the floor: one copy of the block into a reused buffer
        began = time.perf_counter()
        copy_to[:] = block
        floor["decode"] = max(floor["decode"], len(block) / (time.perf_counter() - began) / 1e9)
    out["memcpy (floor)"] = floor
    for name in CODECS[1:]:
        codec = Codec(name, dtype, 64, len(block))
        scratch = memoryview(bytearray(codec.encoded_bytes))
        target = memoryview(bytearray(len(block)))
        encoded = codec.encode(block, scratch)

        def best(fn: Any, n: int = 20) -> float:
            times = []
            for _ in range(n):
                began = time.perf_counter()
                fn()
                times.append(time.perf_counter() - began)
            return len(block) / min(times) / 1e9

        out[name] = {
            "encode": best(lambda c=codec, s=scratch: c.encode(block, s)),
            "decode": best(lambda c=codec, e=encoded, t=target: c.decode(e, t)),
            "decode_numpy": best(lambda c=codec, e=encoded, t=target: c.decode(e, t, False), 5),
        }
    return out


def disk_bytes(disk_dir: Path) -> dict[int, list[int]]:
    """Payload sizes of the disk records, by codec id."""
    sizes: dict[int, list[int]] = {}
    with lmdb.open(str(disk_dir), max_dbs=8, readonly=True, lock=False) as env:
        meta = env.open_db(META_DB, create=False)
        with env.begin() as txn:
            for key, raw in txn.cursor(db=meta):
                record = unpack_record(key, raw)
                sizes.setdefault(record.codec, []).append(record.size)
    return sizes


def run(prefix_tokens: int, score_tokens: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvclient.smollm2 import model_dir

    directory = model_dir()
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.bfloat16).eval()
    tokens = text_tokens(tokenizer, prefix_tokens + score_tokens)
    prefix, scored = tokens[:prefix_tokens], tokens[prefix_tokens:]
    work = Path(tempfile.mkdtemp(prefix="kv-codecs-"))
    daemon = OwnDaemon(work, 256 * MiB, 1 << 30)
    work.mkdir(parents=True, exist_ok=True)
    daemon.start()
    results: dict[str, Any] = {"codecs": {}}
    try:
        began = time.perf_counter()
        with torch.no_grad():
            alone = model(input_ids=torch.tensor([tokens]), use_cache=True)
        results["model_alone_s"] = time.perf_counter() - began
        with KVClient(daemon.addr) as client:
            caches = {name: HFPrefixCache(client, model, "smollm2", block_tokens=BLOCK_TOKENS,
                                          codec=name) for name in CODECS}  # fmt: skip
            first = caches["exact"].prefill(prefix, store=False, logits_to_keep=1)
            for cache in caches.values():  # the same KV, stored under every codec
                assert cache.store(prefix, first.cache, 0, prefix_tokens // BLOCK_TOKENS) > 0
        daemon.stop()  # persists the host tier: every block is on disk now ...
        daemon.start()  # ... and only there
        with KVClient(daemon.addr) as client:
            caches = {name: HFPrefixCache(client, model, "smollm2", block_tokens=BLOCK_TOKENS,
                                          codec=name) for name in CODECS}  # fmt: skip
            # every namespace's prefix, from the disk tier (then promoted into host)
            loads = {name: cache.load(tokens) for name, cache in caches.items()}
            reference = kv_tensors(loads["exact"].cache)
            for name, cache in caches.items():
                loaded = loads[name]
                assert loaded.tokens == prefix_tokens and loaded.host_blocks == 0, loaded
                keys, values = kv_tensors(loaded.cache)
                out = cache.prefill(tokens, store=False, logits_to_keep=0)
                assert out.stats.reused_tokens == prefix_tokens
                results["codecs"][name] = {
                    "ppl": math.exp(nll(out.logits[:, :-1], scored[1:])),
                    "k_max_abs": float((keys.float() - reference[0].float()).abs().max()),
                    "v_max_abs": float((values.float() - reference[1].float()).abs().max()),
                    "k_max": float(reference[0].float().abs().max()),
                    "v_max": float(reference[1].float().abs().max()),
                    "load_ms": loaded.load_s * 1e3,
                    "block_bytes": cache.namespace.block_bytes,
                }  # fmt: skip
        # the model alone, one pass over the whole text: the same tokens, the same way
        results["alone_ppl_scored"] = math.exp(nll(alone.logits[:, prefix_tokens:-1], scored[1:]))
    finally:
        daemon.cleanup()
    results["disk"] = disk_bytes(work / "disk")
    results["throughput"] = throughput()
    results["meta"] = {
        "prefix": prefix_tokens,
        "scored": score_tokens,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
    return results


def multiturn_per_codec(conversations: int, turns: int) -> dict[str, Any]:
    """benchmarks/multiturn.py's kv_disk case once per codec (engine processes)."""
    import multiturn

    out: dict[str, Any] = {}
    work = Path(tempfile.mkdtemp(prefix="kv-codecs-multiturn-"))
    for name in CODECS:
        json_path = work / f"{name}.json"
        multiturn.main([
            "--cases", "kv_disk", "--codec", name, "--conversations", str(conversations),
            "--turns", str(turns), "--json", str(json_path), "--out", str(work / f"{name}.md"),
        ])  # fmt: skip
        data = json.loads(json_path.read_text())
        out[name] = {"summary": data["summary"]["kv_disk"], "runs": data["runs"]["kv_disk"]}
    exact = out["exact"]["runs"][0]
    for data in out.values():
        pairs = list(zip(data["runs"][0], exact, strict=True))
        data["same"] = sum(got["reply"] == want["reply"] for got, want in pairs)
        data["compared"] = len(pairs)
    return out


def shared_per_codec(tokens: int, repeat: int) -> dict[str, Any]:
    """benchmarks/shared_tier.py's node-B time to first token once per codec."""
    import shared_tier

    from kvbench.valkey_cluster import ValkeyCluster

    with ValkeyCluster(3) as cluster:
        return {name: shared_tier.ttft(cluster.url, tokens, repeat, name) for name in CODECS}


def report(r: dict[str, Any]) -> str:
    meta, codecs = r["meta"], r["codecs"]
    exact = codecs["exact"]["ppl"]
    block = codecs["exact"]["block_bytes"]
    ids = {0: "exact", 1: "fp8", 2: "int8", 3: "int4"}
    lines = [
        "# KV codecs: accuracy and bytes on a real model",
        "",
        f"Measured {meta['date']} by `benchmarks/codec_accuracy.py` on {meta['cpus']} CPUs "
        f"(Python {meta['python']}, torch {meta['torch']}): SmolLM2-135M-Instruct in "
        f"bfloat16, real text the project ships (LICENSE, README.md, docs/design.md). The KV "
        f"of the first {meta['prefix']} tokens was stored under each codec in a real "
        f"kvstored, which was then restarted: every block came back from the disk tier, "
        f"decoded. The next {meta['scored']} tokens were scored with that prefix loaded. Blocks of "
        f"{BLOCK_TOKENS} tokens ({block // 1024} KiB in bfloat16: 30 layers, 3 KV heads of "
        "64).",
        "",
        "| codec | perplexity | vs exact | target | max abs error K | max abs error V | "
        "bytes per block on disk | vs exact | load ms |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for name, c in codecs.items():
        sizes = r["disk"].get(next(k for k, v in ids.items() if v == name), [])
        stored = sum(sizes) / len(sizes) if sizes else float("nan")
        target = {"fp8": "<= 1%", "int8": "<= 1%"}.get(name, "reported")
        lines.append(
            f"| {name} | {c['ppl']:.4f} | {c['ppl'] / exact - 1:+.2%} | {target} | "
            f"{c['k_max_abs']:.4g} | {c['v_max_abs']:.4g} | {stored:,.0f} | "
            f"{stored / block:.3f}x | {c['load_ms']:.0f} |"
        )
    ppl_met = all(abs(codecs[n]["ppl"] / exact - 1) <= TARGET_PPL for n in ("fp8", "int8"))
    ratios = {}
    for name in ("fp8", "int8"):
        sizes = r["disk"].get(next(k for k, v in ids.items() if v == name), [])
        ratios[name] = sum(sizes) / len(sizes) / block if sizes else float("nan")
    bytes_met = all(ratio <= TARGET_RATIO for ratio in ratios.values())
    t = r["throughput"]
    decode_met = all(t[n]["decode"] * 1e9 >= TARGET_DECODE for n in t if n in CODECS)
    lines += [
        "",
        f"The largest K and V magnitudes of the prefix: {codecs['exact']['k_max']:.4g} and "
        f"{codecs['exact']['v_max']:.4g}. The model alone (no kvstore, one pass over the "
        f"whole text) scores the same tokens at {r['alone_ppl_scored']:.4f} "
        f"(exact through kvstore: {exact:.4f}).",
        "",
        f"**Perplexity: target (fp8 and int8 within {TARGET_PPL:.0%} of exact) "
        + ("met" if ppl_met else "MISSED") + ".** "
        f"**Bytes: target (8-bit codecs at most {TARGET_RATIO}x of bfloat16) "
        + ("met" if bytes_met else "MISSED") + ".**",
        "",
        "Encode and decode on one core, a 2 MiB bfloat16 block (groups of 64), GB/s of the "
        "block as the engine has it:",
        "",
        "| codec | encode | decode (C) | decode (numpy, the reference) |",
        "|---|---:|---:|---:|",
    ]
    for name, figures in t.items():
        shown = {k: f"{v:.2f}" if v else "-" for k, v in figures.items()}  # (the floor: a copy)
        lines.append(
            f"| {name} | {shown['encode']} | {shown['decode']} | {shown['decode_numpy']} |"
        )
    lines += [
        "",
        f"**Decode: target (at least {TARGET_DECODE / 1e9:.0f} GB/s of output) "
        + ("met" if decode_met else "MISSED") + ".** Encoding runs in the disk and shared "
        "tiers' writer threads, never on a request's path.",
        "",
    ]
    if "multiturn" in r:
        m = r["multiturn"]
        first = next(iter(m.values()))["summary"]
        lines += [
            "## Multi-turn chat from the disk tier, per codec",
            "",
            "`benchmarks/multiturn.py --cases kv_disk --codec C`: vLLM (CPU backend, "
            "float32) + kvstore, the daemon restarted between turns, so every later turn "
            f"loads its history from the disk tier ({len(first['turns'])} turns, "
            f"{m['exact']['compared'] // len(first['turns'])} conversations of real text; "
            "one run per codec, one after another).",
            "",
            "| codec | TTFT turn 1 ms | TTFT later turns ms (mean) | cached share | greedy "
            "replies equal to exact's |",
            "|---|---:|---:|---:|---|",
        ]
        for name, data in m.items():
            turns = data["summary"]["turns"]
            later = turns[1:] or turns
            lines.append(
                f"| {name} | {turns[0]['mean']:.0f} | "
                f"{sum(t['mean'] for t in later) / len(later):.0f} | "
                f"{sum(t['cached'] for t in later) / len(later):.0%} | "
                f"{data['same']} of {data['compared']} |"
            )
        lines.append("")
    if "shared" in r:
        lines += [
            "## A second node reading from the shared tier, per codec",
            "",
            "`benchmarks/shared_tier.py`'s time to first token: node A computes a prompt "
            "(a tiny random Llama in float32 through `kvclient.hf`) and its blocks go to a "
            "3-node Valkey Cluster on loopback; node B, its own tiers empty, reads them "
            "from the cluster and computes only the last token.",
            "",
            "| codec | prefix bytes read by node B | vs exact | TTFT on node B ms | cold "
            "prefill ms |",
            "|---|---:|---:|---:|---:|",
        ]
        base = r["shared"]["exact"]["prefix_bytes"]
        for name, data in r["shared"].items():
            lines.append(
                f"| {name} | {data['prefix_bytes']:,} | {data['prefix_bytes'] / base:.3f}x | "
                f"{data['hit_s'] * 1e3:.0f} | {data['cold_s'] * 1e3:.0f} |"
            )
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefix", type=int, default=2048, help="tokens whose KV is stored")
    parser.add_argument("--score", type=int, default=1024, help="tokens scored after it")
    parser.add_argument("--report", default=str(REPORT), help="markdown report ('' for none)")
    parser.add_argument("--conversations", type=int, default=4, help="multi-turn: 0 skips it")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--shared-tokens", type=int, default=4096, help="0 skips the shared tier")
    args = parser.parse_args()
    if args.prefix % BLOCK_TOKENS:
        raise SystemExit(f"--prefix must be a multiple of {BLOCK_TOKENS}")
    results = run(args.prefix, args.score)
    if args.conversations:
        results["multiturn"] = multiturn_per_codec(args.conversations, args.turns)
    if args.shared_tokens:
        results["shared"] = shared_per_codec(args.shared_tokens, 3)
    text = report(results)
    print(text)
    if args.report:
        write_program_report(args.report, text)


if __name__ == "__main__":
    main()
