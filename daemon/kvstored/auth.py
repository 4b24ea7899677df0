"""Who is calling: a token names a tenant (or the admin), checked on every call.

Tenants are declared in the daemon's TOML config, each with a file holding its token
and optional quotas (kvstore.tenants.Quota)::

    admin_token_file = "/etc/kvstore/admin.token"
    [tenants.team-a]
    token_file = "/etc/kvstore/team-a.token"
    host_bytes = "8 GiB"
    disk_bytes = "100 GiB"

With no tenant and no admin token the daemon serves anyone who can reach its socket
as before: one tenant, every namespace visible (:data:`ANYONE`). With either, every
call needs a token: gRPC calls carry ``authorization: Bearer <token>`` in their
metadata; local-call connections and the arena hand-out never carry it, they prove
it over fresh nonces and the daemon proves it back (kvproto.v1.challenge). A missing
or unknown token is UNAUTHENTICATED.

Tokens are compared as SHA-256 digests with ``hmac.compare_digest``, against every
known token each time, so how long a check takes says nothing about which token (or
how much of one) matched. A token is at least :data:`MIN_TOKEN_CHARS` characters and
no two principals share one.
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
import os
import stat
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvproto.v1.challenge import Transcript, token_key
from kvproto.v1.tls import MAX_SECRET_FILE_BYTES, read_file_stat
from kvstore.errors import InvalidArgument, LeaseError, Unauthenticated, UnknownNamespace
from kvstore.keys import NamespaceSpec
from kvstore.store import Store
from kvstore.tenants import NAME_RE, Quota, tenant_of, tenant_salt
from kvstored.names import NamespaceNames

AUTH_METADATA = "authorization"
BEARER = "Bearer "
MIN_TOKEN_CHARS = 16
TENANT_KEYS = ("token_file", "host_bytes", "disk_bytes", "events_topic")


@dataclass(frozen=True, slots=True)
class TenantConfig:
    """One ``[tenants.<name>]`` table of the config."""

    name: str
    token_file: str
    quota: Quota
    events_topic: str = ""  # its namespaces' KV events go on this topic; "": not published


@dataclass(frozen=True, slots=True)
class Caller:
    """Whose call this is: a tenant, or the admin (who sees every namespace)."""

    tenant: str
    admin: bool = False

    def owns(self, spec: NamespaceSpec) -> bool:
        return self.admin or tenant_of(spec.tenant_salt) == self.tenant


ANYONE = Caller("", admin=True)  # a daemon without tokens: one tenant, as before tenants
NOBODYS = NamespaceSpec("-", 16, 4096, tenant_salt=tenant_salt("-", ""))  # no tenant's


def parse_tenants(
    table: object, parse_size: Any, source: str
) -> tuple[TenantConfig, ...]:
    """The ``tenants`` table of a TOML file -> TenantConfigs; ValueError naming the
    first bad entry (the caller turns it into a ConfigError)."""
    if not isinstance(table, Mapping):
        raise ValueError(f"expected a table of [tenants.<name>] tables ({source})")
    out = []
    for name, entry in table.items():
        if not NAME_RE.match(name):
            raise ValueError(
                f"{name!r} is not a tenant name: 1-63 of [a-z0-9_-], starting with a "
                f"letter or digit ({source})"
            )
        if not isinstance(entry, Mapping):
            raise ValueError(f"tenants.{name} must be a table ({source})")
        unknown = sorted(set(entry) - set(TENANT_KEYS))
        if unknown:
            raise ValueError(
                f"tenants.{name}: unknown key {unknown[0]!r}; keys are "
                f"{', '.join(TENANT_KEYS)} ({source})"
            )
        token_file = entry.get("token_file")
        if not isinstance(token_file, str) or not token_file:
            raise ValueError(f"tenants.{name}: token_file is required ({source})")
        try:
            quota = Quota(
                parse_size(entry.get("host_bytes", 0)), parse_size(entry.get("disk_bytes", 0))
            )
        except ValueError as exc:
            raise ValueError(f"tenants.{name}: {exc} ({source})") from None
        topic = entry.get("events_topic", "")
        if not isinstance(topic, str):
            raise ValueError(f"tenants.{name}: events_topic must be a string ({source})")
        path = os.path.abspath(os.path.expanduser(token_file))
        out.append(TenantConfig(name, path, quota, topic))
    return tuple(out)


def read_token(path: str, whose: str) -> str:
    """The token in ``path`` (see :func:`read_secret`); ValueError saying why not."""
    token = read_secret(path, f"the token of {whose}", MIN_TOKEN_CHARS)
    if any(c.isspace() for c in token):
        raise ValueError(f"the token of {whose} in {path} must have no spaces")
    return token


MIN_SECRET_CHARS = 32  # the shared tier's MAC key


def read_secret(path: str, what: str, min_chars: int = MIN_SECRET_CHARS) -> str:
    """The secret in ``path`` (surrounding whitespace dropped); ValueError saying why
    not: unreadable, not a regular file of at most MAX_SECRET_FILE_BYTES (a device
    such as /dev/zero would be read without end), shorter than ``min_chars``, or open
    to others. Refused as ssh
    refuses a private key others may read: a file other users may read or write, or
    its group write; its group may read it only when that is this process's own group
    (Kubernetes mounts a Secret so, for the pod's ``fsGroup``)."""
    data, info = read_file_stat(path, what, MAX_SECRET_FILE_BYTES)  # regular, small
    try:
        secret = data.decode().strip()
    except UnicodeDecodeError:
        raise ValueError(f"cannot read {what} from {path}: not UTF-8 text") from None
    mode = info.st_mode
    if mode & 0o027 or (mode & 0o040 and info.st_gid != os.getegid()):
        raise ValueError(
            f"{what} in {path} is open to other users (mode {stat.S_IMODE(mode):04o}, "
            f"group {info.st_gid}): chmod 600 {path}"
        )
    if len(secret) < min_chars:
        raise ValueError(
            f"{what} in {path} must be at least {min_chars} characters "
            "(e.g. `openssl rand -hex 32`)"
        )
    return secret


log = logging.getLogger("kvstored.auth")

BAD_TOKEN_LOG_S = 10.0  # at most one line per this long about refused tokens
BAD_TOKEN_FREE = 100  # refusals a peer gets per such window before each is held back
BAD_TOKEN_DELAY_S = 0.1  # how long each refusal past those is held back


class BadTokens:
    """Calls refused for a missing or unknown token: told in the log at most once per
    BAD_TOKEN_LOG_S (how many since the last line, and the newest caller's address);
    past BAD_TOKEN_FREE refusals of one peer in that time, each of its refusals is
    answered BAD_TOKEN_DELAY_S late (by the caller of :meth:`note`), so a peer guessing
    tokens over one connection goes at ten calls a second, not thousands, while a
    client started without its token still hears at once why."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._since_line = 0
        self._line_at = -BAD_TOKEN_LOG_S
        self._per_peer: dict[str, int] = {}  # refusals since the last line, per peer

    def note(self, peer: str) -> float:
        """One more refused call from ``peer``; how long to hold its answer."""
        now = time.monotonic()
        with self._lock:
            self._since_line += 1
            refused = self._per_peer[peer] = self._per_peer.get(peer, 0) + 1
            delay = BAD_TOKEN_DELAY_S if refused > BAD_TOKEN_FREE else 0.0
            if now - self._line_at < BAD_TOKEN_LOG_S:
                return delay
            count, self._since_line, self._line_at = self._since_line, 0, now
            self._per_peer = {}
        log.warning(
            "%d calls refused for a missing or unknown token in the last %.0f s "
            "(the newest from %s)", count, BAD_TOKEN_LOG_S, peer or "the local socket",
            extra={"event": "bad_token"},
        )  # fmt: skip
        return delay


BAD_TOKENS = BadTokens()  # the daemon's (one per process, like its log)


def _digest(token: str) -> bytes:
    return token_key(token)  # SHA-256: also the key of the local sockets' challenge


class Tokens:
    """The daemon's tokens -> callers. Read once, at start-up."""

    def __init__(self, tenants: Sequence[TenantConfig], admin_token_file: str = "") -> None:
        entries: list[tuple[str, str, Caller]] = [
            (t.token_file, f"tenant {t.name}", Caller(t.name)) for t in tenants
        ]
        if admin_token_file:
            entries.append((admin_token_file, "the admin", Caller("", admin=True)))
        self._known: list[tuple[bytes, Caller]] = []
        seen: dict[bytes, str] = {}
        for path, whose, caller in entries:
            digest = _digest(read_token(path, whose))
            if digest in seen:
                raise ValueError(f"{whose} and {seen[digest]} have the same token ({path})")
            seen[digest] = whose
            self._known.append((digest, caller))

    @property
    def enabled(self) -> bool:
        """True when calls need a token."""
        return bool(self._known)

    def caller(self, token: str | None) -> Caller:
        """The caller a token names; Unauthenticated when the daemon needs one and
        ``token`` is missing or unknown."""
        if not self._known:
            return ANYONE
        if not token:
            raise Unauthenticated(
                "this daemon needs a token: set KVSTORE_TOKEN (or KVSTORE_TOKEN_FILE), "
                "or pass token= to the client"
            )
        digest = _digest(token)
        found: Caller | None = None
        for known, caller in self._known:  # every one compared: no timing oracle
            if hmac.compare_digest(digest, known):
                found = caller
        if found is None:
            raise Unauthenticated("the token is not valid for this daemon")
        return found

    def answer_challenge(self, transcript: Transcript, proof: bytes) -> tuple[Caller, bytes]:
        """The caller whose token made ``proof`` over ``transcript``, and the daemon's
        proof in return (kvproto.v1.challenge: how the local sockets check a token that
        is never sent); Unauthenticated when no token did. Every token is tried and
        compared in constant time, as in :meth:`caller`. On a daemon without tokens:
        ANYONE, and no proof (there is no token to know)."""
        if not self._known:
            return ANYONE, b""
        found: tuple[bytes, Caller] | None = None
        for known, caller in self._known:  # every one compared: no timing oracle
            if hmac.compare_digest(transcript.client_proof(known), proof):
                found = (known, caller)
        if found is None:
            raise Unauthenticated("the token is not valid for this daemon")
        return found[1], transcript.daemon_proof(found[0])

    def caller_of(self, metadata: Iterable[tuple[str, Any]] | None) -> Caller:
        """The caller of a gRPC call, from its ``authorization`` metadata."""
        if not self._known:
            return ANYONE
        for key, value in metadata or ():
            if key == AUTH_METADATA:
                text = value.decode() if isinstance(value, bytes) else str(value)
                return self.caller(text[len(BEARER) :] if text.startswith(BEARER) else "")
        return self.caller(None)


class Access:
    """Who a call's caller is, and which namespaces it may name: one object shared by
    the KVStore and KVGpu servicers, so both scope namespaces the same way."""

    def __init__(self, store: Store, names: NamespaceNames, tokens: Tokens) -> None:
        self._store = store
        self._names = names
        self.tokens = tokens

    def caller(self, context: Any) -> Caller:
        """The caller of a call: set by the local-call server on its connections'
        contexts, else from the gRPC call's metadata. Unauthenticated if none."""
        caller = getattr(context, "caller", None)
        if caller is not None:
            return caller  # type: ignore[no-any-return]
        return self.tokens.caller_of(context.invocation_metadata())

    def spec(self, ns_id: str, caller: Caller) -> NamespaceSpec:
        """The namespace an ns_id or a name (in the caller's scope) names, if the caller
        owns it; another tenant's is UnknownNamespace, word for word as a missing one."""
        if not ns_id:
            raise InvalidArgument("ns_id is required")
        found = self._store.find_namespace(self._names.resolve(ns_id, caller.tenant))
        # one path for a missing namespace and another tenant's: the same statements
        # run, the same error is raised, so its time does not tell which it was
        owned = caller.owns(found or NOBODYS)
        if found is None or not owned:
            raise UnknownNamespace(f"unknown namespace {ns_id!r}; open it first")
        return found

    def lease(self, lease_id: int, caller: Caller) -> int:
        """``lease_id``, if the caller may name it: a lease held for a namespace it owns.
        Another tenant's (a leaked id, a stolen ticket) is LeaseError, word for word as
        an unknown one."""
        ns_id = self._store.lease_namespace(lease_id)
        if ns_id is not None and not caller.admin:
            try:
                owned = caller.owns(self._store.namespace(ns_id))
            except UnknownNamespace:
                owned = False
            if not owned:
                raise LeaseError(f"unknown lease {lease_id}")
        return lease_id

    def visible(self, caller: Caller, ns_id: str) -> bool:
        """Whether the caller may see blocks (events, stats) of namespace ``ns_id``."""
        if caller.admin:
            return True
        try:
            return caller.owns(self._store.namespace(ns_id))
        except UnknownNamespace:
            return False

    def scoped(self, caller: Caller, spec: NamespaceSpec) -> NamespaceSpec:
        """The spec a caller's OpenNamespace opens: a tenant's salt folds in its name."""
        if not caller.tenant:
            return spec
        return dataclasses.replace(spec, tenant_salt=tenant_salt(caller.tenant, spec.tenant_salt))
