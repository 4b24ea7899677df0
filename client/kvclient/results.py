"""The client's own result: a get's blocks as a numpy array the caller owns.

Every other result type (put counts, lookups, stats, events, server info) is shared
with the daemon and the store: see :mod:`kvproto.v1.results`, re-exported by
:mod:`kvclient`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True, eq=False)
class GetResult:
    """The cached prefix of a prompt: ``blocks`` is ``uint8[n_blocks, block_bytes]``
    covering the first ``tokens`` tokens. Owned by the caller (a copy, not a view)."""

    tokens: int
    blocks: np.ndarray

    @property
    def n_blocks(self) -> int:
        return int(self.blocks.shape[0])
