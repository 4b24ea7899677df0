"""``benchmarks/torture.py``'s hostile-tenant part: one kvstored with tenants a and b,
and what a, the attacker, does to b.

Each attack is one row: what a tried, what came of it, and whether b (and the daemon)
held. a reads, clears and watches b's namespace by its id; uses a lease id of b's it
learned; parks more waiting lookups than the daemon has threads; churns events past
the ring; opens namespaces without end; sends large calls without a token and calls
with guessed tokens; truncates the arena region it was handed; holds more local-call
connections than its share; floods the KV event replay socket with malformed
requests and oversized messages; asks ``why`` over a long prompt with hundreds of
namespaces of its own. Every call goes over the daemon's real sockets.
"""

from __future__ import annotations

import functools
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from kvbench.servers import write_secret
from kvbench.torture_kit import (
    Kvstored,
    block_of,
    closed_by_peer,
    send_oversized_subscription,
    tokens_of,
)
from kvclient import KVClient
from kvclient.arena_path import map_handed_out
from kvclient.errors import KVStoreError
from kvproto.v1 import kvstore_pb2 as pb
from kvproto.v1.kvstore_pb2_grpc import KVStoreStub

BLOCK = 4096
EVENT_BUFFER = 64
MAX_NAMESPACES = 400  # tenant_max_namespaces (a opens 300 of them for `why` first)
PARKED = 70  # more than the daemon's waiting threads (kvstored.dispatch.WAIT_THREADS)
CONNECTIONS = 16  # max_connections_per_user of the attacked daemon
WHY_NAMESPACES = 300
WHY_BLOCKS = 4096
REGION = 8 << 20  # each tenant's host quota: its own arena region
Row = tuple[str, str, bool]


def write_config(folder: Path) -> tuple[Path, dict[str, str]]:
    """A config with tenants a and b, each with a host quota (its own arena region),
    and their token files (mode 0600)."""
    tokens = {who: secrets.token_hex(16) for who in ("a", "b")}
    lines = []
    for who, token in tokens.items():
        path = write_secret(folder / f"{who}.token", token)
        lines += [f"[tenants.{who}]", f'token_file = "{path}"', f'host_bytes = "{REGION}"']
    config = folder / "kvstored.toml"
    config.write_text("\n".join(lines) + "\n")
    return config, tokens


def code_of(call: Callable[[], Any]) -> str:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code().name  # type: ignore[no-any-return]
    except KVStoreError as exc:
        return exc.code.name if exc.code is not None else type(exc).__name__
    return "OK"


def run_attacks(daemon: Kvstored, tokens: dict[str, str]) -> list[Row]:
    stub = KVStoreStub(grpc.insecure_channel(daemon.addr))
    as_a = (("authorization", f"Bearer {tokens['a']}"),)
    rows: list[Row] = []
    with KVClient(daemon.addr, token=tokens["a"], use_arena=False) as a, KVClient(
        daemon.addr, token=tokens["b"], use_arena=False
    ) as b:
        ns_a = a.namespace("hostile", block_tokens=4, block_bytes=BLOCK)
        ns_b = b.namespace("hostile", block_tokens=4, block_bytes=BLOCK)
        mine = tokens_of(1, 4)
        ns_b.put(mine, [block_of(1, i, BLOCK) for i in range(4)])

        # b's namespace by its id
        codes = {
            "Lookup": code_of(lambda: stub.Lookup(
                pb.LookupRequest(ns_id=ns_b.ns_id, tokens=mine), metadata=as_a, timeout=10)),
            "Clear": code_of(lambda: stub.Clear(
                pb.ClearRequest(ns_id=ns_b.ns_id), metadata=as_a, timeout=10)),
            "DescribeNamespace": code_of(lambda: stub.DescribeNamespace(
                pb.DescribeNamespaceRequest(ns_id=ns_b.ns_id), metadata=as_a, timeout=10)),
        }  # fmt: skip
        whole = ns_b.get(mine).n_blocks == 4
        seen = ", ".join(f"{k} {v}" for k, v in codes.items())
        rows.append((
            "a reads, clears and describes b's namespace by its id",
            f"{seen}; b's blocks {'whole' if whole else 'HIT'}",
            set(codes.values()) == {"NOT_FOUND"} and whole,
        ))  # fmt: skip

        # a lease id of b's
        claim = ns_b.claim(tokens_of(2, 2))
        lease_codes = {
            name: code_of(functools.partial(
                getattr(stub, name), getattr(pb, f"{name}Request")(lease_id=claim.lease_id),
                metadata=as_a, timeout=10,
            ))
            for name in ("Commit", "Abandon", "Release")
        }  # fmt: skip
        filled = claim.fill([block_of(2, i, BLOCK) for i in range(2)]) == 2
        rows.append((
            "a commits, abandons and releases a lease id of b's",
            ", ".join(f"{k} {v}" for k, v in lease_codes.items())
            + f"; b's claim {'filled as b wrote it' if filled else 'BROKEN'}",
            set(lease_codes.values()) == {"FAILED_PRECONDITION"} and filled,
        ))  # fmt: skip

        rows.append(map_the_arena(daemon, tokens["a"], ns_a, mine))
        rows.append(starve(stub, as_a, ns_a, ns_b))
        rows.append(churn_events(a, b, ns_a, ns_b))

        rows.append(ask_why(a, ns_a, ns_b, mine))
        opened, refused = len(a.namespaces()), ""
        while not refused and opened < 2 * MAX_NAMESPACES:
            code = code_of(functools.partial(a.namespace, f"flood-{opened}", 4, BLOCK))
            opened += code == "OK"
            refused = "" if code == "OK" else code
        b_opens = code_of(lambda: b.namespace("after-the-flood", 4, BLOCK))
        rows.append((
            "a opens namespaces without end",
            f"{refused} after {opened} (tenant_max_namespaces={MAX_NAMESPACES}); b opens {b_opens}",
            refused == "RESOURCE_EXHAUSTED" and opened == MAX_NAMESPACES and b_opens == "OK",
        ))  # fmt: skip
        rows.append(truncate_region(daemon, tokens["a"], ns_b, mine))
        rows.append(hold_connections(daemon, ns_b, mine))
    rows.append(flood_events(daemon))
    rows.append(tokenless(daemon))
    rows.append(guess_tokens(daemon, stub))
    return rows


