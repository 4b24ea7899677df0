"""kvctl against a real kvstored: every command, human and --json, and its failures.

Commands run in-process through ``kvctl.cli.main(argv)`` (the console script's
entry point) with captured stdout/stderr; one test runs ``python -m kvctl`` as a
subprocess to check the exit code and the single stderr line end to end.
"""

from __future__ import annotations

import io
import json
import os
import pty
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from conftest import Daemon

from kvclient import KVClient
from kvctl.cli import main
from kvctl.views import human_bytes, render_status

BLOCK_TOKENS = 4
BLOCK_BYTES = 8 << 10
TOKENS = list(range(100, 100 + 5 * BLOCK_TOKENS))  # 5 full blocks
NAME = "ctl-bound"


@pytest.fixture(scope="module")
def daemon(kvstored_module_factory: Callable[..., Daemon]) -> Daemon:
    return kvstored_module_factory()


@pytest.fixture(scope="module")
def ns_id(daemon: Daemon) -> str:
    """A namespace (bound to NAME) holding the 5 blocks of TOKENS."""
    with KVClient(daemon.addr) as client:
        ns = client.namespace("ctl-model", BLOCK_TOKENS, BLOCK_BYTES, name=NAME)
        blocks = np.arange(5 * BLOCK_BYTES, dtype=np.uint32).astype(np.uint8).reshape(5, -1)
        assert ns.put(TOKENS, blocks).stored == 5
        return ns.ns_id


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_human_bytes() -> None:
    assert [human_bytes(n) for n in (0, 1023, 1536, 64 << 20, 3 << 30)] == [
        "0 B",
        "1023 B",
        "1.5 KiB",
        "64.0 MiB",
        "3.0 GiB",
    ]


def test_status(daemon: Daemon, ns_id: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "--addr", daemon.addr, "status")
    assert code == 0 and err == ""
    assert "platform cpu-only" in out
    assert "HIT RATE" in out and "64.0 MiB" in out  # the host tier's capacity, human
    assert [line.split()[0] for line in out.splitlines() if line[:5] in ("host ", "disk ")] == [
        "host",
        "disk",
    ]

    code, out, _ = run(capsys, "--addr", daemon.addr, "status", "--json")
    assert code == 0
    status = json.loads(out)
    assert status["platform"] == "cpu-only"
    tiers = {t["name"]: t for t in status["tiers"]}
    assert set(tiers) == {"host", "disk"}
    host = tiers["host"]
    assert host["capacity_bytes"] == 64 << 20
    assert host["blocks"] >= 5 and host["used_bytes"] >= 5 * BLOCK_BYTES
    assert all(isinstance(t[k], int) for t in tiers.values() for k in ("used_bytes", "blocks"))
    assert ns_id in [ns["ns_id"] for ns in status["namespaces"]]
    assert status["disk_fault"] == "" and "NOT TAKING WRITES" not in render_status(status)
    # a failing disk tier is one line of the status (tests/test_faults.py makes one)
    failing = render_status({**status, "disk_fault": "Error: No space left on device"})
    assert "disk tier NOT TAKING WRITES: Error: No space left on device" in failing


