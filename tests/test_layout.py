"""The code layout the design card promises: each top-level folder holds the package
of its name, and the client imports nothing of the daemon."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import kvbench
import kvclient
import kvproto
import kvstore
import kvstored

REPO = Path(__file__).resolve().parent.parent


def test_each_package_lives_in_the_folder_of_its_name() -> None:
    for package, folder in (
        (kvstore, "kvstore"),
        (kvstored, "daemon/kvstored"),
        (kvclient, "client/kvclient"),
        (kvproto, "proto/kvproto"),
        (kvbench, "benchmarks/kvbench"),
    ):
        assert Path(package.__file__).resolve().parent == REPO / folder, package.__name__


def test_the_client_imports_nothing_of_the_daemon() -> None:
    """Every module of kvclient imported in a fresh process: no kvstored module loads,
    nor the disk tier's engine (kvstore.disk: its writer thread and LMDB handling; the
    client reads the format alone, kvstore.disk_format)."""
    modules = sorted(
        f"kvclient.{p.stem}" for p in (REPO / "client" / "kvclient").glob("*.py")
        if p.stem not in ("__main__", "vllm", "hf", "gpu")  # need torch / vllm, below
    )
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        "for name in ('kvclient.hf', 'kvclient.gpu', 'kvclient.vllm'):\n"
        "    try: importlib.import_module(name)\n"
        "    except ImportError: pass\n"
        "print(sorted(m for m in sys.modules\n"
        "             if m.split('.')[0] == 'kvstored' or m == 'kvstore.disk'))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == "[]"
