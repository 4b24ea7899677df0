"""Where a daemon is, as client and daemon both see it (stdlib only).

A daemon started with no arguments listens on ``$XDG_RUNTIME_DIR/kvstore/kvstored.sock``
(a per-user tmpfs that systemd creates with mode 0700), or without XDG_RUNTIME_DIR on
``/tmp/kvstore-<uid>/kvstored.sock``; a client with no address dials the same.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

UNIX_PREFIX = "unix://"
SOCKET_NAME = "kvstored.sock"


def default_socket_path() -> Path:
    """Where a daemon started with no arguments listens."""
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if runtime and os.path.isabs(runtime) and os.path.isdir(runtime):
        return Path(runtime) / "kvstore" / SOCKET_NAME
    return Path("/tmp") / f"kvstore-{os.getuid()}" / SOCKET_NAME


def default_address() -> str:
    """gRPC target of the default socket: ``unix:///...``."""
    return UNIX_PREFIX + str(default_socket_path())


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