def test_ls(daemon: Daemon, ns_id: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--addr", daemon.addr, "ls")
    assert code == 0
    row = next(line for line in out.splitlines() if line.startswith(ns_id))
    assert NAME in row and "40.0 KiB" in row  # 5 blocks of 8 KiB

    code, out, _ = run(capsys, "--addr", daemon.addr, "ls", "--json")
    assert code == 0
    listed = {ns["ns_id"]: ns for ns in json.loads(out)["namespaces"]}
    assert listed[ns_id]["blocks"] == 5 and listed[ns_id]["bytes"] == 5 * BLOCK_BYTES
    assert listed[ns_id]["name"] == NAME


def test_lookup(daemon: Daemon, ns_id: str, tmp_path: Path, capsys) -> None:
    # tokens on the command line: 3 blocks asked, all cached
    argv = ["--addr", daemon.addr, "lookup", ns_id, *map(str, TOKENS[:13])]
    code, out, _ = run(capsys, *argv)
    assert code == 0
    assert out.strip() == (
        f"{ns_id}: 12 of 13 tokens cached (3 of 3 blocks: 3 host, 0 disk); the last 1 "
        "tokens are not a full block of 4 (never cached)"
    )
    # fewer tokens than a block: it says so, in lookup and in why
    for command, said in (("lookup", "0 of 3 tokens cached"), ("why", "no full block to serve")):
        code, out, _ = run(capsys, "--addr", daemon.addr, command, ns_id, "1", "2", "3")
        assert code == 0
        assert said in out and out.strip().endswith(
            "3 tokens are less than one block of 4: only full blocks are cached"
        ), out

    # tokens from a file, by bound name; the prompt diverges in block 4
    token_file = tmp_path / "prompt.txt"
    token_file.write_text(" ".join(map(str, TOKENS[:16])) + "\n 9 9 9 9\n")
    code, out, _ = run(
        capsys, "--addr", daemon.addr, "lookup", NAME, "--file", str(token_file), "--json"
    )
    assert code == 0
    result = json.loads(out)
    assert result["ns_id"] == ns_id
    assert (result["tokens"], result["blocks"], result["request_blocks"]) == (16, 4, 5)
    assert (result["host_blocks"], result["disk_blocks"], result["pending_blocks"]) == (4, 0, 0)


def test_lookup_takes_what_ls_shows_and_lists_the_candidates(
    daemon: Daemon, ns_id: str, capsys
) -> None:
    tokens = [str(t) for t in TOKENS[:8]]
    for given in (ns_id, NAME, "ctl-model", ns_id[:12]):  # id, name, model, id prefix
        code, out, err = run(capsys, "lookup", given, *tokens, "--addr", daemon.addr)
        assert (code, err) == (0, ""), given
        assert out.startswith(f"{ns_id}: 8 of 8 tokens cached"), out

    code, out, err = run(capsys, "--addr", daemon.addr, "lookup", "no-such-model", "1")
    assert code == 2 and out == ""
    assert err.splitlines() == [
        f"kvctl: error: no namespace 'no-such-model'; there are: {ns_id} ({NAME}, ctl-model) "
        "(see kvctl ls)"
    ]
    # two namespaces of one model: the model alone is ambiguous, and says which to pick
    with KVClient(daemon.addr) as client:
        twin = client.namespace("ctl-model", BLOCK_TOKENS * 2, BLOCK_BYTES * 2)
    code, _, err = run(capsys, "--addr", daemon.addr, "lookup", "ctl-model", "1")
    assert code == 2 and len(err.splitlines()) == 1
    assert "matches 2 namespaces" in err and ns_id in err and twin.ns_id in err


def test_lookup_failures(daemon: Daemon, ns_id: str, capsys) -> None:

    code, _, err = run(capsys, "--addr", daemon.addr, "lookup", ns_id)  # no tokens
    assert code == 2 and "no tokens" in err
    code, _, err = run(capsys, "--addr", daemon.addr, "lookup", ns_id, "1", "x")
    assert code == 2 and "integers" in err
    code, _, err = run(capsys, "--addr", daemon.addr, "lookup", ns_id, "--file", "/nonexistent")
    assert code == 2 and "cannot read" in err


def test_events_count_is_a_tail_of_the_newest(daemon: Daemon, ns_id: str, capsys) -> None:
    # without --count the stream follows: --duration ends it after the buffered events
    code, out, _ = run(capsys, "--addr", daemon.addr, "events", "--duration", "0.5", "--json")
    buffered = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and len(buffered) >= 5

    code, out, _ = run(capsys, "--addr", daemon.addr, "events", "--count", "3", "--json")
    assert code == 0
    assert [json.loads(line) for line in out.splitlines()] == buffered[-3:]

    # two more blocks: the tail moves to them, and text lines name the namespace
    with KVClient(daemon.addr) as client:
        more = client.namespace("ctl-events", BLOCK_TOKENS, BLOCK_BYTES)
        more.put(TOKENS[:8], np.ones((2, BLOCK_BYTES), np.uint8))
    code, out, _ = run(capsys, "events", "--count", "2", "--addr", daemon.addr)
    lines = out.splitlines()
    assert code == 0 and len(lines) == 2
    assert all(" stored " in line and more.ns_id in line for line in lines)
    assert int(lines[0].split()[0]) == buffered[-1]["seq"] + 1

    # filters pick the last N of what matches, however old
    code, out, _ = run(
        capsys, "--addr", daemon.addr, "events", "--count", "2", "--ns", ns_id, "--json"
    )
    assert [json.loads(line) for line in out.splitlines()] == [
        e for e in buffered if e["ns_id"] == ns_id
    ][-2:]
    # --from bounds the tail from below
    code, out, _ = run(
        capsys, "--addr", daemon.addr, "events", "--from", "2", "--count", "50", "--json"
    )
    assert [json.loads(line)["seq"] for line in out.splitlines()][0] == 3
    # --follow prints the tail, then what comes after it
    code, out, _ = run(
        capsys, "--addr", daemon.addr, "events", "--count", "1", "--follow", "--duration", "0.3"
    )
    assert code == 0 and len(out.splitlines()) == 1
    assert main(["--addr", daemon.addr, "events", "--follow"]) == 2  # needs --count

    # --duration ends a stream that has nothing more to say
    code, out, _ = run(
        capsys, "--addr", daemon.addr, "events", "--from", "1000000", "--duration", "0.3"
    )
    assert code == 0 and out == ""


def test_top_prints_once_when_not_a_tty(daemon: Daemon, ns_id: str, capsys) -> None:
    for argv in (["top", "--once"], ["top", "--interval", "0.1"]):  # stdout is captured
        code, out, _ = run(capsys, "--addr", daemon.addr, *argv)
        assert code == 0
        assert "TIER" in out and "NAMESPACE" in out and ns_id in out
        assert "\x1b[" not in out  # no terminal control codes outside a TTY
    code, out, _ = run(capsys, "--addr", daemon.addr, "top", "--once", "--json")
    assert code == 0 and {t["name"] for t in json.loads(out)["tiers"]} == {"host", "disk"}


@pytest.mark.parametrize("sigint", ["default", "ignored"])
def test_top_redraws_on_a_tty_and_restores_it_on_ctrl_c(
    daemon: Daemon, ns_id: str, sigint: str
) -> None:
    # "ignored": started as a background job is, with SIGINT ignored (nohup, `cmd &`)
    ignore = sigint == "ignored"
    master, slave = pty.openpty()
    env = {**os.environ, "COLUMNS": "120", "LINES": "30"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvctl", "--addr", daemon.addr, "top", "--interval", "0.1"],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=env,
        start_new_session=True,
        preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignore else None,
    )
    os.close(slave)
    try:
        seen = read_pty_until(master, lambda text: text.count("TIER") >= 2, timeout=30)
        assert seen.startswith(ENTER_SCREEN)  # alternate screen, cursor hidden
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
        seen += read_pty_until(master, lambda text: False, timeout=5)
    finally:
        proc.kill()
        proc.wait()
        os.close(master)
    assert seen.endswith(LEAVE_SCREEN)  # cursor shown, main screen back
    assert "Traceback" not in seen


ENTER_SCREEN = "\x1b[?1049h\x1b[?25l"
LEAVE_SCREEN = "\x1b[?25h\x1b[?1049l"


def read_pty_until(fd: int, done: Callable[[str], bool], timeout: float) -> str:
    """What the program wrote to its terminal, until ``done(text)``, EOF or the timeout."""
    text = ""
    deadline = time.monotonic() + timeout
    while not done(text) and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.1)
        if not ready:
            continue
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: the program closed the terminal
            break
        if not chunk:
            break
        text += chunk.decode(errors="replace")
    return text


