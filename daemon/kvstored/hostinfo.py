"""Facts about the machine the daemon runs on: identity (``kvproto.v1.host``, which
the client computes too), free memory, free and total disk."""

from __future__ import annotations

import os
from pathlib import Path

from kvproto.v1.host import host_id  # noqa: F401 - the daemon's identity, as clients see it


def mem_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (falls back to free physical pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def mem_total_bytes() -> int:
    """The memory this process may use in all: MemTotal, or the cgroup's limit (a
    container's) when that is lower. The same at every start on one machine."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        return total
    return min(total, int(limit)) if limit.isdigit() else total


def disk_free_bytes(path: str | os.PathLike[str]) -> int:
    """Free bytes (for unprivileged users) of the filesystem that holds or would hold ``path``."""
    st = _statvfs(path)
    return st.f_bavail * st.f_frsize


def disk_size_bytes(path: str | os.PathLike[str]) -> int:
    """Size of the filesystem that holds or would hold ``path``."""
    st = _statvfs(path)
    return st.f_blocks * st.f_frsize


def _statvfs(path: str | os.PathLike[str]) -> os.statvfs_result:
    probe = Path(path).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return os.statvfs(probe)
