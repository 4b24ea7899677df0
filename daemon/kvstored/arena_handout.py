"""Hand each tenant's clients its own arena region, as a file descriptor.

A tenant with a host quota has its own region of the arena (kvstore.host.arena): a
memory file with no path. The protocol is :mod:`kvproto.v1.arena_handout`; this is its
server, on a unix socket of the daemon's socket mode. Only the token decides whose
region is handed out: a caller with no region of its own (the admin, a tenant without
a host quota) is told to map the arena file by path, as every client did before
regions. Unknown tokens are noted like every refused token (kvstored.auth.BAD_TOKENS):
logged at a bounded rate, and a peer that keeps guessing is answered late.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from pathlib import Path

from kvproto.v1.arena_handout import MAX_REQUEST_BYTES
from kvstore.errors import Unauthenticated
from kvstore.host.arena import HostArena
from kvstored.auth import BAD_TOKENS, Tokens
from kvstored.log_limits import LIMITED

log = logging.getLogger("kvstored.arena_handout")

HANDOUT_SUFFIX = ".arena"  # kvstored.sock -> kvstored.arena.sock
HANDOUT_TIMEOUT_S = 10.0  # the token line must come within this


def handout_socket_path(local_socket: Path) -> Path:
    """Beside the local-call socket: ``kvstored.local.sock`` -> ``kvstored.local.arena.sock``."""
    return local_socket.with_name(local_socket.stem + HANDOUT_SUFFIX + local_socket.suffix)


class ArenaHandout:
    """The hand-out socket of one daemon (see the module docstring)."""

    def __init__(self, arena: HostArena, tokens: Tokens) -> None:
        self._arena = arena
        self._tokens = tokens
        self._listener: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._serving: set[asyncio.Task[None]] = set()
        self.path: Path | None = None

    async def start(self, path: Path) -> None:
        """Listen on ``path`` (cleared, and its mode set, by kvstored.server.serve_beside)."""
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(str(path))
        except BaseException:
            listener.close()
            raise
        listener.listen(64)
        listener.setblocking(False)
        self._listener, self.path = listener, path
        self._task = asyncio.get_running_loop().create_task(self._accept())

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        while True:
            try:
                conn, _ = await loop.sock_accept(self._listener)
            except OSError as exc:  # out of fds, ...: the socket stays, try again later
                LIMITED.warning(log, "arena_accept_failed", "arena hand-out: accept failed: %s",
                                exc)
                await asyncio.sleep(0.1)
                continue
            task = loop.create_task(self._serve(conn))
            self._serving.add(task)
            task.add_done_callback(self._serving.discard)

    async def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.setblocking(False)
            try:
                token = await asyncio.wait_for(_read_line(conn), HANDOUT_TIMEOUT_S)
            except (TimeoutError, OSError, ValueError) as exc:
                await _send(conn, {"error": f"no token line: {exc or 'timed out'}"})
                return
            try:
                answer, fd = self._answer(token)
            except Unauthenticated as exc:
                await asyncio.sleep(BAD_TOKENS.note(""))  # logged; late past the free ones
                answer, fd = {"error": str(exc)}, None
            await _send(conn, answer, fd)

    def _answer(self, token: bytes) -> tuple[dict[str, object], int | None]:
        """The reply to ``token`` and the fd to attach (None: none); Unauthenticated
        for an unknown token."""
        caller = self._tokens.caller(token.decode(errors="replace"))
        region = self._arena.regions.get(caller.tenant) if caller.tenant else None
        fd = self._arena.fds.get(caller.tenant) if region is not None else None
        if region is None or fd is None:
            return {"error": "this caller has no arena region of its own: map arena_path"}, None
        name = self._arena.name_of(region.name)
        return {"arena": name, "offset": region.base, "length": region.length}, fd

    def close(self) -> None:
        """Stop serving and remove the socket file."""
        for task in (self._task, *self._serving):
            if task is not None:
                task.cancel()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self.path is not None:
            with contextlib.suppress(OSError):
                self.path.unlink()


async def _read_line(conn: socket.socket) -> bytes:
    """The first line the peer sends (without its newline); ValueError past the limit."""
    loop = asyncio.get_running_loop()
    data = b""
    while b"\n" not in data:
        chunk = await loop.sock_recv(conn, MAX_REQUEST_BYTES - len(data))
        if not chunk:
            raise ValueError("the connection closed before a newline")
        data += chunk
        if len(data) >= MAX_REQUEST_BYTES and b"\n" not in data:
            raise ValueError(f"no newline in the first {MAX_REQUEST_BYTES} bytes")
    return data.partition(b"\n")[0]


async def _send(conn: socket.socket, answer: dict[str, object], fd: int | None = None) -> None:
    line = json.dumps(answer).encode()
    with contextlib.suppress(OSError):  # the peer went away: nothing to tell
        if fd is None:
            await asyncio.get_running_loop().sock_sendall(conn, line + b"\n")
        else:  # one short message on an empty socket buffer: it goes whole at once
            socket.send_fds(conn, [line + b"\n"], [fd])