def truncate_region(daemon: Kvstored, token: str, ns_b: Any, b_tokens: list[int]) -> Row:
    """a shrinks (and grows) the memfd of its region that the daemon handed it: the
    seals refuse both, where a shrink made the daemon's next touch a SIGBUS."""
    import os

    from kvproto.v1.arena_handout import fetch_region

    with KVClient(daemon.addr, token=token, use_arena=True) as a:
        info = a.server_info()
    fd, _ = fetch_region(info.arena_socket, token, 10, info.uid)
    refused = []
    for size in (0, 1 << 30):
        try:
            os.ftruncate(fd, size)
            refused.append("DONE")
        except PermissionError:
            refused.append("refused")
    os.close(fd)
    whole = ns_b.get(b_tokens).n_blocks == 4
    return (
        "a truncates (and grows) its region's memfd",
        f"shrink {refused[0]}, grow {refused[1]}; b's blocks {'whole' if whole else 'LOST'}",
        refused == ["refused", "refused"] and whole and daemon.alive(),
    )


def hold_connections(daemon: Kvstored, ns_b: Any, b_tokens: list[int]) -> Row:
    """a opens local-call connections past max_connections_per_user and sends nothing:
    the one past the cap is closed at once, the idle ones after PRE_AUTH_S."""
    import socket

    from kvstored.local_calls import PRE_AUTH_S

    with KVClient(daemon.addr, token=daemon.token) as probe:
        path = probe.server_info().local_socket
    held = []
    for _ in range(CONNECTIONS + 1):
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(path)
        held.append(sock)

    # (the probe's own connection may count for this user: the last one or two closed)
    over = closed_by_peer(held[-1], 10)
    started = time.monotonic()
    idle = sum(closed_by_peer(sock, PRE_AUTH_S + 20) for sock in held[:-2])
    after = time.monotonic() - started
    for sock in held:
        sock.close()
    whole = ns_b.get(b_tokens).n_blocks == 4
    return (
        f"a holds {CONNECTIONS + 1} idle local-call connections "
        f"(max_connections_per_user={CONNECTIONS})",
        f"the one past the cap {'closed at once' if over else 'KEPT'}; {idle} of "
        f"{CONNECTIONS - 1} tokenless ones closed within {after:.0f} s; b served",
        over and idle == CONNECTIONS - 1 and whole,
    )


