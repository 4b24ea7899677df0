"""Two checkouts of this repository measured in turns (``--before`` of the A/B
programs): a process runs one checkout's code when ``PYTHONPATH`` names that
checkout's packages and it runs from the checkout (``python -m`` and a script put the
working directory or the script's folder first on the path)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

PACKAGES = ("client", "daemon", "proto", ".", "benchmarks")  # folders holding packages


def pythonpath(tree: Path) -> str:
    """``PYTHONPATH`` for a process that runs checkout ``tree``'s packages."""
    return os.pathsep.join(str(tree / p) for p in PACKAGES)


def checkout_env(tree: Path) -> dict[str, str]:
    """This process's environment with ``PYTHONPATH`` naming ``tree``'s packages."""
    return {**os.environ, "PYTHONPATH": pythonpath(tree)}


def run_worker(script: Path, tree: Path, args: list[str]) -> Any:
    """Run ``script --worker *args`` on checkout ``tree``'s packages, from ``tree``
    -> the JSON of the last line it prints."""
    done = subprocess.run(
        [sys.executable, str(script), "--worker", *args],
        cwd=tree, env=checkout_env(tree), check=True, capture_output=True, text=True,
    )  # fmt: skip
    return json.loads(done.stdout.splitlines()[-1])
