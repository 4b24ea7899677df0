"""Typed exceptions of the client, and the one place where gRPC errors become them.

Every call of :class:`kvclient.KVClient` / :class:`kvclient.AsyncKVClient` raises a
:class:`KVStoreError` subclass, never a raw ``grpc.RpcError``. The gRPC status code and
details stay available on the exception (``.code``, ``.details``) for logging.

Status codes map to classes as the daemon maps the core's errors to codes:

=====================  ===========================================================
INVALID_ARGUMENT       InvalidArgumentError (bad sizes, token ids, offsets ...)
NOT_FOUND              NamespaceNotFoundError
FAILED_PRECONDITION    LayoutMismatchError or LeaseError (told apart by the
                       ``kvstore-error`` trailing metadata, else by the message)
RESOURCE_EXHAUSTED     OutOfSpaceError
UNAVAILABLE            DaemonUnavailableError (also: the socket cannot be reached)
DEADLINE_EXCEEDED      RequestTimeoutError
UNAUTHENTICATED        AuthenticationError
anything else          KVStoreError
=====================  ===========================================================
"""

from __future__ import annotations

import grpc

ERROR_KIND_METADATA_KEY = "kvstore-error"
"""Trailing metadata key the daemon may set to the core error's class name."""


class KVStoreError(Exception):
    """Base class of every error the client raises.

    ``code`` is the gRPC status code (None when the error arose in the client itself),
    ``details`` the daemon's message, ``addr`` the daemon address the call went to.
    """

    def __init__(
        self,
        message: str,
        *,
        code: grpc.StatusCode | None = None,
        details: str = "",
        addr: str = "",
    ) -> None:
        super().__init__(message)
        self.code = code
        self.details = details or message
        self.addr = addr


class InvalidArgumentError(KVStoreError, ValueError):
    """The request is malformed (INVALID_ARGUMENT), or the client rejected it first."""


class NamespaceNotFoundError(KVStoreError):
    """The namespace id is unknown to the daemon (NOT_FOUND)."""


class LayoutMismatchError(KVStoreError):
    """A namespace was opened again with a different layout (FAILED_PRECONDITION)."""


class LeaseError(KVStoreError):
    """The lease is unknown, released or expired (FAILED_PRECONDITION)."""


class OutOfSpaceError(KVStoreError):
    """The daemon cannot make room now: every candidate is leased or pending
    (RESOURCE_EXHAUSTED). The engine should recompute instead of waiting."""


class DaemonUnavailableError(KVStoreError, ConnectionError):
    """The daemon cannot be reached at ``addr`` or is shutting down (UNAVAILABLE)."""


class RequestTimeoutError(KVStoreError, TimeoutError):
    """The call ran past its deadline (DEADLINE_EXCEEDED)."""


class ArenaUnavailableError(KVStoreError):
    """``use_arena=True`` was asked for but the daemon's shared arena cannot be mapped
    here (another host, no arena file, no permission)."""


class AuthenticationError(KVStoreError, PermissionError):
    """The daemon wants a token and this one is missing or wrong (UNAUTHENTICATED)."""


class UntrustedSocketError(KVStoreError, PermissionError):
    """The daemon's socket, or its directory, belongs to a user this client does not
    trust: another user could have put a server of their own there."""


_BY_CODE: dict[grpc.StatusCode, type[KVStoreError]] = {
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: NamespaceNotFoundError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: OutOfSpaceError,
    grpc.StatusCode.UNAVAILABLE: DaemonUnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: RequestTimeoutError,
}

_BY_KIND: dict[str, type[KVStoreError]] = {
    "InvalidArgument": InvalidArgumentError,
    "UnknownNamespace": NamespaceNotFoundError,
    "LayoutMismatch": LayoutMismatchError,
    "LeaseError": LeaseError,
    "OutOfSpace": OutOfSpaceError,
    "StoreClosed": DaemonUnavailableError,
}


def _error_kind(err: grpc.RpcError) -> str:
    """The ``kvstore-error`` trailing metadata value, or '' when the daemon sent none."""
    trailing = getattr(err, "trailing_metadata", None)
    if trailing is None:
        return ""
    try:
        metadata = trailing()
    except Exception:  # an aio error whose call is gone: no metadata to read
        return ""
    for key, value in metadata or ():
        if key == ERROR_KIND_METADATA_KEY:
            return value.decode() if isinstance(value, bytes) else str(value)
    return ""


def _status(err: grpc.RpcError) -> tuple[grpc.StatusCode | None, str]:
    code_fn = getattr(err, "code", None)
    details_fn = getattr(err, "details", None)
    code = code_fn() if callable(code_fn) else None
    details = details_fn() if callable(details_fn) else ""
    return code, details or ""


def error_from_rpc(err: grpc.RpcError, addr: str) -> KVStoreError:
    """Turn a gRPC error (sync or aio) into the matching :class:`KVStoreError`."""
    code, details = _status(err)
    return error_from_status(code, details, _error_kind(err), addr)


def error_from_status(
    code: grpc.StatusCode | None, details: str, kind: str, addr: str
) -> KVStoreError:
    """The :class:`KVStoreError` of a status code, its message and the daemon's error
    kind (``kvstore-error``), from gRPC or from a local call."""
    cls = _BY_KIND.get(kind)
    if cls is None and code is grpc.StatusCode.FAILED_PRECONDITION:
        cls = LeaseError if "lease" in details.lower() else LayoutMismatchError
    if cls is None:
        cls = _BY_CODE.get(code, KVStoreError) if code is not None else KVStoreError
    if cls is DaemonUnavailableError:
        message = f"cannot reach kvstored at {addr}: {_connect_reason(details)}"
    else:
        name = code.name if code is not None else "UNKNOWN"
        message = f"{details or name} ({name})"
    return cls(message, code=code, details=details, addr=addr)


def _connect_reason(details: str) -> str:
    """The useful tail of gRPC's connect failure ("... error: No such file or directory")."""
    if "failed to connect" in details and "error: " in details:
        return details.rsplit("error: ", 1)[1].strip() or details
    return details or "cannot connect"
