"""What client and daemon both need to know about an address (stdlib only)."""

from __future__ import annotations

import ipaddress
from pathlib import Path

UNIX_PREFIX = "unix://"


def socket_path_of(address: str) -> Path | None:
    """The filesystem path of a ``unix://`` (or ``unix:``) address; None for TCP."""
    if address.startswith(UNIX_PREFIX):
        return Path(address[len(UNIX_PREFIX) :])
    if address.startswith("unix:"):
        return Path(address[len("unix:") :])
    return None


def is_loopback(address: str) -> bool:
    """Whether a TCP ``host:port`` reaches this host only (loopback, or localhost)."""
    host = address.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
