"""Facts about the machine the daemon runs on: identity, free memory, free disk.

``host_id()`` lets a client decide whether it shares a host (and so the shared arena)
with the daemon: both compute it and compare with ServerInfo.host_id. The boot id
changes on every reboot and containers on one host share it, so it is combined with the
hostname. No grpc here: the client imports this module too.
"""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


def host_id() -> str:
    """sha256 hex of the kernel boot id and the hostname."""
    try:
        boot_id = Path(BOOT_ID_PATH).read_text().strip()
    except OSError:
        boot_id = ""
    return hashlib.sha256(f"{boot_id}\n{socket.gethostname()}".encode()).hexdigest()


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


def disk_free_bytes(path: str | os.PathLike[str]) -> int:
    """Free bytes (for unprivileged users) of the filesystem that holds or would hold ``path``."""
    probe = Path(path).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    st = os.statvfs(probe)
    return st.f_bavail * st.f_frsize