def ask_why(a: KVClient, ns_a: Any, ns_b: Any, b_tokens: list[int]) -> Row:
    """a asks why a long prompt misses, with hundreds of namespaces of its own: the
    walk is a's own and bounded; b's put and get meanwhile."""
    for i in range(WHY_NAMESPACES):
        a.namespace(f"why-{i}", block_tokens=4, block_bytes=BLOCK)
    prompt = tokens_of(7, WHY_BLOCKS)
    started = time.monotonic()
    reason = ns_a.why(prompt)
    took = time.monotonic() - started
    b_started = time.monotonic()
    ns_b.put(tokens_of(8, 2), [block_of(8, i, BLOCK) for i in range(2)])
    served = ns_b.get(tokens_of(8, 2)).n_blocks == 2
    b_took = time.monotonic() - b_started
    return (
        f"a asks why a {WHY_BLOCKS}-block prompt misses, with {WHY_NAMESPACES} namespaces",
        f"answered ({reason.reason}) in {took * 1000:.0f} ms; b's put and get after it "
        f"{b_took * 1000:.1f} ms",
        served and took < 5.0,
    )


def flood_events(daemon: Kvstored) -> Row:
    """Anyone who reaches the KV event sockets: 500 malformed replay requests, 20
    replay requests from each of 20 peers that never read, an 8 MiB subscription
    message (from a process of its own: libzmq crashes the sender's context after the
    daemon drops it). The daemon logs one line per kind and stops in time."""
    import zmq

    pub, rep = daemon.settings["kv_events_listen"], daemon.settings["kv_events_replay_listen"]
    ctx = zmq.Context()
    sockets = []
    try:
        bad = ctx.socket(zmq.DEALER)
        sockets.append(bad)
        bad.connect(rep)
        for _ in range(500):
            bad.send_multipart((b"", b"not a seq"))
        for _ in range(20):
            peer = ctx.socket(zmq.DEALER)
            sockets.append(peer)
            peer.connect(rep)
            for _ in range(20):
                peer.send_multipart((b"", (0).to_bytes(8, "big")))
        send_oversized_subscription(pub, 8 << 20)
        time.sleep(1.0)  # (the publisher reads requests every 20 ms)
    finally:
        for sock in sockets:
            sock.close(linger=0)
        ctx.term()
    lines = sum("replay request" in line for line in daemon.text().splitlines())
    rss = daemon.rss_bytes()
    return (
        "anyone floods the KV event sockets (500 malformed replays, 20 peers x 20 "
        "replays unread, an 8 MiB subscription)",
        f"{lines} log lines; the daemon's RSS {rss / 2**20:.0f} MiB; it goes on",
        lines <= 3 and daemon.alive(),
    )


def map_the_arena(daemon: Kvstored, token: str, ns_a: Any, b_tokens: list[int]) -> Row:
    """a maps what the daemon hands it for its token: its own region, which holds a's
    blocks and none of b's (b's first block's bytes, put before, are looked for)."""
    ns_a.put(tokens_of(3, 2), [block_of(3, i, BLOCK) for i in range(2)])
    with KVClient(daemon.addr, token=token, use_arena=True) as a:
        info = a.server_info()
    mapped, _ = map_handed_out(info.arena_socket, token, 10, info.uid, writable=False)
    length = mapped.size - mapped.start
    seen = mapped.array()[mapped.start :].tobytes()
    mapped.close()
    own = seen.find(block_of(3, 0, BLOCK)) >= 0
    theirs = seen.find(block_of(1, 0, BLOCK)[:64]) >= 0
    return (
        "a maps the arena the daemon hands it",
        f"a region of {length >> 20} MiB by fd ({info.arena_path.partition('/')[0]}/...): "
        f"a's blocks {'there' if own else 'MISSING'}, b's {'FOUND' if theirs else 'absent'}",
        own and not theirs and info.arena_path.startswith("fd:"),
    )


def starve(stub: KVStoreStub, as_a: Any, ns_a: Any, ns_b: Any) -> Row:
    """a parks PARKED waits on a claim of its own; b's waiting lookup must still be
    answered within a second of b's fill."""
    hold = ns_a.claim(tokens_of(3, 2))
    parked = [
        stub.Lookup.future(
            pb.LookupRequest(ns_id=ns_a.ns_id, tokens=tokens_of(3, 2), wait_pending_s=60),
            metadata=as_a,
        )
        for _ in range(PARKED)
    ]
    theirs = ns_b.claim(tokens_of(3, 2))
    out: list[Any] = []
    waiting = threading.Thread(
        target=lambda: out.append(ns_b.lookup(tokens_of(3, 2), wait_pending_s=30))
    )
    waiting.start()
    deadline = time.monotonic() + 10
    while not any(f.done() for f in parked) and time.monotonic() < deadline:
        time.sleep(0.01)  # a's waits past its share are answered at once
    theirs.fill([block_of(3, i, BLOCK) for i in range(2)])
    filled = time.monotonic()
    waiting.join(30)
    answered = time.monotonic() - filled
    hold.abandon()
    for future in parked:
        future.result(timeout=30)
    ok = bool(out) and out[0].blocks == 2 and answered < 1.0
    return (
        f"a parks {PARKED} waiting lookups on a block of its own",
        f"b's waiting lookup answered {answered * 1000:.0f} ms after b's fill",
        ok,
    )


