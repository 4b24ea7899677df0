"""Cases of a benchmark, chosen on its command line and run in turns.

Benchmarks that compare several cases (engines, servers, settings) on one shared
machine run them in turns, round after round, with the order turning each round, so
that a change of the machine's load falls on every case alike and shows as spread
between rounds, not as an effect of one case.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Sequence


def chosen(parser: argparse.ArgumentParser, text: str, known: Sequence[str]) -> list[str]:
    """The cases a comma-separated ``--cases`` names (the parser's error for an
    unknown one)."""
    cases = [case for case in text.split(",") if case]
    unknown = set(cases) - set(known)
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}; known: {', '.join(known)}")
    return cases


def in_turns(cases: Sequence[str], rounds: int) -> Iterator[tuple[int, str]]:
    """(round, case) in the order the runs go: every case once a round, the order
    turning by one each round."""
    for round_ in range(rounds):
        shift = round_ % len(cases)
        for case in [*cases[shift:], *cases[:shift]]:
            yield round_, case
