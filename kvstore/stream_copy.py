"""Copy large blocks into arena slots with non-temporal (streaming) stores.

A put writes KV blocks (rows of 256 KiB .. 2 MiB) into slots of the shared arena that
no CPU reads again soon. Plain stores (``np.copyto``, glibc's memcpy below its
non-temporal threshold) first read every destination cache line (read-for-ownership),
so the copy moves each byte over the memory bus twice and evicts the cache. Streaming
stores skip that read: on our 2-core EPYC VM a 4 MiB put into a cold slot takes 0.16 ms
instead of 0.22-0.26 ms (32 MiB: 1.7-1.8 ms instead of 2.5-2.6), the same as glibc's
own non-temporal path in the same run. glibc would do the same above
``glibc.cpu.x86_non_temporal_threshold``, but the client runs inside an inference
engine's process, where we cannot set glibc tunables, so the copy lives in a small C
extension, ``kvstore._streamcopy`` (x86-64, SSE2 only).

:func:`copy_into` is the one entry point. It uses the extension when it is built, the
CPU is x86-64, ``KVSTORE_STREAM_COPY`` is not ``0`` (read once, at import) and the
rows are at least :data:`MIN_ROW_BYTES` long; in every other case it is
``np.copyto``, with the same result. Small copies keep plain stores on purpose: their
destination is likely in cache already, and a streaming store would evict it.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np

ENV = "KVSTORE_STREAM_COPY"

# Rows (or whole contiguous copies) shorter than this go to np.copyto; the C side's
# STREAM_MIN is the same 64 KiB. Measured per 4 MiB put on the EPYC VM: into cold slots
# streaming wins at every row size from 16 KiB up (64 KiB rows 0.19 vs 0.37 ms), but it
# loses when the slot is still in cache (64 KiB rows 0.18 vs 0.11 ms), and below 64 KiB
# the per-row call costs more (16 KiB rows 0.25 ms, 256 KiB rows 0.17 ms). KV rows are
# 256 KiB .. 2 MiB, well above it; small copies, likelier cache-hot, keep plain stores.
MIN_ROW_BYTES = 64 * 1024


def _load() -> Callable[[object, object], None] | None:
    """The compiled copy, or None when disabled, not built, or not streaming here."""
    if os.environ.get(ENV, "1").strip() == "0":
        return None
    try:
        import kvstore._streamcopy as _streamcopy
    except ImportError:
        return None
    if not _streamcopy.STREAMING:  # built for an arch without streaming stores
        return None
    copy: Callable[[object, object], None] = _streamcopy.copy
    return copy


_copy = _load()

STREAMING: bool = _copy is not None
"""Whether :func:`copy_into` streams large copies (extension built, x86-64, not disabled)."""


def copy_into(dst: np.ndarray, src: np.ndarray) -> None:
    """Copy ``src`` into ``dst`` (same shape and dtype), streaming large rows.

    Streams when both arrays are C-contiguous and at least :data:`MIN_ROW_BYTES` long
    (one call), or when both are 2-D with contiguous rows of at least
    :data:`MIN_ROW_BYTES` (one call per row: strided or reversed slot views). Anything
    else, including overlapping arrays, object dtypes, broadcasting and read-only
    ``dst``, is ``np.copyto``, which also raises the errors.
    """
    copy = _copy
    if (
        copy is None
        or dst.shape != src.shape
        or dst.dtype != src.dtype
        or dst.dtype.hasobject
        or not dst.flags.writeable
        or dst.nbytes < MIN_ROW_BYTES
        or np.may_share_memory(dst, src)
    ):
        np.copyto(dst, src)
        return
    if dst.flags.c_contiguous and src.flags.c_contiguous:
        copy(dst, src)
        return
    itemsize = dst.dtype.itemsize
    if (
        dst.ndim == 2
        and dst.shape[1] * itemsize >= MIN_ROW_BYTES
        and dst.strides[1] == itemsize
        and src.strides[1] == itemsize
    ):
        for dst_row, src_row in zip(dst, src, strict=True):
            copy(dst_row, src_row)
        return
    np.copyto(dst, src)