def test_clear(daemon: Daemon, ns_id: str, capsys) -> None:
    code, _, err = run(capsys, "--addr", daemon.addr, "clear", "--ns", ns_id)
    assert code == 2 and "--yes" in err
    with KVClient(daemon.addr) as client:
        other = client.namespace("ctl-other", BLOCK_TOKENS, BLOCK_BYTES)
        other.put(TOKENS[:4], np.zeros((1, BLOCK_BYTES), np.uint8))

    code, out, _ = run(capsys, "--addr", daemon.addr, "clear", "--ns", ns_id, "--yes")
    assert (code, out) == (0, "removed 5 blocks\n")
    code, out, _ = run(capsys, "--addr", daemon.addr, "ls", "--json")
    blocks = {ns["ns_id"]: ns["blocks"] for ns in json.loads(out)["namespaces"]}
    assert blocks[ns_id] == 0 and blocks[other.ns_id] == 1

    code, out, _ = run(capsys, "--addr", daemon.addr, "clear", "--yes")
    assert (code, out) == (0, f"removed {sum(blocks.values())} blocks\n")
    code, out, _ = run(capsys, "--addr", daemon.addr, "ls", "--json")
    assert all(ns["blocks"] == 0 for ns in json.loads(out)["namespaces"])


@pytest.mark.parametrize(
    "argv",
    [
        ["status"],
        ["status", "--json"],
        ["ls"],
        ["top", "--once"],
        ["lookup", "m@0", "1"],
        ["events", "--count", "1"],
        ["clear", "--yes"],
    ],
)
def test_unreachable_daemon_is_one_line_and_exit_1(tmp_path: Path, argv: list[str], capsys) -> None:
    addr = str(tmp_path / "nobody.sock")
    code, out, err = run(capsys, "--addr", addr, *argv)
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith("kvctl: cannot reach kvstored at ")
    assert addr in err


