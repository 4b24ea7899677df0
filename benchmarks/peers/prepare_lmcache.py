"""Prepare LMCache for the peer benchmarks, in a place of its own (``.peers/lmcache``):
``pip install --no-deps --target`` of lmcache 0.5.6 and a stub numba for the engines
that load it (why: :mod:`kvbench.lmcache_peer`). Prints one line: ready, or what is
missing; exits 1 when LMCache cannot run.

    .venv/bin/python benchmarks/peers/prepare_lmcache.py
"""

from __future__ import annotations

import sys

from kvbench.lmcache_peer import SITE, VERSION, prepare


def main() -> int:
    problem = prepare()
    if problem:
        print(problem, file=sys.stderr)
        return 1
    print(f"LMCache {VERSION} is ready in {SITE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
