"""Proving a token without sending it: the challenge of the daemon's local sockets.

Why: whoever can put a listener at a unix socket's path receives what clients send
there. When a client sent its token in the first frame, a process of the same user
(in Kubernetes: another team's pod running as the daemon's uid with the socket
directory mounted writable) replaced ``kvstored.local.sock`` with its own listener and
read another tenant's token; it could then call the daemon as that tenant. So neither
local socket (local calls: :mod:`kvproto.v1.local_calls`; the arena hand-out:
:mod:`kvproto.v1.arena_handout`) ever carries a token. Each side proves it knows it:

1. client -> daemon: a fresh random nonce ``Nc`` (:data:`NONCE_BYTES`);
2. daemon -> client: a fresh random nonce ``Nd``;
3. client -> daemon: ``HMAC-SHA256(K, "kvstore-challenge-v1" | "client" | purpose |
   uids | Nc | Nd)``, where ``K = SHA-256(token)``;
4. daemon -> client: the daemon compares that proof with the one each of its tokens
   would give (every one, in constant time, as kvstored.auth compares tokens); when
   one matches, the connection is that caller's and the daemon answers
   ``HMAC-SHA256(K, ... "daemon" ...)`` over the same transcript. The client checks it
   before it sends anything else (and before it maps a handed-out region): a listener
   that does not know the token cannot give it, so the client stops there.

What a fake listener learns is one proof over a nonce of the real daemon's that it
never saw: the daemon draws a new ``Nd`` for every connection, so the capture cannot
authenticate to it (replay), and the proof does not reveal ``K`` (HMAC).

``purpose`` (:data:`LOCAL_CALLS`, :data:`ARENA_HANDOUT`) keeps a proof made for one
socket from counting on the other. ``uids`` binds the proof to the connection as both
ends see it through SO_PEERCRED (the client's effective uid, the daemon's): a process
that relays a live exchange between a client and the daemon (it renamed the daemon's
socket and listens at its path) is the client's peer on one connection and the
daemon's on the other, so unless it runs as the client's uid and the daemon's uid
both, the two ends compute different transcripts and the daemon refuses. A relay by
a process with both uids is the limit: deploy/ gives every team its own uid and
mounts the socket directory read-only in engine pods, so no engine can take the path.
Both ends must see the same uids (no user namespace between them), as the client's
check of the daemon's uid already requires.

Stdlib only: the client and the daemon share this module.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import struct
from dataclasses import dataclass

NONCE_BYTES = 32
PROOF_BYTES = 32  # HMAC-SHA256
LOCAL_CALLS = b"local-calls"
ARENA_HANDOUT = b"arena-handout"
_VERSION = b"kvstore-challenge-v1"
_UIDS = struct.Struct("<qq")
UNKNOWN_UID = -1  # SO_PEERCRED gave nothing: no transcript of the other end matches


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def token_key(token: str) -> bytes:
    """``K``: the key a token proves itself with (what kvstored.auth keeps of a token)."""
    return hashlib.sha256(token.encode()).digest()


@dataclass(frozen=True, slots=True)
class Transcript:
    """What one exchange's proofs cover (see the module docstring)."""

    purpose: bytes
    client_nonce: bytes
    daemon_nonce: bytes
    client_uid: int
    daemon_uid: int

    def __post_init__(self) -> None:
        if len(self.client_nonce) != NONCE_BYTES or len(self.daemon_nonce) != NONCE_BYTES:
            raise ValueError(f"a challenge nonce is {NONCE_BYTES} bytes")

    @classmethod
    def of_client(
        cls, purpose: bytes, client_nonce: bytes, daemon_nonce: bytes, peer_uid: int | None
    ) -> Transcript:
        """The client's view: its own effective uid, the daemon's from SO_PEERCRED."""
        daemon_uid = UNKNOWN_UID if peer_uid is None else peer_uid
        return cls(purpose, client_nonce, daemon_nonce, os.geteuid(), daemon_uid)

    @classmethod
    def of_daemon(
        cls, purpose: bytes, client_nonce: bytes, daemon_nonce: bytes, peer_uid: int | None
    ) -> Transcript:
        """The daemon's view: the client's uid from SO_PEERCRED, its own effective uid."""
        client_uid = UNKNOWN_UID if peer_uid is None else peer_uid
        return cls(purpose, client_nonce, daemon_nonce, client_uid, os.geteuid())

    def _message(self, side: bytes) -> bytes:
        uids = _UIDS.pack(self.client_uid, self.daemon_uid)
        head = b"|".join((_VERSION, side, self.purpose, b""))
        return head + uids + self.client_nonce + self.daemon_nonce

    def client_proof(self, key: bytes) -> bytes:
        return hmac.new(key, self._message(b"client"), hashlib.sha256).digest()

    def daemon_proof(self, key: bytes) -> bytes:
        return hmac.new(key, self._message(b"daemon"), hashlib.sha256).digest()

    def daemon_proved(self, key: bytes, proof: bytes) -> bool:
        """Whether ``proof`` is the daemon's for this transcript (constant time)."""
        return hmac.compare_digest(self.daemon_proof(key), proof)
