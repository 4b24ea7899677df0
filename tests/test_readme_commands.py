"""Every command in README.md, in the docs site's pages and in the examples' docstrings
runs as written.

The commands are extracted from the documents (:mod:`kvbench.documents`), not copied
here, so a page that gains a command this test does not know how to run fails it.
Each runs the way a new user would run it after the quick start: ``kvstored`` with no
arguments (its default socket under a temporary ``XDG_RUNTIME_DIR``), then the kvctl
commands, the documents' Python snippets and the examples against it. Two kinds are
checked by an equivalent instead of being run: installs (pip's resolver in a fresh
venv, ``--dry-run``: that the examples' install step picks the CPU build of torch) and
``vllm serve`` (its connector config is the one the vLLM connector's tests run);
``kvctl bench --quick`` runs in test_bench_smoke.py. Placeholders (``NAMESPACE``,
``MODEL``) are filled in.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbench import documents

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
CHAT_BLOCK_TOKENS = 16  # examples/chat_reuse.py --block-tokens default
# the runnable examples (examples/daemon_check.py is a helper they import)
EXAMPLES = sorted(p for p in (REPO / "examples").glob("*.py") if "__main__" in p.read_text())
BIN = Path(sys.executable).parent
NOT_RUN = {  # command prefix -> why it is not run here
    "python examples/vllm_reuse.py --model meta-llama/": "downloads an 8B model",
    # (tests/test_vllm_connector.py runs the router over two daemons' events)
    "python examples/prefix_router.py": "needs daemons that publish KV events at its addresses",
}


def readme_commands() -> list[str]:
    """Lines of the README's and the docs pages' ```bash blocks, comments stripped."""
    return documents.bash_lines()


VLLM_CLIENT = "# the OpenAI-compatible server above"  # test_vllm_serve.py runs that one


def readme_python_snippets() -> list[str]:
    """The README's and the docs pages' ```python blocks."""
    return documents.fenced_blocks("python")


def docstring_commands() -> list[str]:
    commands = []
    for script in EXAMPLES:
        for line in script.read_text().split('"""')[1].splitlines():
            line = re.sub(r"\s+#\s.*$", "", line).strip()
            if line.startswith("python examples/"):
                commands.append(line)
    return commands


def test_the_documents_have_the_commands_this_test_runs() -> None:
    commands = readme_commands()
    assert any(c.endswith(".venv/bin/kvstored") for c in commands)
    assert any(c.startswith("kvctl ") for c in commands)
    assert any("examples/" in c for c in commands)
    assert len(docstring_commands()) >= 3 * len(EXAMPLES) - 1


