"""The disk's floor for a read benchmark: how fast its data file reads from a cold
page cache, by parallel readers (what no reader of the same bytes can beat)."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def drop_disk_cache(disk_dir: Path) -> None:
    """Evict LMDB's data file from the page cache: the next read hits the disk."""
    fd = os.open(disk_dir / "data.mdb", os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def disk_read_gbs(path: Path, threads: int, chunk: int = 8 << 20, nbytes: int = 0) -> float:
    """GB/s of reading ``path`` cold: dropped from the page cache, then read by
    ``threads`` readers in ``chunk``-sized pieces (each reader reuses one buffer); its
    first ``nbytes`` only when given."""
    drop_disk_cache(path.parent)
    size = path.stat().st_size if not nbytes else min(nbytes, path.stat().st_size)
    starts = list(range(0, size, chunk))
    fd = os.open(path, os.O_RDONLY)
    try:

        def reader(index: int) -> int:
            buffer = bytearray(chunk)
            done = 0
            for start in starts[index::threads]:
                done += os.preadv(fd, [buffer], start)
            return done

        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            total = sum(pool.map(reader, range(threads)))
        elapsed = time.perf_counter() - t0
    finally:
        os.close(fd)
    return total / elapsed / 1e9