def churn_events(a: KVClient, b: KVClient, ns_a: Any, ns_b: Any) -> Row:
    """a puts 3 rings' worth of blocks: b's events stay whole, a's numbers do not count
    b's blocks."""
    seq_b = b.stats().counters["event_seq"]
    seq_a = a.stats().counters["event_seq"]
    ns_b.put(tokens_of(4, 2), [block_of(4, i, BLOCK) for i in range(2)])
    moved = a.stats().counters["event_seq"] - seq_a
    for chain in range(3 * EVENT_BUFFER // 4):
        ns_a.put(tokens_of(100 + chain, 4), [block_of(chain, i, BLOCK) for i in range(4)])
    kept = [e for e in b.events(from_seq=seq_b, duration_s=0.5)]
    ok = moved == 0 and len(kept) == 2 and [e.seq for e in kept] == [seq_b + 1, seq_b + 2]
    return (
        f"a churns {3 * EVENT_BUFFER} events (event_buffer={EVENT_BUFFER})",
        f"b's 2 events kept ({len(kept)}), a's event numbers moved by b's puts: {moved}",
        ok,
    )


def tokenless(daemon: Kvstored) -> Row:
    lookup = grpc.insecure_channel(
        daemon.addr, options=[("grpc.max_send_message_length", 64 << 20)]
    ).unary_unary("/kvstore.v1.KVStore/Lookup")
    codes = set()
    baseline = 0
    for size in (16, *[32 << 20] * 10):
        codes.add(code_of(functools.partial(lookup, bytes(size), timeout=60)))
        baseline = baseline or daemon.rss_bytes()
    grown = daemon.rss_bytes() - baseline
    return (
        "10 calls of 32 MiB without a token",
        f"{', '.join(sorted(codes))}; the daemon's RSS grew {grown / 2**20:.1f} MiB",
        codes == {"UNAUTHENTICATED"} and grown < 32 << 20,
    )


def guess_tokens(daemon: Kvstored, stub: KVStoreStub) -> Row:
    guess = (("authorization", "Bearer " + "0" * 32),)
    held = calls = 0
    codes = set()
    while held < 5 and calls < 200:
        started = time.monotonic()
        codes.add(code_of(lambda: stub.Stats(pb.StatsRequest(), metadata=guess, timeout=10)))
        held += time.monotonic() - started >= 0.1
        calls += 1
    lines = sum("refused for a" in line for line in daemon.text().splitlines())
    return (
        "a guesses tokens",
        f"{calls} guesses: {', '.join(sorted(codes))}, {held} held back, {lines} log lines",
        codes == {"UNAUTHENTICATED"} and held == 5 and 1 <= lines < 5,
    )


def part_tenants(work: Path, quick: bool) -> tuple[list[str], list[tuple[str, str, bool]]]:
    """The part's body and its checks (torture.py wraps them in a Section)."""
    folder = work / "tenants"
    folder.mkdir(parents=True, exist_ok=True)
    config, tokens = write_config(folder)
    daemon = Kvstored(
        folder, token=tokens["b"], config=str(config), tenant_max_namespaces=MAX_NAMESPACES,
        event_buffer=EVENT_BUFFER, max_connections_per_user=CONNECTIONS,
        kv_events_listen=f"ipc://{folder}/events", kv_events_replay_listen=f"ipc://{folder}/replay",
    )  # fmt: skip
    try:
        daemon.start()
        rows = run_attacks(daemon, tokens)
        code = daemon.stop()
    finally:
        daemon.close()
    body = ["| attack (tenant a) | what came of it | b and the daemon held |", "|---|---|---|"]
    body += [f"| {what} | {seen} | {'yes' if ok else '**NO**'} |" for what, seen, ok in rows]
    body += ["", f"One daemon with tenants a and b on its unix socket, each with a host quota "
             f"(its own arena region); exit code at stop {code}. Tenant isolation between "
             "processes of one user is not claimed: they can open the arena file and the "
             "daemon's descriptors (docs/operations/tenants.md); tests/test_tenants.py checks a "
             "process of another user."]
    held = all(ok for _, _, ok in rows) and code == 0
    failed = [what for what, _, ok in rows if not ok]
    return body, [(
        "a hostile tenant neither reads, breaks, starves nor follows another",
        "every attack held" if held else f"failed: {'; '.join(failed) or f'exit {code}'}",
        held,
    )]