def test_kvctl_as_a_program(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the address comes from $KVSTORE_ADDR when --addr is not given
    monkeypatch.setenv("KVSTORE_ADDR", str(tmp_path / "nobody.sock"))
    proc = subprocess.run(
        [sys.executable, "-m", "kvctl", "status"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        f"kvctl: cannot reach kvstored at unix://{tmp_path}/nobody.sock: No such file or directory"
    ]


def test_addr_and_timeout_go_before_or_after_the_command(
    daemon: Daemon, tmp_path: Path, capsys
) -> None:
    for argv in (
        ["--addr", daemon.addr, "status", "--json"],
        ["status", "--json", "--addr", daemon.addr],
        ["status", "--addr", daemon.addr, "--timeout", "5", "--json"],
        ["--addr", str(tmp_path / "nobody.sock"), "status", "--addr", daemon.addr, "--json"],
    ):
        code, out, err = run(capsys, *argv)
        assert (code, err) == (0, ""), argv
        assert json.loads(out)["addr"] == daemon.addr
    code, _, err = run(capsys, "ls", "--addr", str(tmp_path / "nobody.sock"))
    assert code == 1 and "nobody.sock" in err


def test_usage_errors(capsys) -> None:
    assert main([]) == 2
    assert main(["status", "--bogus"]) == 2
    assert main(["--addr", "/x", "top", "--interval", "0"]) == 2
    assert main(["--help"]) == 0
    capsys.readouterr()


FORGED = "\x1b]0;x\x07\x1b[2J\nforged"  # a window title, a clear screen and a new row
FORGED_SHOWN = "\\x1b]0;x\\x07\\x1b[2J\\nforged"


def test_client_chosen_strings_are_printed_escaped(
    kvstored_module_factory: Callable[..., Daemon], capsys
) -> None:
    """A client names its model with terminal escapes and a newline: every command that
    prints it (ls, events, lookup, why, top, and the one line of a usage error) shows
    them escaped, never a raw control byte or a forged row; --json escapes as JSON."""
    daemon = kvstored_module_factory()  # a daemon of its own: the others list namespaces
    with KVClient(daemon.addr) as client:
        ns = client.namespace(FORGED, BLOCK_TOKENS, BLOCK_BYTES)
        ns.put(TOKENS[:8], np.ones((2, BLOCK_BYTES), np.uint8))
        c1 = client.namespace("c1\x9b31m\u202ered", BLOCK_TOKENS, BLOCK_BYTES)  # C1 CSI, bidi
        c1.put(TOKENS[:4], np.ones((1, BLOCK_BYTES), np.uint8))
    tokens = [str(t) for t in TOKENS[:8]]
    for argv in (
        ["ls"],
        ["events", "--count", "2"],
        ["lookup", ns.ns_id, *tokens],
        ["why", ns.ns_id, *tokens, "9", "9", "9", "9"],
        ["top", "--once"],
    ):
        code, out, err = run(capsys, "--addr", daemon.addr, *argv)
        assert (code, err) == (0, ""), argv
        assert FORGED_SHOWN in out, (argv, out)
        printed = out.replace("\n", "")  # (the rows' own line ends)
        assert not [c for c in printed if ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F], (argv, out)
        assert not any(line.startswith("forged") for line in out.splitlines()), argv
    code, out, _ = run(capsys, "--addr", daemon.addr, "ls")
    assert "c1\\x9b31m\\u202ered" in out and "\u202e" not in out
    code, out, _ = run(capsys, "--addr", daemon.addr, "ls", "--json")
    assert {ns["model"] for ns in json.loads(out)["namespaces"]} == {FORGED, "c1\x9b31m\u202ered"}
    assert "\x1b" not in out and "\x9b" not in out
    # a usage error lists the namespaces there are: one line, escaped
    code, out, err = run(capsys, "--addr", daemon.addr, "lookup", "no-such-model", "1")
    assert code == 2 and len(err.splitlines()) == 1 and FORGED_SHOWN in err
    assert "\x1b" not in err and "\x07" not in err


# -- text: lookup and why tokenize a prompt with the model's tokenizer -------------------

TEXT = (
    "A prompt that was computed before is loaded from kvstore, not computed again: "
    "its first blocks come from the host arena, the rest from the disk tier."
)
MORE = " Then the prompt goes on with words that no request has sent before."
TEXT_NAME = "ctl-text"
SERVED = "smollm2-chat"


def smollm2_tokens(model_dir: Path, text: str, chat: bool = False) -> list[int]:
    """The token ids vLLM would compute for ``text`` (a completion, or one user
    message of a chat request, the chat template applied)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    if not chat:
        return list(tokenizer(text).input_ids)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


@pytest.fixture(scope="module")
def text_ns(daemon: Daemon, smollm2_dir: Path) -> tuple[str, list[int], list[int]]:
    """A namespace bound to TEXT_NAME that records its served model (SERVED) and its
    tokenizer (the SmolLM2 directory), holding the full blocks of TEXT tokenized as a
    completion and as a chat message -> (ns_id, the two token lists)."""
    prompt, chat = smollm2_tokens(smollm2_dir, TEXT), smollm2_tokens(smollm2_dir, TEXT, True)
    with KVClient(daemon.addr) as client:
        ns = client.namespace("smol-weights", BLOCK_TOKENS, BLOCK_BYTES, name=TEXT_NAME,
                              served_model=SERVED, tokenizer=str(smollm2_dir))  # fmt: skip
        for tokens in (prompt, chat):
            n = len(tokens) // BLOCK_TOKENS
            stored = ns.put(tokens[: n * BLOCK_TOKENS], np.ones((n, BLOCK_BYTES), np.uint8))
            assert stored.stored == n
        return ns.ns_id, prompt, chat


def test_lookup_and_why_take_text_tokenized_by_the_namespaces_tokenizer(
    daemon: Daemon, text_ns: tuple[str, list[int], list[int]], smollm2_dir: Path,
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys,
) -> None:  # fmt: skip
    ns_id, prompt, chat = text_ns
    blocks = len(prompt) // BLOCK_TOKENS
    # --text, the namespace by its bound name, the tokenizer the namespace names
    code, out, err = run(capsys, "--addr", daemon.addr, "lookup", TEXT_NAME, "--text", TEXT,
                         "--json")  # fmt: skip
    assert (code, err) == (0, "")
    found = json.loads(out)
    assert (found["ns_id"], found["request_tokens"]) == (ns_id, len(prompt))
    assert (found["blocks"], found["tokens"]) == (blocks, blocks * BLOCK_TOKENS)
    # the same text from a file and from stdin
    text_file = tmp_path / "prompt.txt"
    text_file.write_text(TEXT)
    code, out, _ = run(capsys, "--addr", daemon.addr, "lookup", TEXT_NAME, "--text-file",
                       str(text_file), "--json")  # fmt: skip
    assert code == 0 and json.loads(out) == found
    monkeypatch.setattr(sys, "stdin", io.StringIO(TEXT))
    code, out, _ = run(capsys, "--addr", daemon.addr, "lookup", TEXT_NAME, "--text-file", "-",
                       "--json")  # fmt: skip
    assert code == 0 and json.loads(out) == found
    # why, by the served model's name: served whole; the prompt that goes on misses
    # at the first block past the stored ones, never stored
    code, out, err = run(capsys, "--addr", daemon.addr, "why", SERVED, "--text", TEXT)
    assert (code, err) == (0, "") and out.startswith(f"{ns_id}: all {blocks} blocks are served")
    longer = smollm2_tokens(smollm2_dir, TEXT + MORE)
    assert longer[: len(prompt)] == prompt and len(longer) // BLOCK_TOKENS > blocks + 1
    code, out, _ = run(capsys, "--addr", daemon.addr, "why", SERVED, "--text", TEXT + MORE,
                       "--json")  # fmt: skip
    missed = json.loads(out)
    assert code == 0 and (missed["block"], missed["reason"]) == (blocks, "never_stored")
    assert missed["request_tokens"] == len(longer)
    code, out, _ = run(capsys, "--addr", daemon.addr, "why", SERVED, "--text", TEXT + MORE)
    assert out.strip().startswith(f"{ns_id}: block {blocks} of {len(longer) // BLOCK_TOKENS}: "
                                  "never stored")  # fmt: skip
    # --chat: the chat template around one user message, as a chat request's prompt
    code, out, _ = run(capsys, "--addr", daemon.addr, "lookup", TEXT_NAME, "--text", TEXT,
                       "--chat", "--json")  # fmt: skip
    found = json.loads(out)
    assert code == 0 and found["request_tokens"] == len(chat) != len(prompt)
    assert found["blocks"] == len(chat) // BLOCK_TOKENS
    # --model: a namespace that names no tokenizer takes one from the command line
    code, out, err = run(capsys, "--addr", daemon.addr, "lookup", NAME, "--text", TEXT,
                         "--model", str(smollm2_dir), "--json")  # fmt: skip
    assert (code, err) == (0, "") and json.loads(out)["request_tokens"] == len(prompt)


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["lookup", TEXT_NAME, "1", "2", "--text", TEXT], "token ids or --text"),
        (["lookup", TEXT_NAME, "--file", "/dev/null", "--text", TEXT], "token ids or --text"),
        (["lookup", TEXT_NAME, "--text", TEXT, "--text-file", "/dev/null"],
         "--text or --text-file"),
        (["why", TEXT_NAME, "--text-file", "/nonexistent/prompt.txt"],
         "cannot read /nonexistent/prompt.txt"),
        (["lookup", NAME, "--text", TEXT], "no tokenizer for namespace"),
        (["lookup", TEXT_NAME, "--text", TEXT, "--model", "/nonexistent/model"],
         "cannot load the tokenizer of /nonexistent/model"),
        (["lookup", TEXT_NAME, "1", "2", "--chat"], "--chat and --model go with --text"),
        (["lookup", TEXT_NAME, "--text", ""], "the text is empty"),
    ],
)
def test_text_errors_are_one_line(
    daemon: Daemon, ns_id: str, text_ns: tuple[str, list[int], list[int]], argv: list[str],
    said: str, capsys,
) -> None:  # fmt: skip
    code, out, err = run(capsys, "--addr", daemon.addr, *argv)
    assert code == 2 and out == "" and len(err.splitlines()) == 1, err
    assert err.startswith("kvctl: error: ") and said in err, err


def test_kvctl_imports_transformers_only_for_text(
    daemon: Daemon, text_ns: tuple[str, list[int], list[int]]
) -> None:
    ns_id, prompt, _ = text_ns
    script = (
        "import sys\nfrom kvctl.cli import main\n"
        f"assert main(['--addr', {daemon.addr!r}, 'lookup', {ns_id!r}, '1', '2', '3', '4']) == 0\n"
        "assert 'transformers' not in sys.modules, 'imported for token ids'\n"
        f"assert main(['--addr', {daemon.addr!r}, 'lookup', {ns_id!r}, '--text', {TEXT!r}]) == 0\n"
        "assert 'transformers' in sys.modules\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert f"of {len(prompt)} tokens cached" in proc.stdout


def test_namespaces_show_the_served_model_beside_the_weights_id(
    daemon: Daemon, text_ns: tuple[str, list[int], list[int]], smollm2_dir: Path, capsys
) -> None:
    ns_id, _, _ = text_ns
    code, out, _ = run(capsys, "--addr", daemon.addr, "ls")
    header = out.splitlines()[0].split()
    assert header[:4] == ["NAMESPACE", "NAME", "MODEL", "SERVED"], header
    row = next(line for line in out.splitlines() if line.startswith(ns_id)).split()
    assert row[:4] == [ns_id, TEXT_NAME, "smol-weights", SERVED]
    for argv, listed in ((["ls", "--json"], "namespaces"), (["status", "--json"], "namespaces")):
        code, out, _ = run(capsys, "--addr", daemon.addr, *argv)
        ns = {n["ns_id"]: n for n in json.loads(out)[listed]}[ns_id]
        assert (ns["served_model"], ns["tokenizer"]) == (SERVED, str(smollm2_dir)), argv
    code, out, _ = run(capsys, "--addr", daemon.addr, "top", "--once")
    assert SERVED in next(line for line in out.splitlines() if line.startswith(ns_id))
    # the served model is a label, not identity: the same layout under another served
    # name (or none) is the same namespace, and its bound name still opens it; the
    # newest name declared is the one shown
    with KVClient(daemon.addr) as client:
        assert client.namespace("smol-weights", BLOCK_TOKENS, BLOCK_BYTES).ns_id == ns_id
        other = client.namespace("smol-weights", BLOCK_TOKENS, BLOCK_BYTES, name=TEXT_NAME,
                                 served_model="smollm2-other")  # fmt: skip
        assert other.ns_id == ns_id and other.info.served_model == "smollm2-other"
        assert other.info.tokenizer == str(smollm2_dir)  # not declared: kept
        again = client.namespace("smol-weights", BLOCK_TOKENS, BLOCK_BYTES, name=TEXT_NAME,
                                 served_model=SERVED)  # fmt: skip
        assert again.info.served_model == SERVED
        assert client.open_namespace(ns_id).info.served_model == SERVED
