"""Default locations of the daemon's socket and data, shared with the client.

The client imports this module to find a daemon started with no arguments, so it must
stay free of grpc and of the server code (nothing here imports beyond the stdlib).

- socket: ``$XDG_RUNTIME_DIR/kvstore/kvstored.sock`` (a per-user tmpfs that systemd
  creates with mode 0700); without XDG_RUNTIME_DIR, ``/tmp/kvstore-<uid>/kvstored.sock``.
  The daemon creates the directory with mode 0700 and the socket with mode 0600:
  only the owner's processes can talk to it.
- data (LMDB disk tier): ``$XDG_DATA_HOME/kvstore``, fallback ``~/.local/share/kvstore``.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvproto.v1.addresses import UNIX_PREFIX, socket_path_of  # noqa: F401 - also ours

SOCKET_NAME = "kvstored.sock"
LOCAL_SUFFIX = ".local"


def default_socket_path() -> Path:
    """Where a daemon started with no arguments listens."""
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if runtime and os.path.isabs(runtime) and os.path.isdir(runtime):
        return Path(runtime) / "kvstore" / SOCKET_NAME
    return Path("/tmp") / f"kvstore-{os.getuid()}" / SOCKET_NAME


def default_address() -> str:
    """gRPC target of the default socket: ``unix:///...``."""
    return UNIX_PREFIX + str(default_socket_path())


def default_data_dir() -> Path:
    """Directory of the LMDB disk tier when none is configured."""
    data_home = os.environ.get("XDG_DATA_HOME", "")
    if data_home and os.path.isabs(data_home):
        return Path(data_home) / "kvstore"
    return Path.home() / ".local" / "share" / "kvstore"


def local_socket_path(socket_path: Path | None, port: int) -> Path:
    """Where a daemon serves local calls (see kvproto.v1.local_calls): beside its gRPC
    socket (``kvstored.sock`` -> ``kvstored.local.sock``), or for a TCP daemon in the
    default socket directory, named after its port."""
    if socket_path is not None:
        return socket_path.with_name(socket_path.stem + LOCAL_SUFFIX + socket_path.suffix)
    return default_socket_path().parent / f"kvstored-{port}{LOCAL_SUFFIX}.sock"
