"""``benchmarks/torture.py``'s readers part: many engines loading long prefixes at
once, right after a restart (issue 66).

- tenants with small host quotas read prefixes 4x their room with
  ``Namespace.windows`` at once, right after a restart (every window read from disk,
  each next one read ahead): how long until every read is whole, and what a tenant
  that only puts and gets meanwhile sees (before #66 this hung for good: the read
  threads waited on read-ahead queued to their own pool, every worker was stuck, any
  other call ran into its deadline);
- the same reads again, and a SIGTERM once the first window is back: the daemon stops
  (before #66 it did not);
- readers of long chains sharing one host room (no quotas): each gets its whole
  prefix or an error with the reason, never fewer blocks without a word (before #66
  one got 0 blocks and no error, while another's first window pinned the room).
"""

from __future__ import annotations

import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Protocol

from kvbench.servers import write_secret
from kvbench.torture_kit import TOKENS, Kvstored, block_of, tokens_of
from kvclient import KVClient
from kvclient.errors import KVStoreError

BLOCK = 256 << 10
MODEL = "readers"
CALL_TIMEOUT_S = 60.0  # each call's deadline (a wedged daemon shows as timeouts)
READS_TIMEOUT_S = 300.0  # the longest the part waits for its reads
Row = tuple[str, str, bool]


class Restartable(Protocol):
    """A kvstored child this part (or a test) stops and starts again."""

    addr: str

    def stop(self) -> int: ...

    def start(self) -> object: ...


def part_readers(work: Path, quick: bool) -> tuple[list[str], list[Row]]:
    """The section's body and rows (see the module docstring)."""
    tenants, quota_mib = (6, 16) if quick else (8, 32)
    blocks = 4 * (quota_mib << 20) // BLOCK
    body = [
        f"{tenants} tenants, host quota {quota_mib} MiB each, each reads its prefix of "
        f"{blocks} blocks of {BLOCK >> 10} KiB ({blocks * BLOCK >> 20} MiB, 4x its room) "
        "with `Namespace.windows` at once, right after a restart; a bystander tenant "
        "puts and gets 8 blocks meanwhile.",
        "",
    ]
    rows = many_tenants(work / "readers", tenants, quota_mib, blocks, body)
    rows.append(shared_room(work / "shared", quick, body))
    return body, rows


def tenants_config(folder: Path, n: int, quota_mib: int) -> tuple[Path, list[str]]:
    """A config of ``n`` tenants (t0, t1, ...) with a host quota of ``quota_mib`` each,
    and their tokens."""
    folder.mkdir(parents=True, exist_ok=True)
    tokens = [secrets.token_hex(16) for _ in range(n)]
    lines = []
    for i, token in enumerate(tokens):
        path = write_secret(folder / f"t{i}.token", token + "\n")
        lines += [f"[tenants.t{i}]", f'token_file = "{path}"', f'host_bytes = "{quota_mib} MiB"']
    config = folder / "kvstored.toml"
    config.write_text("\n".join(lines) + "\n")
    return config, tokens


def put_prefixes(addr: str, tokens: list[str], blocks: int) -> int:
    """Put prefix ``i`` (``blocks`` blocks) as the tenant of ``tokens[i]``: blocks stored."""
    stored = 0
    for i, token in enumerate(tokens):
        with KVClient(addr, token=token, timeout=CALL_TIMEOUT_S) as client:
            ns = client.namespace(MODEL, TOKENS, block_bytes=BLOCK)
            rows = [block_of(i, b, BLOCK) for b in range(blocks)]
            stored += ns.put(tokens_of(i, blocks), rows).stored
    return stored


