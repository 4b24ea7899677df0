"""How a client proves who it is, and checks whom it talks to.

- **Token** (a daemon with tenants, see kvstored.auth): ``KVClient(token=...)``, else
  ``$KVSTORE_TOKEN``, else the file named by ``$KVSTORE_TOKEN_FILE``. gRPC calls carry
  it as ``authorization: Bearer <token>``, added by a channel interceptor so every
  call has it (unary, streams, the session, the GPU service). The local-call and arena
  hand-out sockets never carry it: the client proves it over fresh nonces and wants
  the daemon's proof back before it sends a call or maps an fd (kvproto.v1.challenge),
  so a listener that took one of those paths learns nothing it can reuse.
- **The limit, on a unix socket**: gRPC's metadata goes to whatever listens at the
  path, and grpc dials the path itself (no peer check can come between). What keeps
  a stranger from listening there is :meth:`Credentials.check_socket`: the socket and
  its directory must belong to the daemon's user (or root) and the directory must not
  be writable by others. So a process of the daemon's own uid (or root) that may
  write the socket directory can still swap the gRPC socket and read the token: run
  engines as users of their own, with the directory read-only to them (as
  deploy/kubernetes/daemonset.yaml does), never as the daemon's uid.
- **TLS** for a TCP address: ``KVClient(tls=TLS(ca_file=...))``, else
  ``$KVSTORE_TLS_CA`` (the CA that signed the daemon's certificate), with
  ``$KVSTORE_TLS_CERT`` / ``$KVSTORE_TLS_KEY`` for a daemon that asks for client
  certificates (mutual TLS), and ``$KVSTORE_TLS_SERVER_NAME`` when the certificate
  names another host than the address. A token is never sent in clear text off the
  host: a token for a non-loopback TCP address without TLS is refused.
- **Whose socket**: a unix socket could be a fake server put there by another user.
  The client refuses a socket, or a socket directory, that belongs to anyone but the
  expected user (``socket_owner=``, else ``$KVSTORE_SOCKET_OWNER`` (a uid or a user
  name), else this process's own uid) or root, and a directory others may write to.
  The local-call socket a daemon names is used only when the process serving it runs
  as the daemon's uid (SO_PEERCRED); otherwise the client stays on gRPC.
"""

from __future__ import annotations

import collections
import os
import pwd
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from kvclient.errors import InvalidArgumentError, UntrustedSocketError
from kvproto.v1.addresses import is_loopback, socket_path_of
from kvproto.v1.tls import MAX_SECRET_FILE_BYTES, TLS, TLS_CA_ENV, read_file

TOKEN_ENV = "KVSTORE_TOKEN"
TOKEN_FILE_ENV = "KVSTORE_TOKEN_FILE"
SOCKET_OWNER_ENV = "KVSTORE_SOCKET_OWNER"
AUTH_METADATA = "authorization"


