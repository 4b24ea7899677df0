"""The arena hand-out: how a client gets its tenant's arena region (stdlib only).

A tenant with its own arena region (kvstore.host.arena) reads in ServerInfo an
``arena_path`` of the form ``fd:<arena>/<tenant>``, which no file has, and an
``arena_socket``. One exchange per connection on that unix socket:

- client -> daemon: its token and a newline (at most MAX_REQUEST_BYTES in all);
- daemon -> client: one JSON line, ``{"arena": name, "offset": o, "length": n}`` with
  the region's file descriptor attached (SCM_RIGHTS), or ``{"error": why}`` with
  none; then the daemon closes the connection.

The client maps the fd at offset ``o`` of an address range of ``o + n`` bytes
(kvstore.host.mapping.map_fds): the arena offsets in answers are then offsets of that
range, as they are of the daemon's own.
"""

from __future__ import annotations

import json
import os
import socket

from kvproto.v1.local_calls import peer_credentials

FD_PREFIX = "fd:"  # an arena_path handed out by fd, not a file
MAX_REQUEST_BYTES = 4096


def fetch_region(
    path: str, token: str, timeout: float, daemon_uid: int | None
) -> tuple[int, dict[str, object]]:
    """The region's fd and the reply (see the module docstring). The token goes only
    to a socket served by ``daemon_uid`` (or root). OSError or ValueError saying why
    not; the caller owns (and closes) the fd."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(path)
        peer = peer_credentials(sock)
        if daemon_uid is not None and peer is not None and peer[1] not in (daemon_uid, 0):
            raise ValueError(f"{path} is served by uid {peer[1]}, not the daemon's")
        sock.sendall(token.encode() + b"\n")
        data, fds, _, _ = socket.recv_fds(sock, MAX_REQUEST_BYTES, 1)
    if not fds:
        try:
            why = json.loads(data or b"{}").get("error", "no answer")
        except ValueError:
            why = "an answer that is not JSON"
        raise ValueError(f"no arena region from {path}: {why}")
    try:
        reply = json.loads(data)
        if not isinstance(reply, dict) or not {"arena", "offset", "length"} <= set(reply):
            raise ValueError(f"not a region: {data[:200]!r}")
    except ValueError:
        for fd in fds:
            os.close(fd)
        raise
    return fds[0], reply
