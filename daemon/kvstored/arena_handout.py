"""Hand each tenant's clients its own arena region, as a file descriptor.

A tenant with a host quota has its own region of the arena (kvstore.host.arena): a
memory file with no path. The protocol is :mod:`kvproto.v1.arena_handout`; this is its
server, on a unix socket of the daemon's socket mode. Only the token decides whose
region is handed out, and it never crosses the socket: the client proves it over
fresh nonces and the daemon proves it back (kvproto.v1.challenge). A caller with no
region of its own (the admin, a tenant without a host quota) is told to map the arena
file by path, as every client did before regions. Unknown tokens are noted like every
refused token (kvstored.auth.BAD_TOKENS): logged at a bounded rate, and a peer that
keeps guessing is answered late.

Each user (uid) holds at most ``max_connections_per_user`` connections to this socket
at once (kvstored.peer_limits, as on the local-call socket): the one past that is
closed at once, so nobody can fill the daemon's descriptors through it; each
connection has ``HANDOUT_TIMEOUT_S`` for its whole exchange.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from pathlib import Path

from kvproto.v1.arena_handout import MAX_REQUEST_BYTES
from kvproto.v1.challenge import ARENA_HANDOUT, NONCE_BYTES, Transcript, new_nonce
from kvproto.v1.local_calls import peer_credentials
from kvstore.errors import Unauthenticated
from kvstore.host.arena import HostArena
from kvstored.auth import BAD_TOKENS, Caller, Tokens
from kvstored.log_limits import LIMITED
from kvstored.peer_limits import ConnectionsPerUser

log = logging.getLogger("kvstored.arena_handout")

HANDOUT_SUFFIX = ".arena"  # kvstored.sock -> kvstored.arena.sock
HANDOUT_TIMEOUT_S = 10.0  # the client's part of the exchange must come within this


def handout_socket_path(local_socket: Path) -> Path:
    """Beside the local-call socket: ``kvstored.local.sock`` -> ``kvstored.local.arena.sock``."""
    return local_socket.with_name(local_socket.stem + HANDOUT_SUFFIX + local_socket.suffix)


class ArenaHandout:
    """The hand-out socket of one daemon (see the module docstring)."""

    def __init__(self, arena: HostArena, tokens: Tokens, max_per_user: int = 1024) -> None:
        self._arena = arena
        self._tokens = tokens
        self._per_user = ConnectionsPerUser(max_per_user, "arena hand-out")
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
            peer = peer_credentials(conn)
            uid = peer[1] if peer else -1
            if not self._per_user.admit(uid):
                conn.close()
                continue
            task = loop.create_task(self._serve(conn, uid))
            self._serving.add(task)
            task.add_done_callback(self._serving.discard)

    async def _serve(self, conn: socket.socket, uid: int) -> None:
        try:
            with conn:
                conn.setblocking(False)
                try:
                    answer, fd = await asyncio.wait_for(
                        self._challenge(conn, uid), HANDOUT_TIMEOUT_S
                    )
                except (TimeoutError, asyncio.TimeoutError, OSError, ValueError) as exc:
                    why = str(exc) or f"not done within {HANDOUT_TIMEOUT_S:.0f} s"
                    await _send(conn, {"error": f"no challenge: {why}"})
                    return
                await _send(conn, answer, fd)
        finally:
            self._per_user.release(uid)

    async def _challenge(
        self, conn: socket.socket, uid: int
    ) -> tuple[dict[str, object], int | None]:
        """The client's proof of its token over both nonces (kvproto.v1.challenge) ->
        the reply and the fd to attach; ValueError for a malformed exchange."""
        hello, _, nonce = (await _read_line(conn)).partition(b" ")
        client_nonce = bytes.fromhex(nonce.decode("ascii", errors="replace"))
        if hello != b"hello" or len(client_nonce) != NONCE_BYTES:
            raise ValueError(
                "the exchange starts with `hello <nonce>`: this socket takes no token, only "
                "a proof of one (kvproto.v1.arena_handout)"
            )
        daemon_nonce = new_nonce()
        await _send(conn, {"nonce": daemon_nonce.hex()})
        proof = bytes.fromhex((await _read_line(conn)).decode("ascii", errors="replace"))
        transcript = Transcript.of_daemon(
            ARENA_HANDOUT, client_nonce, daemon_nonce, uid if uid >= 0 else None
        )
        try:
            caller, daemon_proof = self._tokens.answer_challenge(transcript, proof)
        except Unauthenticated as exc:
            await asyncio.sleep(BAD_TOKENS.note(""))  # logged; late past the free ones
            return {"error": str(exc)}, None
        answer, fd = self._answer(caller)
        if fd is not None:
            answer["proof"] = daemon_proof.hex()
        return answer, fd

    def _answer(self, caller: Caller) -> tuple[dict[str, object], int | None]:
        """The reply to ``caller`` and the fd to attach (None: none)."""
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
