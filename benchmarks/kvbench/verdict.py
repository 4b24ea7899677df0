"""Whether a measured difference is kvstore's or the machine's (pure functions).

The examples compare a turn served from kvstore with the same prompt computed whole,
and ``kvctl bench`` compares its cases with floors measured beside them. On a shared,
busy machine the same work measured twice differs by as much as the effect looked
for: two full prefills of one prompt a second apart can differ by 2x. So a figure is
read against the machine's own noise, measured beside it:

- an A/A pair: the same work measured twice (a full prefill before and after the
  turn; memcpy beside the host cases and again beside the disk cases). Their spread
  is how much the machine alone moves a figure.

Where the noise explains the difference the verdict is "the machine is busy: the figure
is inconclusive", never "kvstore is slow"; where it does not (a quiet A/A pair), the
verdict is the figure's, a slow one included: a quiet machine never hides a slow cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# two runs of the same work further apart than this (of the quicker): a busy machine
BUSY_SPREAD = 0.25


def spread(a: float, b: float) -> float:
    """How far apart two measurements of the same work are, as a share of the quicker."""
    quicker = min(a, b)
    return abs(a - b) / quicker if quicker > 0 else 0.0


@dataclass(frozen=True, slots=True)
class TurnVerdict:
    """``kind``: ``gain`` (the cached turn is quicker), ``no-gain`` (loading cost more
    than it saved: a short prompt), ``same`` (no difference beyond a quiet machine's
    noise), ``slower`` (slower than the load explains, on a quiet machine: look at the
    cache) or ``busy`` (the machine's noise explains the difference); ``text`` says it
    to a reader."""

    kind: str
    text: str


def turn_verdict(turn_s: float, load_s: float, full_s: tuple[float, float]) -> TurnVerdict:
    """A cached turn (``turn_s`` to its first token, of which ``load_s`` loading from
    kvstore) against its prompt computed whole, measured twice around it (``full_s``,
    an A/A pair):

    - quicker than both: a gain, against the quicker of the two;
    - between the two: no difference the machine's noise does not explain (busy where
      the two are further apart than :data:`BUSY_SPREAD`);
    - slower than both by more than its load took: busy where the two are further apart
      than :data:`BUSY_SPREAD`; on a quiet machine the figure stands (``slower``: the
      time the load does not explain is named; a cache that copies after ``load_s``
      was measured, layer by layer in the forward pass, shows here);
    - slower than both by no more than its load took: loading costs what it saves (a
      short prompt)."""
    quick, slow = sorted(full_s)
    apart = spread(quick, slow)
    if turn_s < quick:
        gain = f"{quick / turn_s:.1f}x quicker than a full prefill ({_ms(quick)})"
        return TurnVerdict("gain", gain)
    if turn_s <= slow:
        if apart > BUSY_SPREAD:
            return TurnVerdict(
                "busy",
                f"the machine is busy: the same full prefill took {_ms(quick)} and "
                f"{_ms(slow)} ({apart:.0%} apart), and this turn lies between them; the "
                "figure is inconclusive",
            )
        return TurnVerdict("same", f"about a full prefill's time ({_ms(quick)} .. {_ms(slow)})")
    if load_s < turn_s - slow:
        if apart > BUSY_SPREAD:
            return TurnVerdict(
                "busy",
                f"the machine is busy: the same full prefill took {_ms(quick)} and "
                f"{_ms(slow)} ({apart:.0%} apart), and this turn took {_ms(turn_s)}, its "
                f"load {_ms(load_s)}; the figure is inconclusive",
            )
        return TurnVerdict(
            "slower",
            f"slower than a full prefill ({_ms(quick)} .. {_ms(slow)}, a quiet machine) by "
            f"{_ms(turn_s - slow)}, of which loading took {_ms(load_s)}: "
            f"{_ms(turn_s - slow - load_s)} unexplained (kvctl why, the load's log)",
        )
    return TurnVerdict(
        "no-gain",
        f"slower than a full prefill ({_ms(quick)} .. {_ms(slow)}) by no more than its load took "
        f"({_ms(load_s)}): at this length loading costs what it saves, a short prompt gains "
        "nothing; the gain grows with the history (docs/benchmarks/multiturn.md)",
    )


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds >= 0.1 else f"{seconds * 1e3:.1f} ms"


def busy_machine(pairs: Sequence[tuple[float, float]]) -> str:
    """Why this machine is too busy to judge a benchmark's absolute goals ("" when it is
    not): an A/A pair (``pairs``: the same work measured twice, in the run) further apart
    than :data:`BUSY_SPREAD`. (Not the load average: sampled after a run it counts the
    run's own daemon and clients, and before it, nothing of what came later.)"""
    widest = max((spread(a, b) for a, b in pairs), default=0.0)
    if widest > BUSY_SPREAD:
        return f"the same copy measured twice differs by {widest:.0%}"
    return ""


def goal_state(met: bool | None, quick: bool, busy: str, relative: bool) -> tuple[str, str]:
    """(state, why) of one of ``kvctl bench``'s goals: ``met`` / ``MISSED`` where the
    run can judge it; ``-`` with why where it cannot: a quick run's cases are too small
    and short for any goal, and a miss of an absolute goal (GB/s, blocks/s) on a busy
    machine may be the machine's. A ``relative`` goal (a ratio to a baseline measured
    beside it in the same run) is judged on a busy machine too: its baseline carries
    the machine's noise."""
    if met is None:
        return "-", "not measured"
    if quick:
        return "-", "not judged: a quick run's cases are too small and short for its goal"
    if not met and busy and not relative:
        return "-", f"not judged: the machine is busy ({busy})"
    return ("met", "") if met else ("MISSED", "")
