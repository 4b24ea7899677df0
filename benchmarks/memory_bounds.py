"""The daemon's memory under two client-driven loads (#66 item 3), as a program.

- ``readers``: a tenant with a 16 MiB host quota stores a 256 MiB chain (onto disk,
  window by window), then opens 10 gRPC Get streams of it, reads each to its header
  and stops reading (its channel never grows HTTP/2's 64 KiB window: ``bdp_probe``
  off). The daemon's RSS (``/proc/<pid>/status`` VmRSS) before and with the streams
  open; how many were answered and how many refused (RESOURCE_EXHAUSTED).
- ``events``: 64-byte blocks carrying 256 tokens each (1 KiB of token ids a block)
  put for ``--seconds`` into a host tier of ``--event-host-mib`` (no disk) with KV
  events on and a subscriber that never reads; RSS every 5 s, and the bytes the
  index's tokens and the event feed count when the daemon reports them.

Every setting is the daemon's default but those named, so the same program measures
an older checkout: run it with PYTHONPATH naming that checkout's source folders and
``--json before.json``, then here with ``--before before.json`` to write both into
the report.

    .venv/bin/python benchmarks/memory_bounds.py                      # ~2 minutes
    .venv/bin/python benchmarks/memory_bounds.py --quick              # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import zmq

from kvbench.harness import free_tcp_port, write_program_report
from kvbench.torture_kit import Kvstored
from kvclient import KVClient
from kvproto.v1 import kvstore_pb2 as pb
from kvproto.v1 import kvstore_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parent.parent
REPORT = REPO / "docs" / "benchmarks" / "memory-bounds.md"
MiB = 1 << 20
BLOCK, TOKENS = 256 << 10, 16  # the readers' chain
EVENT_BLOCK, EVENT_TOKENS, PUT_BLOCKS = 64, 256, 512


def rss(daemon: Kvstored) -> int:
    return daemon.rss_bytes()


def readers(work: Path, chain_mib: int, streams: int) -> dict[str, Any]:
    token = secrets.token_hex(16)
    token_file = work / "a.token"
    token_file.write_text(token + "\n")
    os.chmod(token_file, 0o600)
    config = work / "kvstored.toml"
    config.write_text(f'[tenants.a]\ntoken_file = "{token_file}"\nhost_bytes = "16 MiB"\n')
    daemon = Kvstored(
        work / "readers", token=token, host_bytes="64MiB",
        disk_bytes=f"{2 * chain_mib + 64}MiB", config=str(config),
    )  # fmt: skip
    daemon.start()
    try:
        n = chain_mib * MiB // BLOCK
        tokens = list(range(n * TOKENS))
        rows = np.random.default_rng(0).integers(0, 255, (n, BLOCK), dtype=np.uint8)
        with KVClient(daemon.addr, token=token) as client:
            ns = client.namespace("long", TOKENS, block_bytes=BLOCK)
            stored = ns.put(tokens, rows).stored
            ns_id = ns.ns_id
        del rows
        base = rss(daemon)
        channel = grpc.insecure_channel(daemon.addr, options=[("grpc.http2.bdp_probe", 0)])
        stub = pb_grpc.KVStoreStub(channel)
        request = pb.GetRequest(ns_id=ns_id, tokens=tokens)
        metadata = (("authorization", f"Bearer {token}"),)
        answered: list[Any] = []
        refused: list[str] = []
        calls = [stub.Get(request, metadata=metadata) for _ in range(streams)]

        def header(call: Any) -> None:
            try:
                answered.append(next(call).header)
            except grpc.RpcError as e:
                refused.append(f"{e.code().name}: {e.details()}")

        threads = [threading.Thread(target=header, args=(call,)) for call in calls]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        peak = rss(daemon)
        for _ in range(4):  # a while later: what stays held
            time.sleep(0.5)
            peak = max(peak, rss(daemon))
        for call in calls:
            call.cancel()
        channel.close()
        return {
            "chain_mib": chain_mib, "stored": stored, "streams": streams,
            "rss_base_mib": base / MiB, "rss_open_mib": peak / MiB,
            "grown_mib": (peak - base) / MiB, "answered": len(answered),
            "blocks_per_answer": sorted({h.n_blocks for h in answered}),
            "refused": len(refused), "refusal": refused[0] if refused else "",
        }  # fmt: skip
    finally:
        daemon.stop()
        daemon.close()


def events(work: Path, seconds: float, host_mib: int) -> dict[str, Any]:
    endpoint = f"tcp://127.0.0.1:{free_tcp_port()}"
    daemon = Kvstored(
        work / "events", host_bytes=f"{host_mib}MiB", disk_bytes=0, kv_events_listen=endpoint
    )
    daemon.start()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt_string(zmq.SUBSCRIBE, "")
    sub.connect(endpoint)  # and never reads
    samples: list[dict[str, Any]] = []
    try:
        rng = np.random.default_rng(66)
        rows = np.zeros((PUT_BLOCKS, EVENT_BLOCK), np.uint8)
        with KVClient(daemon.addr) as client:
            ns = client.namespace("tiny", EVENT_TOKENS, block_bytes=EVENT_BLOCK)
            base = rss(daemon)
            started = next_sample = time.monotonic()
            blocks = 0
            while (now := time.monotonic()) - started < seconds:
                if now >= next_sample:
                    counters = client.stats().counters
                    samples.append({
                        "t_s": round(now - started), "blocks_put": blocks,
                        "grown_mib": (rss(daemon) - base) / MiB,
                        "index_tokens_mib": counters.get("index_tokens_bytes", -MiB) / MiB,
                        "feed_mib": counters.get("kv_events_queued_bytes", -MiB) / MiB,
                    })  # fmt: skip
                    next_sample += 5
                ns.put(rng.integers(1000, 1 << 30, PUT_BLOCKS * EVENT_TOKENS), rows)
                blocks += PUT_BLOCKS
            counters = client.stats().counters
        samples.append({
            "t_s": round(time.monotonic() - started), "blocks_put": blocks,
            "grown_mib": (rss(daemon) - base) / MiB,
            "index_tokens_mib": counters.get("index_tokens_bytes", -MiB) / MiB,
            "feed_mib": counters.get("kv_events_queued_bytes", -MiB) / MiB,
        })  # fmt: skip
        return {
            "host_mib": host_mib, "seconds": seconds, "rss_base_mib": base / MiB,
            "samples": samples, "tokens_not_kept": counters.get("tokens_not_kept", -1),
        }  # fmt: skip
    finally:
        sub.close(linger=0)
        ctx.term()
        daemon.stop()
        daemon.close()


def render(after: dict[str, Any], before: dict[str, Any] | None, command: str) -> str:
    runs = [("before", before), ("after", after)] if before else [("after", after)]
    r = after["readers"]
    lines = [
        "# Memory under client-driven load",
        "",
        f"Written by `{command}` on {time.strftime('%Y-%m-%d')} ({os.cpu_count()} cores, "
        f"Python {sys.version.split()[0]}); the daemon's RSS from /proc/<pid>/status.",
        "",
        f"## {r['streams']} Get streams nobody reads",
        "",
        f"A tenant with a 16 MiB host quota stores a {r['chain_mib']} MiB chain of "
        f"{BLOCK >> 10} KiB blocks, then opens {r['streams']} gRPC Get streams of it, reads "
        "each to its header and stops (its channel never grows HTTP/2's 64 KiB window). "
        "Defaults otherwise: get_buffer_bytes 256 MiB, so this tenant's share is 128 MiB "
        "(the tenant and the admin) and a copied window 16 MiB, counted twice (the copy, "
        "and its messages queued in gRPC).",
        "",
        "| run | RSS before | RSS, streams open | grown | answered | blocks each | refused |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, run in runs:
        assert run is not None
        x = run["readers"]
        lines.append(
            f"| {name} | {x['rss_base_mib']:.0f} MiB | {x['rss_open_mib']:.0f} MiB | "
            f"+{x['grown_mib']:.0f} MiB | {x['answered']} | {x['blocks_per_answer']} | "
            f"{x['refused']} |"
        )
    if r["refusal"]:
        lines += ["", f"A refusal reads: `{r['refusal']}`"]
    e = after["events"]
    lines += [
        "",
        f"## KV events of tiny blocks, {e['seconds']:.0f} s",
        "",
        f"64-byte blocks of {EVENT_TOKENS} tokens each (1 KiB of token ids a block), "
        f"{PUT_BLOCKS} a put, into a {e['host_mib']} MiB host tier (no disk) for "
        f"{e['seconds']:.0f} s with KV events on and a subscriber that never reads. "
        "Defaults otherwise: index_tokens_bytes 64 MiB, kv_events_buffer_bytes 64 MiB "
        "(before: the feed and the kept batches 64 MiB each, counted without the Python "
        "objects' token lists). -1: not reported by that version.",
        "",
        "| run | t | blocks put | RSS grown | index tokens | feed |",
        "|---|---|---|---|---|---|",
    ]
    for name, run in runs:
        assert run is not None
        for s in run["events"]["samples"]:
            lines.append(
                f"| {name} | {s['t_s']} s | {s['blocks_put']} | +{s['grown_mib']:.0f} MiB | "
                f"{s['index_tokens_mib']:.1f} MiB | {s['feed_mib']:.1f} MiB |"
            )
    lines += [
        "",
        f"The host tier holds {e['host_mib'] * MiB // EVENT_BLOCK} such blocks; the index "
        "takes about 0.5 KiB for each besides its tokens, which is what grows until the "
        "tier is full. Blocks whose tokens passed index_tokens_bytes (their events carry "
        f"no token_ids): {e['tokens_not_kept']}.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run of both parts")
    parser.add_argument("--seconds", type=float, default=60.0, help="the events part's length")
    parser.add_argument("--event-host-mib", type=int, default=16)
    parser.add_argument("--streams", type=int, default=10)
    parser.add_argument("--chain-mib", type=int, default=256)
    parser.add_argument("--json", help="write the figures here (no report)")
    parser.add_argument("--before", help="figures of an older checkout (--json) for the report")
    parser.add_argument("--out", default=str(REPORT))
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds, args.chain_mib, args.streams = 6.0, 48, 4
    with tempfile.TemporaryDirectory(prefix="kvmem") as tmp:
        figures = {
            "readers": readers(Path(tmp), args.chain_mib, args.streams),
            "events": events(Path(tmp), args.seconds, args.event_host_mib),
        }
    print(json.dumps(figures, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
        return 0
    before = json.loads(Path(args.before).read_text()) if args.before else None
    command = "python benchmarks/memory_bounds.py" + (" --quick" if args.quick else "")
    write_program_report(args.out, render(figures, before, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