def many_tenants(
    work: Path, tenants: int, quota_mib: int, blocks: int, body: list[str]
) -> list[Row]:
    # the last tenant: the bystander
    config, tokens = tenants_config(work, tenants + 1, quota_mib)
    daemon = Kvstored(
        work / "daemon", token=tokens[0], config=str(config),
        host_bytes=f"{(tenants + 1) * quota_mib + 16}MiB",
        disk_bytes=f"{tenants * blocks * BLOCK * 2 >> 20}MiB",
    )  # fmt: skip
    daemon.start()
    try:
        put_prefixes(daemon.addr, tokens[:-1], blocks)
        rows = [read_at_once(daemon, tokens, blocks, body)]
        rows.append(sigterm_while_reading(daemon, tokens, blocks))
    finally:
        daemon.close()
    return rows


def restart_indexed(daemon: Restartable, tokens: list[str], blocks: int) -> int:
    """SIGTERM and start again, then wait until the index (loaded behind the start)
    holds the prefix of each of ``tokens``' tenants: the exit code of the stop."""
    code = daemon.stop()
    daemon.start()
    deadline = time.monotonic() + READS_TIMEOUT_S
    for i, token in enumerate(tokens):
        with KVClient(daemon.addr, token=token, timeout=CALL_TIMEOUT_S) as client:
            ns = client.namespace(MODEL, TOKENS, block_bytes=BLOCK)
            while ns.lookup(tokens_of(i, blocks)).blocks < blocks:
                if time.monotonic() > deadline:
                    raise RuntimeError("the restarted daemon's index never held the prefixes")
                time.sleep(0.05)
    return code


class Windows:
    """Windows read so far, by all readers; ``enough`` once there are ``target``."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.seen = 0
        self.enough = threading.Event()
        self._lock = threading.Lock()

    def one(self) -> None:
        with self._lock:
            self.seen += 1
            if self.seen >= self.target:
                self.enough.set()


def read_windows(addr: str, token: str, seed: int, seen: Windows | None) -> int | str:
    """Blocks of prefix ``seed`` read window by window, each block checked, or the
    error that ended the read (its class and message); each window counted in
    ``seen``."""
    try:
        with KVClient(addr, token=token, timeout=CALL_TIMEOUT_S) as client:
            ns = client.namespace(MODEL, TOKENS, block_bytes=BLOCK)
            got = 0
            for lease in ns.windows(tokens_of(seed, 1 << 12)):
                for i, view in enumerate(lease.views):
                    if bytes(view) != block_of(seed, lease.first_block + i, BLOCK):
                        return f"wrong bytes at block {lease.first_block + i}"
                got += lease.n_blocks
                if seen is not None:
                    seen.one()
            return got
    except KVStoreError as exc:
        return f"{type(exc).__name__}: {exc}"


def bystander(addr: str, token: str, stop: threading.Event) -> tuple[list[float], list[str]]:
    """Put and get 8 blocks of a tenant that reads nothing long, over and over until
    ``stop``: each round's seconds, and the errors."""
    took: list[float] = []
    errors: list[str] = []
    with KVClient(addr, token=token, timeout=CALL_TIMEOUT_S) as client:
        ns = client.namespace(MODEL, TOKENS, block_bytes=4096)
        seed = 9000
        while not stop.is_set() and len(took) + len(errors) < 1000:
            seed += 1
            began = time.monotonic()
            try:
                ns.put(tokens_of(seed, 8), [block_of(seed, b, 4096) for b in range(8)])
                ns.get(tokens_of(seed, 8))
                took.append(time.monotonic() - began)
            except KVStoreError as exc:
                errors.append(type(exc).__name__)
    return took, errors


