"""What keeping the host tier encoded buys and costs (``codec_tiers = "host,disk,shared"``).

A program, not a test. In process (kvstore.store.Store, no daemon: this measures the
store, its encoder thread and its decode, not a socket), with blocks of SmolLM2-135M's
layout (30 layers, 3 KV heads of 64, 16 tokens, bfloat16: 360 KiB) filled with values
shaped like keys and values (groups of very different magnitudes):

1. **Capacity and hits.** A chat-like load: 48 conversations of 8 blocks (2.3x what
   the arena holds exact), each access reads a random conversation's chain and puts
   it when it is not whole (its blocks go to disk as they are evicted, write-back).
   Per case: the blocks the host tier holds at the end, and the share of the blocks
   read that came from host rather than disk. Cases: ``exact`` (an int8 namespace,
   its host tier exact: today's default), and host coding with fp8, int8, int4.
2. **A host hit, exact against decoded**, in turns (kvbench.harness.interleaved_passes):
   ``read`` of an 8-block chain held in host into the caller's buffer (an inline
   get's work), and ``acquire`` + copy out of the slots + release (an arena get's).
3. **Puts while the encoder works**, in turns: puts of 8 new blocks into a full host
   tier (no disk: each put evicts as many blocks as it stores), exact against each
   codec's host coding, whose encoder thread shares the machine's cores. And how many
   of the host blocks were encoded when the puts stopped: a codec whose encoder is
   slower than the puts leaves blocks exact, and they take exact room.

Encoding speed per codec is in codecs.md (the same kernels).

    .venv/bin/python benchmarks/host_coding.py            # ~2 minutes
    .venv/bin/python benchmarks/host_coding.py --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np

from kvbench.harness import Result, Series, interleaved_passes, write_program_report
from kvbench.report import markdown_table
from kvstore.keys import NamespaceSpec
from kvstore.store import Store, StoreConfig

REPO = Path(__file__).resolve().parent.parent
REPORT = REPO / "docs" / "benchmarks" / "host_coding.md"
MiB = 1 << 20
LAYOUT = dict(block_tokens=16, num_layers=30, num_kv_heads=3, head_dim=64, dtype="bfloat16")
CODECS = ("fp8", "int8", "int4")
CONVERSATIONS, CHAIN = 48, 8
HOST_BYTES = 64 * MiB


def kv_values(elements: int, seed: int) -> bytes:
    """bfloat16 values shaped like K and V: groups of 64 of very different magnitudes."""
    rng = np.random.default_rng(seed)
    groups = elements // 64
    x = rng.standard_normal((groups, 64)) * np.exp(rng.uniform(-3, 3, (groups, 1)))
    return x.ravel().astype(ml_dtypes.bfloat16).tobytes()


def open_store(workdir: Path, codec_host: bool, disk: bool) -> Store:
    tiers = ("host", "disk", "shared") if codec_host else ("disk", "shared")
    return Store(
        StoreConfig(
            host_bytes=HOST_BYTES,
            disk_bytes=1024 * MiB if disk else 0,
            disk_dir=str(workdir / "disk") if disk else None,
            shared_arena=False,
            codec_tiers=tiers,
        )
    )


def capacity_and_hits(workdir: Path, codec: str, accesses: int, paced: bool) -> dict[str, float]:
    """Part 1 for one case (``codec == "exact"``: int8 namespace, host not coded);
    ``paced``: each access waits for the encoder first."""
    store = open_store(workdir, codec != "exact", disk=True)
    try:
        spec = store.open_namespace(
            NamespaceSpec("smollm2-like", codec="int8" if codec == "exact" else codec, **LAYOUT)
        )
        elements = spec.block_bytes // 2
        payloads = [
            np.frombuffer(kv_values(elements * CHAIN, c), np.uint8).reshape(CHAIN, -1)
            for c in range(CONVERSATIONS)
        ]
        chains = [
            store.keys_for(spec.ns_id, list(range(c * 10_000, c * 10_000 + CHAIN * 16)))
            for c in range(CONVERSATIONS)
        ]
        rng = random.Random(7)
        out = memoryview(bytearray(CHAIN * spec.block_bytes))
        before = store.stats()
        held: list[int] = []
        for i in range(accesses):
            if paced:
                store.wait_host_coded(60)
            c = rng.randrange(CONVERSATIONS)
            copied, _ = store.read(spec.ns_id, chains[c], out=out)
            if copied < CHAIN:
                store.put(spec.ns_id, chains[c], list(payloads[c]))
            if i >= accesses // 2 and i % 10 == 0:
                held.append(store.stats().tier("host").blocks)  # type: ignore[union-attr]
            if (i + 1) % 100 == 0:
                print(f"  {codec}: {i + 1}/{accesses} accesses", file=sys.stderr)
        after = store.stats()
        host = after.tier("host")
        disk = after.tier("disk")
        assert host is not None and disk is not None
        host_hits = host.hits - before.tier("host").hits  # type: ignore[union-attr]
        disk_hits = disk.hits - before.tier("disk").hits  # type: ignore[union-attr]
        return {
            "host_blocks": statistics.mean(held),
            "host_share": host_hits / max(1, host_hits + disk_hits),
            "disk_hits": disk_hits,
            "block_bytes": spec.block_bytes,
        }
    finally:
        store.close()


def read_costs(workdir: Path, repeat: int) -> dict[str, dict[str, Result]]:
    """Part 2: per case, read and acquire results of an 8-block host hit."""
    stores: dict[str, Store] = {}
    series: list[Series] = []
    results: dict[str, dict[str, Result]] = {}
    try:
        for case in ("exact", *CODECS):
            store = open_store(workdir / case, case != "exact", disk=False)
            stores[case] = store
            name = "int8" if case == "exact" else case
            spec = store.open_namespace(NamespaceSpec("smollm2-like", codec=name, **LAYOUT))
            elements = spec.block_bytes // 2
            data = np.frombuffer(kv_values(elements * CHAIN, 1), np.uint8).reshape(CHAIN, -1)
            chain = store.keys_for(spec.ns_id, list(range(CHAIN * 16)))
            store.put(spec.ns_id, chain, list(data))
            store.wait_host_coded(60)
            out = memoryview(bytearray(CHAIN * spec.block_bytes))
            sink = np.empty(CHAIN * spec.block_bytes, np.uint8)
            size = spec.block_bytes

            def read(
                store: Store = store, ns: str = spec.ns_id, keys: list = chain,
                out: memoryview = out,
            ) -> None:  # fmt: skip
                assert store.read(ns, keys, out=out)[0] == CHAIN

            def acquire(
                store: Store = store, ns: str = spec.ns_id, keys: list = chain, size: int = size,
                sink: np.ndarray = sink,
            ) -> None:  # fmt: skip
                got = store.acquire(ns, keys)
                array = store.arena.array()
                for i, offset in enumerate(got.offsets):
                    sink[i * size : (i + 1) * size] = array[offset : offset + size]
                store.release(got.lease_id)

            results[case] = {}
            for op, call in (("read", read), ("acquire", acquire)):
                result = Result("kvstore", op, "-", "host", case, size, CHAIN, calls=20)
                results[case][op] = result
                series.append(Series(result, [call] * 20))
        interleaved_passes(series, repeat, alternate=True)
    finally:
        for store in stores.values():
            store.close()
    return results


def put_costs(workdir: Path, repeat: int) -> tuple[dict[str, Result], dict[str, float]]:
    """Part 3: puts of 8 new blocks into a full host tier per case; the share of host
    blocks encoded right after the last timed pass."""
    stores: dict[str, Store] = {}
    specs: dict[str, NamespaceSpec] = {}
    series: list[Series] = []
    results: dict[str, Result] = {}
    counters = {"next": 0}
    try:
        for case in ("exact", *CODECS):
            store = open_store(workdir / f"put-{case}", case != "exact", disk=False)
            stores[case] = store
            name = "int8" if case == "exact" else case
            spec = store.open_namespace(NamespaceSpec("smollm2-like", codec=name, **LAYOUT))
            specs[case] = spec
            data = list(
                np.frombuffer(kv_values(spec.block_bytes // 2 * CHAIN, 2), np.uint8).reshape(
                    CHAIN, -1
                )
            )

            def put(store: Store = store, ns: str = spec.ns_id, data: list = data) -> None:
                first = counters["next"]
                counters["next"] += CHAIN * 16
                keys = store.keys_for(ns, list(range(first, first + CHAIN * 16)))
                store.put(ns, keys, data)

            result = Result("kvstore", "put", "-", "host", case, spec.block_bytes, CHAIN, calls=10)
            results[case] = result
            # fill the tier first (the warm-up), so that every timed put evicts
            fill = HOST_BYTES // (CHAIN * spec.block_bytes) * 2
            series.append(Series(result, [put] * 10, warmup=lambda put=put, n=fill: [
                put() for _ in range(n)
            ]))  # fmt: skip
        interleaved_passes(series, repeat, alternate=True)
        encoded: dict[str, float] = {}
        for case, store in stores.items():
            stats = store.stats()
            host = stats.tier("host")
            ns = next(n for n in stats.namespaces if n.ns_id == specs[case].ns_id)
            codec_saving = specs[case].block_bytes - ns_encoded_bytes(specs[case])
            coded = ns.saved_bytes // codec_saving if codec_saving and case != "exact" else 0
            encoded[case] = coded / host.blocks if host and host.blocks else 0.0
        return results, encoded
    finally:
        for store in stores.values():
            store.close()


def ns_encoded_bytes(spec: NamespaceSpec) -> int:
    from kvstore.codecs import codec_of

    codec = codec_of(spec.codec, spec.dtype, spec.head_dim, spec.block_bytes)
    return spec.block_bytes if codec is None else codec.encoded_bytes


def gbps(result: Result) -> float:
    return result.batch * result.block_bytes * result.calls / result.seconds / 1e9


def p50_ms(result: Result) -> float:
    return statistics.median(result.latencies_ms) if result.latencies_ms else float("nan")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run (few accesses)")
    parser.add_argument("--report", default=str(REPORT))
    args = parser.parse_args(argv)
    accesses, repeat = (120, 2) if args.quick else (600, 8)
    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="host-coding-"))
    try:
        capacity: dict[tuple[str, bool], dict[str, float]] = {}
        for paced in (True, False):
            for case in ("exact", *CODECS):
                print(f"capacity and hits: {case}, paced={paced}", file=sys.stderr)
                capacity[case, paced] = capacity_and_hits(
                    workdir / f"cap-{case}-{paced}", case, accesses, paced
                )
        print("host hits, exact against decoded (in turns)", file=sys.stderr)
        reads = read_costs(workdir, repeat)
        print("puts while the encoder works (in turns)", file=sys.stderr)
        puts, encoded = put_costs(workdir, repeat)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    rows1 = [
        [
            case if case == "exact" else f"host coded, {case}",
            "paced" if paced else "back to back",
            f"{c['host_blocks']:.0f}",
            f"{c['host_blocks'] / capacity['exact', paced]['host_blocks']:.2f}x",
            f"{100 * c['host_share']:.0f}%",
            f"{c['disk_hits']:.0f}",
        ]
        for (case, paced), c in capacity.items()
    ]
    rows2 = [
        [
            case,
            f"{gbps(r['read']):.2f}",
            f"{p50_ms(r['read']):.2f}",
            f"{gbps(r['acquire']):.2f}",
            f"{p50_ms(r['acquire']):.2f}",
        ]
        for case, r in reads.items()
    ]
    rows3 = [
        [
            case,
            f"{p50_ms(r):.2f}",
            f"{p50_ms(r) / p50_ms(puts['exact']):.2f}",
            "-" if case == "exact" else f"{100 * encoded[case]:.0f}%",
        ]
        for case, r in puts.items()
    ]
    block = capacity["exact", True]["block_bytes"]
    took = time.monotonic() - started
    text = f"""# Host coding: capacity against decode cost