@dataclass(frozen=True, slots=True)
class Credentials:
    """What a client shows the daemon (a token) and how it checks the daemon (TLS,
    socket owner). :meth:`resolve` fills in what the arguments leave out from the
    environment."""

    token: str = ""
    tls: TLS | None = None
    socket_owner: int = 0

    @classmethod
    def resolve(
        cls,
        token: str | None = None,
        tls: TLS | None = None,
        socket_owner: int | str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> Credentials:
        env = os.environ if env is None else env
        if token is None:
            token = env.get(TOKEN_ENV, "")
            if not token and env.get(TOKEN_FILE_ENV):
                token = read_token_file(env[TOKEN_FILE_ENV], f"the token (${TOKEN_FILE_ENV})")
        owner = socket_owner if socket_owner is not None else env.get(SOCKET_OWNER_ENV, "")
        return cls(
            token=token.strip(),
            tls=tls if tls is not None else TLS.from_env(env),
            socket_owner=_uid(owner) if owner != "" else os.getuid(),
        )

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((AUTH_METADATA, f"Bearer {self.token}"),) if self.token else ()

    def _channel_credentials(self, addr: str) -> grpc.ChannelCredentials | None:
        path = socket_path_of(addr)
        if path is not None:
            self.check_socket(str(path))
            return None  # a unix socket is guarded by its owner and mode, not TLS
        if self.tls is not None:
            try:
                return self.tls.channel_credentials()
            except ValueError as exc:
                raise InvalidArgumentError(str(exc)) from None
        if self.token and not is_loopback(addr):
            raise InvalidArgumentError(
                f"refusing to send a token in clear text to {addr}: set {TLS_CA_ENV} (or "
                "tls=TLS(...)) for a daemon on another host"
            )
        return None

    def _options(self, options: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
        out = list(options)
        if self.tls is not None:
            out.extend(self.tls.channel_options())
        return out

    def channel(self, addr: str, options: Sequence[tuple[str, Any]]) -> grpc.Channel:
        """A blocking gRPC channel to ``addr`` that carries the token on every call."""
        creds = self._channel_credentials(addr)
        opts = self._options(options)
        channel = (
            grpc.secure_channel(addr, creds, opts) if creds else grpc.insecure_channel(addr, opts)
        )
        if self.token:
            channel = grpc.intercept_channel(channel, _TokenInterceptor(self.metadata))
        return channel

    def aio_channel(self, addr: str, options: Sequence[tuple[str, Any]]) -> grpc.aio.Channel:
        """An asyncio gRPC channel to ``addr`` that carries the token on every call."""
        creds = self._channel_credentials(addr)
        opts = self._options(options)
        interceptors = _aio_token_interceptors(self.metadata) if self.token else None
        if creds:
            return grpc.aio.secure_channel(addr, creds, opts, interceptors=interceptors)
        return grpc.aio.insecure_channel(addr, opts, interceptors=interceptors)

    def check_socket(self, path: str) -> None:
        """Raise UntrustedSocketError unless ``path`` and its directory belong to the
        expected user or root, and the directory is not writable by others. A path
        that does not exist yet is not checked (nothing listens there)."""
        trusted = {self.socket_owner, 0}
        sock = Path(path)
        try:
            folder = sock.parent.stat()
        except FileNotFoundError:
            return
        hint = f"set {SOCKET_OWNER_ENV} (or socket_owner=) to the daemon's user if it is trusted"
        if folder.st_uid not in trusted:
            raise UntrustedSocketError(
                f"the socket directory {sock.parent} belongs to uid {folder.st_uid}, not to "
                f"uid {self.socket_owner}: {hint}"
            )
        if folder.st_mode & 0o022 and not folder.st_mode & stat.S_ISVTX:
            raise UntrustedSocketError(
                f"the socket directory {sock.parent} is writable by other users: one of "
                "them could have replaced the socket"
            )
        try:
            info = sock.lstat()
        except FileNotFoundError:
            return
        if info.st_uid not in trusted:
            raise UntrustedSocketError(
                f"the socket {path} belongs to uid {info.st_uid}, not to uid "
                f"{self.socket_owner}: {hint}"
            )


def read_token_file(path: str, what: str = "the token") -> str:
    """The token a file holds (surrounding whitespace dropped); InvalidArgumentError
    naming ``what`` and the file when it cannot be read."""
    try:
        return _read(path, what).decode().strip()
    except UnicodeDecodeError:
        raise InvalidArgumentError(f"{what} in {path} is not UTF-8 text") from None


def _uid(owner: int | str) -> int:
    if isinstance(owner, int) or str(owner).isdigit():
        return int(owner)
    try:
        return pwd.getpwnam(str(owner)).pw_uid
    except KeyError:
        raise InvalidArgumentError(f"socket owner {owner!r} is not a user of this host") from None


def _read(path: str, what: str) -> bytes:
    try:  # a regular file of a few KiB: /dev/zero is refused, not read without end
        return read_file(path, what, MAX_SECRET_FILE_BYTES)
    except ValueError as exc:
        raise InvalidArgumentError(str(exc)) from None


class _Details(
    collections.namedtuple(
        "_Details",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,
):
    pass


class _TokenInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the token to the metadata of every call of a blocking channel."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def _details(self, details: Any) -> _Details:
        return _Details(
            details.method,
            details.timeout,
            tuple(details.metadata or ()) + self._metadata,
            details.credentials,
            details.wait_for_ready,
            details.compression,
        )

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)


def _aio_token_interceptors(metadata: tuple[tuple[str, str], ...]) -> list[Any]:
    """Interceptors that add the token to every call of an asyncio channel."""

    def details(call: Any) -> grpc.aio.ClientCallDetails:
        return grpc.aio.ClientCallDetails(
            call.method,
            call.timeout,
            grpc.aio.Metadata(*(tuple(call.metadata or ()) + metadata)),
            call.credentials,
            call.wait_for_ready,
        )

    class UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
        async def intercept_unary_unary(self, continuation: Any, call: Any, request: Any) -> Any:
            return await continuation(details(call), request)

    class UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
        async def intercept_unary_stream(self, continuation: Any, call: Any, request: Any) -> Any:
            return await continuation(details(call), request)

    class StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
        async def intercept_stream_unary(self, continuation: Any, call: Any, requests: Any) -> Any:
            return await continuation(details(call), requests)

    return [UnaryUnary(), UnaryStream(), StreamUnary()]