def test_the_readme_test_command_is_what_ci_runs() -> None:
    """The README's "Run the tests" line (and the install page's copy) is .ci/run's,
    and it builds the docs site strictly before the tests."""
    test_commands = {c for c in readme_commands() if "pytest" in c}
    ci = (REPO / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert test_commands == {ci}
    assert ".venv/bin/mkdocs build --strict && " in ci


def test_the_docs_site_reference_is_made_from_the_config_table_and_the_proto() -> None:
    """The site's reference pages come from kvstored.config.KEYS and the .proto files
    at every build (scripts/docs_reference.py, an mkdocs hook): every key, flag,
    environment variable, service, method and message is on them."""
    pytest.importorskip("mkdocs")
    from kvproto.v1 import gpu_pb2, kvstore_pb2
    from kvstored.config import KEYS

    spec = importlib.util.spec_from_file_location("docs_reference",
                                                  REPO / "scripts" / "docs_reference.py")
    assert spec is not None and spec.loader is not None
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    config = hook.config_page()
    for key in KEYS:
        assert f"| `{key.name}` | `{key.flag}` | `{key.env}` |" in config, key.name
    proto = hook.proto_page()
    for module in (kvstore_pb2, gpu_pb2):
        for service in module.DESCRIPTOR.services_by_name.values():
            assert f"### service {service.full_name}" in proto
            for method in service.methods:
                assert f"| `{method.name}` |" in proto, method.full_name
        for message in module.DESCRIPTOR.message_types_by_name.values():
            assert f"### {message.name}\n" in proto, message.name
    # a field's comment is on its row (NamespaceSpec.hash_algorithm's trailing comment)
    assert '| `hash_algorithm` | 11 | string | "sha256" \\| "xxh3-128" |' in proto
    # the operator's manual is deploy/README.md itself, its links into docs/ kept
    deploy = hook.deploy_page()
    assert "## Metrics" in deploy and "](../README.md" not in deploy


def test_the_examples_install_step_picks_the_cpu_build_of_torch(tmp_path: Path) -> None:
    """pip's own resolver, in a fresh venv, on the README's install line (dry run)."""
    steps = [c for c in readme_commands() if "'.[hf]'" in c and "pip install" in c]
    assert len(steps) == 1, steps
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    report = tmp_path / "report.json"
    args = shlex.split(steps[0])
    assert args[:2] == [".venv/bin/pip", "install"]
    proc = subprocess.run(
        [str(BIN / "pip"), "--python", str(venv / "bin" / "python"), "install", "--dry-run",
         "-q", "--report", str(report), *args[2:]],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    chosen = {p["metadata"]["name"]: p["metadata"]["version"]
              for p in json.loads(report.read_text())["install"]}
    assert chosen["torch"].startswith("2.13.0"), chosen["torch"]
    assert chosen["transformers"].startswith("5.19."), chosen["transformers"]  # as tested
    cuda = sorted(name for name in chosen if name.startswith("nvidia-"))
    assert not cuda, f"the CPU install step pulls CUDA libraries: {cuda}"


# -- a user's session: the daemon on its defaults, then every command -------------------


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """``kvstored`` as the quick start runs it, in a sandboxed home; -> the env to use."""
    home = tmp_path_factory.mktemp("home")
    run_dir = Path(os.path.realpath("/tmp")) / f"kvrc{os.getpid()}"  # socket path limit
    run_dir.mkdir(mode=0o700)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("KVSTORED_", "KVSTORE_ADDR"))}
    env.update(XDG_RUNTIME_DIR=str(run_dir), XDG_DATA_HOME=str(home / "data"),
               PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}")
    quick_starts = {c for c in readme_commands() if c.endswith("kvstored")}
    assert len(quick_starts) == 1, quick_starts  # the README's and the install page's
    daemon_cmd = quick_starts.pop().rsplit("&&", 1)[1].split()  # after the install steps
    assert daemon_cmd == [".venv/bin/kvstored"]
    log = open(home / "kvstored.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([str(BIN / "kvstored")], env=env, stdout=log,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    sock = run_dir / "kvstore" / "kvstored.sock"
    deadline = time.monotonic() + 60
    while not sock.exists():
        assert proc.poll() is None, (home / "kvstored.log").read_text()
        assert time.monotonic() < deadline, "kvstored did not start"
        time.sleep(0.1)
    time.sleep(0.5)
    try:
        yield env
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()
        shutil.rmtree(run_dir, ignore_errors=True)


def run(command: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    args = shlex.split(command)
    if args[0].startswith(".venv/bin/"):
        args[0] = str(BIN / args[0][len(".venv/bin/") :])
    elif args[0] in ("python", "python3"):
        args[0] = sys.executable
    return subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def test_readme_python_snippet_and_kvctl_commands_run_as_written(
    session: dict[str, str],
) -> None:
    snippets = [s for s in readme_python_snippets()
                if "..." not in s and not s.startswith(VLLM_CLIENT)]  # not sketches
    assert snippets, "the README's client example is gone"
    for snippet in snippets:
        proc = subprocess.run([sys.executable, "-c", snippet], cwd=REPO, env=session,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"{snippet}\n{proc.stderr[-3000:]}"

    ran = 0
    for command in readme_commands():
        if command == "source .venv/bin/activate":
            assert (BIN / "activate").exists()
            continue
        if not command.startswith("kvctl ") or command.startswith("kvctl bench"):
            continue
        command = command.replace("NAMESPACE", "llama-3-8b")  # the snippet's model
        proc = run(command, session)
        assert proc.returncode == 0, f"{command}: {proc.stderr}"
        assert proc.stdout.strip(), command
        ran += 1
    assert ran >= 7


def test_vllm_serve_line_names_the_connector_the_tests_run() -> None:
    """The GPU line (``vllm serve``) and the CPU line (the server module, which
    test_vllm_serve.py starts as written) carry one connector config."""
    lines = [c for c in readme_commands()
             if c.startswith("vllm serve") or "vllm.entrypoints.openai.api_server" in c]
    assert len(lines) == 2 and lines[0].startswith("vllm serve"), lines
    for line in lines:
        args = shlex.split(line)
        while "=" in args[0]:  # VAR=value before the command
            args.pop(0)
        config = json.loads(args[args.index("--kv-transfer-config") + 1])
        assert config == {"kv_connector": "KVStoreConnector",
                          "kv_connector_module_path": "kvclient.vllm", "kv_role": "kv_both"}
    # the engines of tests/test_vllm_connector.py run with this config (and extras)
    spec = importlib.util.spec_from_file_location("vllm_engine", REPO / "benchmarks" /
                                                  "vllm_engine.py")
    assert spec is not None and spec.loader is not None
    engine = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(engine)
    tested = engine.transfer_config("kvstore", {})
    assert {k: v for k, v in tested.items() if k != "kv_connector_extra_config"} == config


def example_commands() -> list[str]:
    """The examples' command lines, each once (the README's ``.venv/bin/python
    examples/x.py`` is the docstring's ``python examples/x.py``)."""
    readme = [c for c in readme_commands() if "examples/" in c and "pip" not in c]
    once: dict[str, str] = {}
    for command in readme + docstring_commands():
        once.setdefault(command.removeprefix(".venv/bin/"), command)
    return list(once.values())


@pytest.mark.slow
@pytest.mark.parametrize("command", example_commands())
def test_example_commands_run_as_written(command: str, session: dict[str, str]) -> None:
    pytest.importorskip("torch")
    for prefix, why in NOT_RUN.items():
        if command.startswith(prefix):
            pytest.skip(f"not run here: {why}")
    if "vllm_reuse" in command:
        pytest.importorskip("vllm")
    addr = f"unix://{session['XDG_RUNTIME_DIR']}/kvstore/kvstored.sock"
    command = command.replace("unix:///tmp/kv.sock", addr)  # the docstrings' example path
    proc = run(command, session, timeout=600)
    assert proc.returncode == 0, f"{command}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert proc.stdout.strip()
    if "chat_reuse.py" in command:  # each turn reuses the whole previous turn
        turns = [
            tuple(map(int, m))
            for m in re.findall(r"turn \d+: prompt (\d+) tokens, reused (\d+), computed (\d+)",
                                proc.stdout)
        ]  # fmt: skip
        assert len(turns) >= 2, proc.stdout
        for (prompt, _, _), (next_prompt, reused, computed) in zip(turns, turns[1:], strict=False):
            assert reused + computed == next_prompt
            assert reused >= prompt // CHAT_BLOCK_TOKENS * CHAT_BLOCK_TOKENS, proc.stdout


def test_an_example_without_a_daemon_says_so_in_one_line(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    env = {**os.environ, "KVSTORE_ADDR": f"unix://{tmp_path}/nobody.sock"}
    scripts = ("chat_reuse.py", "cag.py")
    running = [  # both at once: most of their time is importing torch
        subprocess.Popen([sys.executable, str(REPO / "examples" / script), "--small"],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for script in scripts
    ]  # fmt: skip
    for script, child in zip(scripts, running, strict=True):
        stdout, stderr = child.communicate(timeout=120)
        proc = subprocess.CompletedProcess(child.args, child.returncode, stdout, stderr)
        assert proc.returncode == 1 and proc.stdout == ""
        assert proc.stderr.splitlines() == [proc.stderr.strip()], proc.stderr
        assert proc.stderr.startswith(f"{script}: no kvstored to talk to (")
        assert "start one with `kvstored`" in proc.stderr


# the distribution's name; nothing is published under it on a package index (yet)
DISTRIBUTION = re.compile(r"""^["']?kvstore[-_]offload\b""")


def index_installs(text: str) -> list[str]:
    """Lines of ``text`` that install kvstore by its distribution's name, which pip
    would look up on a package index (a wheel file, ``dist/kvstore_offload-*.whl``,
    or a checkout's path is not such a name)."""
    found = []
    for line in text.splitlines():
        if re.search(r"\binstall\b", line) and any(
            DISTRIBUTION.match(word) and not word.rstrip("\"'`").endswith(".whl")
            for word in re.split(r"[\s`]+", line)
        ):
            found.append(line.strip())
    return found


def test_no_document_installs_kvstore_from_a_package_index() -> None:
    """Nothing is published as ``kvstore-offload`` (#69 item 2: a newcomer's ``pip
    install kvstore-offload`` failed): the README, the docs site and deploy/ install a
    wheel built from the checkout, or the checkout itself, or build the image from it."""
    assert index_installs("RUN pip install kvstore-offload==0.1.0")  # what it finds
    assert not index_installs("pip install dist/kvstore_offload-0.1.0-cp311-linux.whl")
    documents = [README, *(p for p in sorted((REPO / "docs").rglob("*.md"))
                           if p.name != "changelog.md")]  # fmt: skip
    documents += [p for p in sorted((REPO / "deploy").rglob("*")) if p.is_file()]
    promised = {str(p.relative_to(REPO)): index_installs(p.read_text()) for p in documents}
    assert not {p: lines for p, lines in promised.items() if lines}


def test_the_docs_stand_on_their_own() -> None:
    """Every relative link in the docs points into this repository; the design notes
    send the reader to no file outside it; the license and type marker ship."""
    docs = [README, REPO / "deploy" / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    for doc in docs:
        for target in re.findall(r"\]\(([^)#\s]+)", doc.read_text()):
            if "://" in target:
                continue
            assert (doc.parent / target).exists(), f"{doc.name} links to missing {target}"
    design = (REPO / "docs" / "design.md").read_text()
    assert "shared/DESIGN.md" not in design and "the seed" not in design
    # a page left for text to come is not a page: the site ships none
    unfinished = [doc.name for doc in docs if "to be filled in" in doc.read_text().lower()]
    assert not unfinished, f"placeholders in {unfinished}"
    assert "Apache License" in (REPO / "LICENSE").read_text()
    assert (REPO / "proto" / "kvproto" / "py.typed").exists()