`benchmarks/host_coding.py{" --quick" if args.quick else ""}` ({took:.0f} s), \
Python {platform.python_version()}, {platform.machine()}, in process (no daemon).
Blocks of SmolLM2-135M's layout ({block:,} bytes, bfloat16), values shaped like K and V;
a {HOST_BYTES // MiB} MiB host arena. `exact`: an int8 namespace with `codec_tiers =
"disk,shared"` (today's default: its host tier exact); the others: `codec_tiers =
"host,disk,shared"` with that codec. Accuracy per codec: [codecs.md](codecs.md) (the same
encodings).

## 1. Capacity and hits

{CONVERSATIONS} conversations of {CHAIN} blocks ({CONVERSATIONS * CHAIN * block / MiB:.0f} MiB \
exact), {accesses} accesses of a random conversation (read its chain; put it when not whole),
write-back to a disk tier. Host blocks: the mean over the second half of the run.
`paced`: each access waits until the encoder is idle (an engine computes between its
reads and puts, far longer than encoding 8 blocks takes); `back to back`: no pause, the
encoder competes with the accesses for this machine's 2 cores and falls behind, and a
block it has not encoded yet takes a whole block's room.

{markdown_table(["case", "pacing", "host blocks", "vs exact", "reads served from host",
                 "blocks read from disk"], rows1)}

## 2. A host hit: exact against decoded

An {CHAIN}-block chain held in host, {repeat} rounds in turns (best pass, GB/s of blocks as
the engine has them; median per call). `read`: into the caller's buffer (an inline get);
`acquire`: pin (decoding into slots of the lease when encoded), copy out, release (an
arena get).

{markdown_table(["case", "read GB/s", "read ms", "acquire+copy GB/s", "acquire+copy ms"],
                rows2)}

## 3. Puts while the encoder works

Puts of {CHAIN} new blocks into a full host tier (no disk tier: every put evicts as many
blocks as it stores), {repeat} rounds of 10 puts in turns; median put. The last column:
host blocks encoded when the last pass ended.

{markdown_table(["case", "put ms (median)", "vs exact", "host blocks encoded"], rows3)}
"""
    print(text)
    write_program_report(args.report, text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

