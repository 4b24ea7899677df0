"""Where the daemon is: the address a client dials and the channel options it uses.

Order: the ``addr`` argument, else ``$KVSTORE_ADDR``, else the socket a daemon started
with no arguments listens on (:func:`kvproto.v1.addresses.default_address`). A bare
filesystem path means a unix socket; ``host:port`` is TCP.
"""

from __future__ import annotations

import os

from kvproto.v1.addresses import default_address

ADDR_ENV = "KVSTORE_ADDR"

# Data chunks are up to 4 MiB plus framing and a Put header carries up to
# max_blocks_per_request * block_tokens token ids: lift gRPC's 4 MiB default and let
# the daemon's own limit (ServerInfo.max_message_bytes) be the one that applies.
MAX_MESSAGE_BYTES = 256 << 20
# A restarted daemon should be reachable again within a fraction of a second, not
# after gRPC's default reconnect backoff (1 s growing to 120 s): attempts 100 ms apart,
# growing to 1 s. gRPC also takes min_reconnect_backoff_ms as the least time one
# attempt gets to connect (to the end of the HTTP/2 handshake), so it stays at 5 s:
# at 100 ms, a client of a daemon slow to answer the handshake (busy, or on a loaded
# host) failed its call with UNAVAILABLE after 0.1 s. A refused connection (no daemon
# listening) still fails at once, and is tried again after the backoff.
CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.enable_retries", 0),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 5000),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def resolve_address(addr: str | None = None) -> str:
    """The gRPC target to dial (``unix:///path`` or ``host:port``)."""
    target = addr or os.environ.get(ADDR_ENV, "") or default_address()
    if target.startswith("/"):
        return "unix://" + target
    return target
