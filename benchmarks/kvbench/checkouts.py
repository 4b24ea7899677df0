"""Two checkouts of this repository measured in turns (``--before`` of the A/B
programs): a process runs one checkout's code when ``PYTHONPATH`` names that
checkout's packages and it runs from the checkout (``python -m`` and a script put the
working directory or the script's folder first on the path)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
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


def add_arguments(parser: argparse.ArgumentParser, repo: Path) -> None:
    """The A/B programs' checkout options: ``--before`` (the old checkout), ``--after``
    (default: ``repo``, this one) and the labels their reports print."""
    parser.add_argument("--before", type=Path, help="the old checkout")
    parser.add_argument("--after", type=Path, default=repo, help="the new checkout")
    parser.add_argument("--before-label", default="before")
    parser.add_argument("--after-label", default="after")


def workers_in_turns(
    script: Path, args: argparse.Namespace, worker_args: list[str]
) -> dict[str, list[Any]]:
    """Run ``script --worker *worker_args`` (:func:`run_worker`) on the checkouts of
    ``args`` (:func:`add_arguments`), ``args.rounds`` rounds in turns -> per side, the
    workers' answers in the order they ran."""
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    runs: dict[str, list[Any]] = {"before": [], "after": []}
    for r, _, side in in_turns(args.rounds):
        print(f"round {r + 1} of {args.rounds}: {side}", flush=True)
        runs[side].append(run_worker(script, trees[side], worker_args))
    return runs


def main_in_turns(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    script: Path,
    worker: Callable[[], Any],
    worker_args: list[str],
    render: Callable[[dict[str, list[Any]], argparse.Namespace], str],
) -> int:
    """A before/after program's main after its arguments are checked: as a worker
    (``--worker``), print ``worker()``'s answer as JSON; else run the workers in turns
    (:func:`workers_in_turns` of ``script``, the program's own), write ``render(runs, args)``
    to ``args.out`` and print it."""
    if args.worker:
        print(json.dumps(worker()))
        return 0
    if args.before is None:
        parser.error("--before is required")
    text = render(workers_in_turns(script, args, worker_args), args)
    args.out.write_text(text)
    print(text)
    return 0


def in_turns(rounds: int) -> Iterator[tuple[int, int, str]]:
    """(round, position in it, side) in the order the runs go: before then after,
    reversed every other round, so that the host's drift hits both checkouts alike."""
    for r in range(rounds):
        for i, side in enumerate(("before", "after") if r % 2 == 0 else ("after", "before")):
            yield r, i, side
