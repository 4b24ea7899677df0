"""The arena hand-out: how a client gets its tenant's arena region (stdlib only).

A tenant with its own arena region (kvstore.host.arena) reads in ServerInfo an
``arena_path`` of the form ``fd:<arena>/<tenant>``, which no file has, and an
``arena_socket``. One exchange per connection on that unix socket, lines of at most
MAX_REQUEST_BYTES; the token is never sent, only proved (:mod:`kvproto.v1.challenge`,
``purpose`` ``ARENA_HANDOUT``):

- client -> daemon: ``hello <client nonce, hex>``;
- daemon -> client: ``{"nonce": "<daemon nonce, hex>"}`` (or ``{"error": why}``);
- client -> daemon: ``<client proof, hex>``;
- daemon -> client: one JSON line, ``{"arena": name, "offset": o, "length": n,
  "proof": "<daemon proof, hex>"}`` with the region's file descriptor attached
  (SCM_RIGHTS), or ``{"error": why}`` with none; then the daemon closes the
  connection.

The client maps nothing a peer hands it without the daemon's proof: a listener that
took the socket's path can neither learn the token nor have the client write KV into
memory of its own.

The client maps the fd at offset ``o`` of an address range of ``o + n`` bytes
(kvstore.host.mapping.map_fds): the arena offsets in answers are then offsets of that
range, as they are of the daemon's own.
"""

from __future__ import annotations

import json
import os
import socket

from kvproto.v1.challenge import ARENA_HANDOUT, Transcript, new_nonce, token_key
from kvproto.v1.local_calls import peer_credentials

FD_PREFIX = "fd:"  # an arena_path handed out by fd, not a file
MAX_REQUEST_BYTES = 4096


def fetch_region(
    path: str, token: str, timeout: float, daemon_uid: int | None
) -> tuple[int, dict[str, object]]:
    """The region's fd and the reply (see the module docstring). Only a socket served
    by ``daemon_uid`` (or root) is asked, and only a peer that proves it knows the
    token is believed. OSError or ValueError saying why not; the caller owns (and
    closes) the fd."""
    key = token_key(token)
    nonce = new_nonce()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(path)
        peer = peer_credentials(sock)
        if daemon_uid is not None and peer is not None and peer[1] not in (daemon_uid, 0):
            raise ValueError(f"{path} is served by uid {peer[1]}, not the daemon's")
        sock.sendall(b"hello " + nonce.hex().encode() + b"\n")
        first = _reply(_read_line(sock), path)
        try:
            daemon_nonce = bytes.fromhex(str(first["nonce"]))
            transcript = Transcript.of_client(
                ARENA_HANDOUT, nonce, daemon_nonce, peer[1] if peer else None
            )
        except (KeyError, ValueError):
            raise ValueError(f"{path} answered no challenge: {first}") from None
        sock.sendall(transcript.client_proof(key).hex().encode() + b"\n")
        data, fds, _, _ = socket.recv_fds(sock, MAX_REQUEST_BYTES, 1)
    try:
        reply = _reply(data, path)
        if not fds:
            raise ValueError(f"no arena region from {path}: {reply.get('error', reply)}")
        try:
            proved = transcript.daemon_proved(key, bytes.fromhex(str(reply.get("proof"))))
        except ValueError:
            proved = False
        if not proved:
            raise ValueError(
                f"{path} did not prove that it knows the token: not the daemon's hand-out"
            )
        if not {"arena", "offset", "length"} <= set(reply):
            raise ValueError(f"not a region: {data[:200]!r}")
    except ValueError:
        for fd in fds:
            os.close(fd)
        raise
    return fds[0], reply


def _read_line(sock: socket.socket) -> bytes:
    """One line of the peer's (nothing follows it before this side answers)."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(MAX_REQUEST_BYTES - len(data))
        if not chunk or len(data) + len(chunk) >= MAX_REQUEST_BYTES:
            break
        data += chunk
    return data


def _reply(data: bytes, path: str) -> dict[str, object]:
    """A JSON object line of the daemon's; ValueError (with its error) otherwise."""
    try:
        reply = json.loads(data or b"{}")
    except ValueError:
        raise ValueError(f"{path} answered a line that is not JSON: {data[:200]!r}") from None
    if not isinstance(reply, dict) or not reply:
        raise ValueError(f"{path} answered nothing usable: {data[:200]!r}")
    if "error" in reply:
        raise ValueError(f"no arena region from {path}: {reply['error']}")
    return reply
