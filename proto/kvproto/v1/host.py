"""Which host a process runs on, as client and daemon both compute it (stdlib only).

``host_id()`` lets a client decide whether it shares a host (and so the shared arena)
with the daemon: both compute it and compare with ServerInfo.host_id. The boot id
changes on every reboot and containers on one host share it, so it is combined with the
hostname.
"""

from __future__ import annotations

import hashlib
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
