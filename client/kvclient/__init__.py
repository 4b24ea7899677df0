"""kvclient: Python client of kvstored (sync and asyncio) and the ``kvctl`` tool.

    from kvclient import KVClient

    with KVClient() as client:                      # $KVSTORE_ADDR or the default socket
        ns = client.namespace("llama3-8b", block_tokens=16, num_layers=32,
                              num_kv_heads=8, head_dim=128, dtype="bfloat16")
        hit = ns.lookup(prompt_tokens)              # .tokens cached, per-tier counts
        got = ns.get(prompt_tokens)                 # .blocks: uint8[n, block_bytes]
        ns.put(prompt_tokens, new_blocks, start=got.n_blocks)

Results are frozen dataclasses (numpy arrays for block bytes); errors are
:class:`KVStoreError` subclasses. How it is built: :mod:`kvclient.effects`.
"""

from kvclient.async_client import AsyncKVClient
from kvclient.claims import Claim, ClaimTicket
from kvclient.errors import (
    ArenaUnavailableError,
    AuthenticationError,
    DaemonUnavailableError,
    InvalidArgumentError,
    KVStoreError,
    LayoutMismatchError,
    LeaseError,
    NamespaceNotFoundError,
    OutOfSpaceError,
    RequestTimeoutError,
    UntrustedSocketError,
)
from kvclient.namespace import AsyncNamespace, BlockLease, Namespace
from kvclient.puts_ahead import PendingPut
from kvclient.results import GetResult
from kvclient.sync_client import KVClient
from kvproto.v1.results import (
    Event,
    LookupResult,
    MissReason,
    NamespaceInfo,
    NamespaceStats,
    PutResult,
    ServerInfo,
    Stats,
    TenantStats,
    TierStats,
)
from kvproto.v1.tls import TLS

__all__ = [
    "Claim",
    "ClaimTicket",
    "ArenaUnavailableError",
    "BlockLease",
    "AuthenticationError",
    "AsyncKVClient",
    "AsyncNamespace",
    "DaemonUnavailableError",
    "Event",
    "GetResult",
    "InvalidArgumentError",
    "KVClient",
    "KVStoreError",
    "LayoutMismatchError",
    "LeaseError",
    "LookupResult",
    "MissReason",
    "Namespace",
    "NamespaceInfo",
    "NamespaceNotFoundError",
    "NamespaceStats",
    "OutOfSpaceError",
    "PendingPut",
    "PutResult",
    "RequestTimeoutError",
    "ServerInfo",
    "Stats",
    "TLS",
    "TenantStats",
    "TierStats",
    "UntrustedSocketError",
]
