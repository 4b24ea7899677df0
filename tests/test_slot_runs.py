"""Runs of arena slots (kvstore.host.slot_runs): the one function the daemon's Get, the GPU
mover and the client's arena path cut their copies with."""

from __future__ import annotations

import numpy as np

from kvstore.host.slot_runs import Run, slot_runs

BB = 4096


def strided(positions: list[int], offsets: list[int]) -> list[Run]:
    """The client's runs: chain positions given, one constant stride each."""
    return slot_runs(np.array(offsets, np.int64), BB, np.array(positions), strided=True)


def test_adjacent_runs_group_slots_that_follow_each_other() -> None:
    runs = slot_runs([0, 100, 200, 500, 600, 50], 100)
    assert [(r.pos, r.count, r.offset) for r in runs] == [(0, 3, 0), (3, 2, 500), (5, 1, 50)]
    assert slot_runs([], 100) == []


def test_adjacent_slots_make_one_run_in_either_direction() -> None:
    # large blocks are carved upwards: one run, stride +block
    up = strided([0, 1, 2, 3], [0, BB, 2 * BB, 3 * BB])
    assert up == [Run(0, 4, 0, BB)]
    # small blocks are carved from the top of an extent down: one run, stride -block
    down = strided([0, 1, 2], [3 * BB, 2 * BB, BB])
    assert down == [Run(0, 3, 3 * BB, -BB)]
    # evenly spaced with gaps (sizes rounded up): still one strided run
    gaps = strided([5, 6, 7], [0, BB + 64, 2 * BB + 128])
    assert gaps == [Run(0, 3, 0, BB + 64)]


def test_runs_break_at_chain_gaps_overlaps_and_stride_changes() -> None:
    runs = strided(
        [0, 1, 2, 4, 5, 6, 7, 8],
        # 0-2 up; a chain gap before 4; 4-5 up; 6 jumps back (another stride);
        # 7 overlaps 6; 8 is far from 7 but may start a run with it
        [0, BB, 2 * BB, 10 * BB, 11 * BB, 5 * BB, 5 * BB + 100, 20 * BB],
    )
    assert [(r.pos, r.count) for r in runs] == [(0, 3), (3, 2), (5, 1), (6, 2)]
    assert runs[-1].stride == 15 * BB - 100
    assert strided([], []) == []
    assert strided([3], [BB]) == [Run(0, 1, BB, BB)]


def test_adjacent_runs_never_join_a_falling_or_spaced_pair() -> None:
    """What one contiguous byte range may hold: a block right after the previous."""
    offsets = [3 * BB, 2 * BB, BB, 5 * BB, 6 * BB + 64]
    runs = slot_runs(offsets, BB)
    assert [(r.pos, r.count, r.offset) for r in runs] == [(i, 1, o) for i, o in enumerate(offsets)]
    positions = np.array([0, 1, 3])
    assert [r.count for r in slot_runs([0, BB, 2 * BB], BB, positions)] == [2, 1]
