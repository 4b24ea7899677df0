"""``kvctl why``: one test per reason a prompt misses, each with the exact line printed.

One daemon with two tenants (``a`` with quotas, ``b`` without), a 1 MiB block, an
8 MiB host tier and a 16 MiB disk tier: floods of a few blocks evict. kvctl runs
in-process (``kvctl.cli.main``) with the tenant's token file.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import Daemon, damage_in_disk_file, write_secret

from kvclient import KVClient, Namespace
from kvclient.errors import OutOfSpaceError
from kvctl.cli import main as kvctl

BLOCK = 1 << 20
BLOCK_TOKENS = 4
WAIT_S = 30


@pytest.fixture(scope="module")
def daemon(
    kvstored_module_factory: Callable[..., Daemon], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Daemon, dict[str, Path]]]:
    folder = tmp_path_factory.mktemp("why")
    files = {}
    for who in ("a", "b"):
        files[who] = folder / f"{who}.token"
        write_secret(files[who], secrets.token_hex(16))
    config = folder / "kvstored.toml"
    config.write_text(
        f'[tenants.a]\ntoken_file = "{files["a"]}"\nhost_bytes = "2 MiB"\ndisk_bytes = "2 MiB"\n'
        f'[tenants.b]\ntoken_file = "{files["b"]}"\n'
    )
    yield (
        kvstored_module_factory(
            extra_args=("--config", str(config)), host_bytes="8MiB", disk_bytes="16MiB"
        ),
        files,
    )


def tokens(seed: int, blocks: int = 1) -> list[int]:
    return [seed * 1000 + i for i in range(blocks * BLOCK_TOKENS)]


def block(seed: int) -> bytes:
    return secrets.token_bytes(32) * (BLOCK // 32) if seed < 0 else bytes([seed % 251]) * BLOCK


def why(
    daemon: Daemon, token_file: Path, ns_id: str, prompt: list[int], capsys: Any
) -> tuple[str, dict[str, Any]]:
    """``kvctl why`` -> (the line it prints, what --json prints)."""
    args = ["--addr", daemon.addr, "--token-file", str(token_file), "why", ns_id]
    args += [str(t) for t in prompt]
    assert kvctl([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert kvctl(args) == 0
    return capsys.readouterr().out.rstrip("\n"), data


def wait_why(daemon: Daemon, token_file: Path, ns_id: str, prompt: list[int], capsys: Any,
             reason: str) -> tuple[str, dict[str, Any]]:  # fmt: skip
    deadline = time.monotonic() + WAIT_S
    while True:
        line, data = why(daemon, token_file, ns_id, prompt, capsys)
        if data["reason"] == reason:
            return line, data
        assert time.monotonic() < deadline, f"still {data}"
        time.sleep(0.05)


def stamp(data: dict[str, Any]) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(data["when"]))


def client_of(daemon: Daemon, token_file: Path) -> KVClient:
    return KVClient(daemon.addr, token=token_file.read_text())


def namespace(client: KVClient, model: str = "why-model", **layout: Any) -> Namespace:
    return client.namespace(model, BLOCK_TOKENS, BLOCK, **layout)


def flood(ns: Namespace, first_seed: int, n: int) -> None:
    for seed in range(first_seed, first_seed + n):
        ns.put(tokens(seed), [block(seed)])


def test_served_and_never_stored(daemon: tuple[Daemon, dict[str, Path]], capsys: Any) -> None:
    d, files = daemon
    with client_of(d, files["b"]) as client:
        ns = namespace(client)
        ns.put(tokens(1, 2), [block(1), block(2)])
    line, _ = why(d, files["b"], ns.ns_id, tokens(1, 2), capsys)
    assert line == f"{ns.ns_id}: all 2 blocks are served"
    line, _ = why(d, files["b"], ns.ns_id, tokens(1, 2) + tokens(99), capsys)
    assert line == (
        f"{ns.ns_id}: block 2 of 3: never stored (or lost before the daemon's memory of losses)"
    )


def test_pending_on_another_writer(daemon: tuple[Daemon, dict[str, Path]], capsys: Any) -> None:
    d, files = daemon
    with client_of(d, files["b"]) as client:
        ns = namespace(client)
        claim = ns.claim(tokens(3))
        try:
            line, _ = why(d, files["b"], ns.ns_id, tokens(3), capsys)
            assert line == f"{ns.ns_id}: block 0 of 1: pending, another writer is computing it"
        finally:
            claim.abandon()


def test_ttl_deleted_and_other_namespace(
    daemon: tuple[Daemon, dict[str, Path]], capsys: Any
) -> None:
    d, files = daemon
    with client_of(d, files["b"]) as client:
        ns = namespace(client)
        ns.claim(tokens(4), ttl_s=0.2)  # never committed: the lease runs out
        line, data = wait_why(d, files["b"], ns.ns_id, tokens(4), capsys, "lost")
        assert line == (
            f"{ns.ns_id}: block 0 of 1: dropped before its commit: its writer's lease ran "
            f"out (ttl), at {stamp(data)}"
        )
        ns.put(tokens(5), [block(5)])
        ns.delete(tokens(5))
        line, data = why(d, files["b"], ns.ns_id, tokens(5), capsys)
        assert line == f"{ns.ns_id}: block 0 of 1: removed by a Delete or Clear, at {stamp(data)}"
        # the engine stored it as float16; this client asks for bfloat16
        other = namespace(client, dtype="float16")
        other.put(tokens(6), [block(6)])
        line, _ = why(d, files["b"], ns.ns_id, tokens(6), capsys)
        assert line == (
            f"{ns.ns_id}: block 0 of 1: stored under another namespace, {other.ns_id} "
            "(differs in dtype)"
        )


def test_corrupt_then_evicted_by_priority(
    daemon: tuple[Daemon, dict[str, Path]], capsys: Any
) -> None:
    d, files = daemon
    with client_of(d, files["b"]) as client:
        ns = namespace(client)
        payload = block(-1)  # unique bytes, to be found in the disk file
        ns.put(tokens(7), [payload])
        flood(ns, 100, 8)  # the host tier's 8 MiB: the block goes to disk
        deadline = time.monotonic() + WAIT_S
        while True:
            hit = ns.lookup(tokens(7))
            if hit.disk_blocks == 1 and payload in Path(d.disk_dir, "data.mdb").read_bytes():
                break
            assert time.monotonic() < deadline, f"never written to disk alone: {hit}"
            time.sleep(0.05)
        damage_in_disk_file(d.disk_dir, payload)
        assert ns.get(tokens(7)).n_blocks == 0
        line, data = why(d, files["b"], ns.ns_id, tokens(7), capsys)
        assert line == (
            f"{ns.ns_id}: block 0 of 1: dropped from disk: its record failed the checksum, "
            f"at {stamp(data)}"
        )
        ns.put(tokens(8), [block(8)])
        flood(ns, 200, 30)  # more than both tiers hold
        line, data = wait_why(d, files["b"], ns.ns_id, tokens(8), capsys, "lost")
        assert line == (
            f"{ns.ns_id}: block 0 of 1: evicted from disk by leaf-first priority (lowest "
            f"priority, then least recently used), at {stamp(data)}"
        )


def test_evicted_by_its_tenants_quota(daemon: tuple[Daemon, dict[str, Path]], capsys: Any) -> None:
    d, files = daemon
    with client_of(d, files["a"]) as client:
        ns = namespace(client)
        ns.put(tokens(9), [block(9)])
        flood(ns, 300, 5)  # a's quotas: 2 MiB in each tier
        line, data = wait_why(d, files["a"], ns.ns_id, tokens(9), capsys, "lost")
        assert line == (
            f"{ns.ns_id}: block 0 of 1: evicted from disk: its tenant was at its disk quota, "
            f"at {stamp(data)}"
        )


def test_explains_past_a_callers_share_are_refused(
    daemon: tuple[Daemon, dict[str, Path]],
) -> None:
    """Eight connections of tenant b ask why a prompt of 8,192 blocks misses, again and
    again, while tenant a puts and gets: explains run one at a time on a thread of their
    own, and a caller past its share of the queue (8 slots over 3 callers: 2) is refused
    with RESOURCE_EXHAUSTED at once, instead of taking the threads a's calls need."""
    d, files = daemon
    prompt = list(range(500_000, 500_000 + 8192 * BLOCK_TOKENS))
    refused: list[str] = []
    answered: list[str] = []
    stop = threading.Event()

    def ask() -> None:
        with client_of(d, files["b"]) as client:
            ns = namespace(client)
            while not stop.is_set():
                try:
                    answered.append(ns.why(prompt).reason)
                except OutOfSpaceError as exc:
                    refused.append(str(exc))
                    stop.set()

    askers = [threading.Thread(target=ask) for _ in range(8)]
    for asker in askers:
        asker.start()
    try:
        with client_of(d, files["a"]) as client:
            ns = namespace(client)
            seed = 10_000
            # a's calls go on while b's explains are under way, until one is refused
            while not stop.wait(0.01) and seed < 10_000 + 1000:
                ns.put(tokens(seed), [block(seed)])
                assert ns.get(tokens(seed)).n_blocks == 1
                seed += 1
    finally:
        stop.set()
        for asker in askers:
            asker.join(WAIT_S)
    assert refused, f"no explain was refused ({len(answered)} answered)"
    assert "too many explains at once: at most 2 per caller" in refused[0]
    assert set(answered) <= {"never_stored"}
    with client_of(d, files["b"]) as client:  # and once they are done, b asks again
        assert namespace(client).why(prompt).reason == "never_stored"
