"""Default locations of the daemon's socket and data (stdlib only: read before grpc).

- socket: as ``kvproto.v1.addresses`` says (the client dials the same place). The
  daemon creates the directory with mode 0700 and the socket with mode 0600: only the
  owner's processes can talk to it.
- local calls: beside the gRPC socket (:func:`local_socket_path`).
- data (LMDB disk tier): ``$XDG_DATA_HOME/kvstore``, fallback ``~/.local/share/kvstore``.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvproto.v1.addresses import (  # noqa: F401 - the daemon's too: one place for both
    SOCKET_NAME,
    UNIX_PREFIX,
    default_address,
    default_socket_path,
    socket_path_of,
)

LOCAL_SUFFIX = ".local"


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
