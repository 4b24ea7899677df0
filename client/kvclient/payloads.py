"""Client-side checks and shapes of what a request carries: token ids and block bytes.

The daemon validates everything again at its edge; checking here first gives the
caller a precise :class:`InvalidArgumentError` before any bytes are copied or sent.
Blocks are never copied to normalise them: an ndarray is viewed as ``uint8[n, B]``
(copied only if it is not C-contiguous), a sequence of bytes-likes is viewed block by
block with ``np.frombuffer``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvclient.errors import InvalidArgumentError
from kvstore.errors import InvalidArgument
from kvstore.keys import tokens_array

BlockRows = np.ndarray | list[np.ndarray]
"""Blocks as ``uint8[n, block_bytes]`` or as a list of n ``uint8[block_bytes]`` views."""


def as_tokens(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids as a contiguous uint32 array; InvalidArgumentError for anything else."""
    try:
        return tokens_array(tokens)
    except InvalidArgument as exc:
        raise InvalidArgumentError(str(exc)) from None
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"tokens must be a flat sequence of integers: {exc}") from None


def as_blocks(blocks: Any, block_bytes: int) -> BlockRows:
    """View ``blocks`` as rows of exactly ``block_bytes`` uint8 each (no copy if possible)."""
    if isinstance(blocks, np.ndarray):
        if blocks.ndim == 0:
            raise InvalidArgumentError("blocks must have a leading block dimension")
        n = blocks.shape[0]
        if n == 0:
            return np.empty((0, block_bytes), dtype=np.uint8)
        per_block = blocks[0].nbytes
        if per_block != block_bytes:
            raise InvalidArgumentError(
                f"each block must be {block_bytes} bytes, got {per_block} "
                f"(shape {blocks.shape}, dtype {blocks.dtype})"
            )
        flat = np.ascontiguousarray(blocks).reshape(n, -1)
        return flat.view(np.uint8).reshape(n, block_bytes)
    if isinstance(blocks, (bytes, bytearray, memoryview, str)):
        raise InvalidArgumentError("blocks must be an array [n_blocks, block_bytes] or a sequence")
    rows: list[np.ndarray] = []
    for i, block in enumerate(blocks):
        try:
            row = np.frombuffer(block, dtype=np.uint8)
        except (TypeError, ValueError, BufferError) as exc:
            raise InvalidArgumentError(f"block {i} is not a bytes-like object: {exc}") from None
        if row.size != block_bytes:
            raise InvalidArgumentError(f"block {i} must be {block_bytes} bytes, got {row.size}")
        rows.append(row)
    return rows


def check_cover(tokens: np.ndarray, block_tokens: int, start: int, n_blocks: int) -> None:
    """The tokens must cover ``start + n_blocks`` full blocks."""
    if start < 0:
        raise InvalidArgumentError(f"start must be >= 0, got {start}")
    need = (start + n_blocks) * block_tokens
    if tokens.size < need:
        raise InvalidArgumentError(
            f"{n_blocks} blocks from block {start} need {need} tokens "
            f"({block_tokens} per block), got {tokens.size}"
        )


def check_priority(priority: int | None) -> None:
    if priority is not None and not 0 <= priority <= 100:
        raise InvalidArgumentError(f"priority must be in [0, 100], got {priority}")


def check_start(start: int) -> int:
    if start < 0:
        raise InvalidArgumentError(f"start must be >= 0, got {start}")
    return start


def check_out(out: np.ndarray | None, block_bytes: int) -> int:
    """Blocks a caller's ``out`` array can hold (0: no ``out``, so no cap)."""
    if out is None:
        return 0
    if (
        not isinstance(out, np.ndarray)
        or out.dtype != np.uint8
        or out.ndim != 2
        or out.shape[1] != block_bytes
        or not out.flags.c_contiguous
        or not out.flags.writeable
    ):
        raise InvalidArgumentError(
            f"out must be a writable C-contiguous uint8 array [k, {block_bytes}]"
        )
    if out.shape[0] == 0:
        raise InvalidArgumentError("out must hold at least one block")
    return int(out.shape[0])


def output_array(out: np.ndarray | None, n_blocks: int, block_bytes: int) -> np.ndarray:
    """Where a get writes ``n_blocks`` blocks: the caller's ``out`` or a new array."""
    if out is not None:
        return out[:n_blocks]
    return np.empty((n_blocks, block_bytes), dtype=np.uint8)


def blocks_per_call(max_transfer_bytes: int, max_blocks_per_request: int, block_bytes: int) -> int:
    """Blocks one inline Put may carry under the daemon's limits (0 limit: none)."""
    per_call = max_transfer_bytes // block_bytes if max_transfer_bytes else 1 << 30
    if max_blocks_per_request:
        per_call = min(per_call, max_blocks_per_request)
    return max(1, per_call)
