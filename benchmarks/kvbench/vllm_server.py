"""vLLM's OpenAI-compatible server started by the documented CPU line, as written.

The line (``python -m vllm.entrypoints.openai.api_server ...`` with the variables it
sets before it) is read from the docs site's vLLM quickstart
(:func:`kvbench.documents.bash_lines`), so what the tests and benchmarks run is what a
user runs; only the real model's directory (the line's ``$(...)``),
loopback and a port are filled in. The server runs in its own process group and is
stopped with all of it (its engine core is a child).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvbench.documents import bash_lines
from kvbench.harness import free_tcp_port
from kvbench.vllm_chat import ENGINE_ENV

START_TIMEOUT_S = 400
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
MODEL_ARG = "$(.venv/bin/python -m kvclient.smollm2)"


def readme_server_command(model: Path) -> tuple[list[str], dict[str, str]]:
    """The documented CPU server line (docs/quickstart/vllm-server.md), with ``model``
    for its ``$(...)``; and the variables the line sets before the command."""
    line = next(c for c in bash_lines() if SERVER_MODULE in c)
    args = shlex.split(line)
    env = {}
    while "=" in args[0]:
        name, _, value = args.pop(0).partition("=")
        env[name] = value
    if args[0] != ".venv/bin/python" or MODEL_ARG not in args:
        raise ValueError(f"the documented server line changed shape: {line}")
    args[0] = sys.executable
    args[args.index(MODEL_ARG)] = str(model)
    return args, env


def without_connector(command: list[str]) -> list[str]:
    """The server line less its ``--kv-transfer-config`` (vLLM alone)."""
    at = command.index("--kv-transfer-config")
    return command[:at] + command[at + 2 :]


class Server:
    """The README's server on loopback; ``addr``: the kvstored its connector reaches.

    ``prefix_caching=False`` turns vLLM's own prefix cache off (every cached token then
    came through kvstore); ``connector=False`` runs vLLM alone; ``readme_env=False``
    leaves out the variables the README's line sets (what a user who drops them
    gets)."""

    def __init__(
        self,
        model: Path,
        addr: str,
        log: Path,
        *,
        prefix_caching: bool = True,
        connector: bool = True,
        readme_env: bool = True,
        kv_transfer: dict[str, Any] | None = None,
        kv_cache_bytes: str | None = None,
        env_of: Callable[[dict[str, str]], dict[str, str]] | None = None,
    ) -> None:
        """``kv_transfer``: another connector's ``--kv-transfer-config`` in place of the
        README's; ``kv_cache_bytes``: vLLM's KV cache size in place of the README's;
        ``env_of``: makes the server's environment from the one it would have."""
        self.port = free_tcp_port()
        command, line_env = readme_server_command(model)
        if not connector:
            command = without_connector(command)
        elif kv_transfer is not None:
            at = command.index("--kv-transfer-config")
            command[at + 1] = json.dumps(kv_transfer)
        if kv_cache_bytes is not None:
            command[command.index("--kv-cache-memory-bytes") + 1] = kv_cache_bytes
        command += [
            "--host", "127.0.0.1", "--port", str(self.port), "--served-model-name", "smollm2",
            "--seed", "0",
        ]  # fmt: skip
        if not prefix_caching:
            command.append("--no-enable-prefix-caching")
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE")}
        env.update(ENGINE_ENV, KVSTORE_ADDR=addr)  # the reference engine's threads
        del env["VLLM_ENABLE_V1_MULTIPROCESSING"]  # the server's own engine process
        del env["VLLM_CPU_KVCACHE_SPACE"]  # the README's --kv-cache-memory-bytes sizes it
        del env["VLLM_CPU_NUM_OF_RESERVED_CPU"]  # the README's line sets it
        if readme_env:
            env.update(line_env)
        if env_of is not None:
            env = env_of(env)
        self.log = log
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"vLLM's server did not start:\n{log.read_text()[-4000:]}")
            time.sleep(0.5)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

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

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
