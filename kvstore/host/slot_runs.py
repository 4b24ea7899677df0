"""Runs of arena slots: how every copy between blocks and slots is cut.

A request's blocks sit in host slots at arbitrary offsets; copying them one block at a
time costs a call (a numpy copy, a DMA, a gRPC data chunk) per block. Slots usually
come in runs (a batch allocated in one carve sits at adjacent, rising offsets; small
blocks carved from the top of a free extent down sit at a constant negative step), so
the daemon's Get, the GPU mover and the client's arena path all copy per *run*:

- ``strided=False``: runs of adjacent slots, each one contiguous byte range
  (``offset .. offset + count * block_bytes``), what a single memcpy, DMA or memoryview
  needs;
- ``strided=True``: runs of one constant step between neighbours (rising or falling,
  at least a block apart so rows never overlap), what one strided numpy view copies.

Neighbours join a run only when their chain positions follow each other too (when
``positions`` are given). Vectorised: O(runs) Python work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class Run:
    """``count`` slots at request positions ``pos .. pos + count - 1``; block k of the
    run is at arena offset ``offset + k * stride``."""

    pos: int
    count: int
    offset: int
    stride: int


def slot_runs(
    offsets: np.ndarray | Sequence[int],
    block_bytes: int,
    positions: np.ndarray | None = None,
    *,
    strided: bool = False,
) -> list[Run]:
    """The runs of slots at ``offsets`` (in request order; ``positions``: their chain
    positions, default 0, 1, 2 ...), adjacent ones only unless ``strided`` (see the
    module docstring). A pair right after a stride change starts a run of its own even
    when it could have extended the next one: fewer joins, never a wrong one."""
    offs = np.asarray(offsets, dtype=np.int64)
    n = offs.size
    if n == 0:
        return []
    if n == 1:
        return [Run(0, 1, int(offs[0]), block_bytes)]
    step = np.diff(offs)
    joins = np.abs(step) >= block_bytes if strided else step == block_bytes
    if positions is not None:
        joins &= np.diff(positions) == 1
    if strided:  # a pair joins the run before it only at the same step
        joins[1:] &= ~joins[:-1] | (step[1:] == step[:-1])
    # a run starts at 0 and after every pair that does not join
    bounds = np.concatenate(([0], np.flatnonzero(~joins) + 1, [n])).tolist()
    runs = []
    for first, stop in zip(bounds[:-1], bounds[1:], strict=True):
        count = stop - first
        stride = int(step[first]) if count > 1 else block_bytes
        runs.append(Run(first, count, int(offs[first]), stride))
    return runs