def read_at_once(daemon: Kvstored, tokens: list[str], blocks: int, body: list[str]) -> Row:
    restart_indexed(daemon, tokens[:-1], blocks)
    stop = threading.Event()
    with ThreadPoolExecutor(len(tokens)) as pool:
        probe = pool.submit(bystander, daemon.addr, tokens[-1], stop)
        began = time.monotonic()
        reads = [
            pool.submit(read_windows, daemon.addr, token, i, None)
            for i, token in enumerate(tokens[:-1])
        ]
        _, late = wait(reads, timeout=READS_TIMEOUT_S)
        took = time.monotonic() - began
        stop.set()
        results = [r.result() if r.done() else "still reading" for r in reads]
        rounds, errors = probe.result(timeout=CALL_TIMEOUT_S * 3)
    whole = sum(1 for r in results if r == blocks)
    worst = max(rounds, default=float("nan"))
    body += [
        f"Reads at once: {whole} of {len(results)} whole in {took:.2f} s"
        + (f" (the rest: {sorted({str(r) for r in results if r != blocks})})" if late or whole
           < len(results) else "")
        + f"; the bystander: {len(rounds)} put+get rounds, the slowest {worst * 1e3:.1f} ms, "
        f"errors {errors or 'none'}.",
        "",
    ]  # fmt: skip
    return (
        "tenants reading long prefixes at once after a restart: every read whole, "
        "another tenant's put+get answered",
        f"{whole} of {len(results)} whole in {took:.2f} s; bystander {len(rounds)} rounds, "
        f"{len(errors)} errors",
        whole == len(results) and not late and not errors and bool(rounds),
    )


def sigterm_while_reading(daemon: Kvstored, tokens: list[str], blocks: int) -> Row:
    restart_indexed(daemon, tokens[:-1], blocks)
    readers = len(tokens) - 1
    seen = Windows(readers)  # about one window each: every reader's read-ahead in flight
    with ThreadPoolExecutor(readers) as pool:
        reads = [
            pool.submit(read_windows, daemon.addr, token, i, seen)
            for i, token in enumerate(tokens[:-1])
        ]
        seen.enough.wait(10)  # (a wedged daemon: SIGTERM all the same after 10 s)
        began = time.monotonic()
        code = daemon.stop()  # SIGTERM; SIGKILL after 60 s (then -9)
        took = time.monotonic() - began
        _, late = wait(reads, timeout=CALL_TIMEOUT_S * 2)
    return (
        "SIGTERM with those reads in flight: the daemon stops",
        f"exit {code} in {took:.2f} s, after {seen.seen} windows of {readers} readers",
        code == 0 and not late,
    )


def shared_room(work: Path, quick: bool, body: list[str]) -> Row:
    """Three readers of long chains in one host room, no quotas (see the module
    docstring)."""
    host_mib = 32 if quick else 64
    sizes = [host_mib * k // 2 * (1 << 20) // BLOCK for k in (3, 4, 5)]  # 1.5x .. 2.5x
    daemon = Kvstored(work, host_bytes=f"{host_mib}MiB", disk_bytes=f"{host_mib * 12}MiB")
    daemon.start()
    try:
        with KVClient(daemon.addr, timeout=CALL_TIMEOUT_S) as client:
            ns = client.namespace(MODEL, TOKENS, block_bytes=BLOCK)
            for seed, n in enumerate(sizes, 100):
                ns.put(tokens_of(seed, n), [block_of(seed, b, BLOCK) for b in range(n)])
        with ThreadPoolExecutor(len(sizes)) as pool:
            reads = [
                pool.submit(read_windows, daemon.addr, "", seed, None)
                for seed in range(100, 100 + len(sizes))
            ]
            _, late = wait(reads, timeout=READS_TIMEOUT_S)
            results = [r.result() if r.done() else "still reading" for r in reads]
    finally:
        daemon.close()
    silent = [
        f"{r} of {n}" for r, n in zip(results, sizes, strict=True) if isinstance(r, int) and r < n
    ]
    said = [r for r in results if isinstance(r, str)]
    body += [
        f"Shared room: 3 readers of {', '.join(str(n * BLOCK >> 20) for n in sizes)} MiB "
        f"chains in one {host_mib} MiB host room, no quotas: {results}.",
        "",
    ]
    return (
        "readers sharing one host room: each whole, or an error with its reason",
        f"{sum(1 for r, n in zip(results, sizes, strict=True) if r == n)} of 3 whole, "
        f"{len(silent)} short without a word, {len(said)} errors",
        not silent and not late,
    )
