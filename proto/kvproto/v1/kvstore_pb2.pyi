from collections.abc import Iterable as _Iterable
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper

DESCRIPTOR: _descriptor.FileDescriptor

class EventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVENT_KIND_UNSPECIFIED: _ClassVar[EventKind]
    EVENT_KIND_STORED: _ClassVar[EventKind]
    EVENT_KIND_REMOVED: _ClassVar[EventKind]
    EVENT_KIND_DEMOTED: _ClassVar[EventKind]
    EVENT_KIND_PROMOTED: _ClassVar[EventKind]
    EVENT_KIND_PENDING_DROPPED: _ClassVar[EventKind]
    EVENT_KIND_CORRUPT: _ClassVar[EventKind]

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_HOST: _ClassVar[Tier]
    TIER_DISK: _ClassVar[Tier]
EVENT_KIND_UNSPECIFIED: EventKind
EVENT_KIND_STORED: EventKind
EVENT_KIND_REMOVED: EventKind
EVENT_KIND_DEMOTED: EventKind
EVENT_KIND_PROMOTED: EventKind
EVENT_KIND_PENDING_DROPPED: EventKind
EVENT_KIND_CORRUPT: EventKind
TIER_UNSPECIFIED: Tier
TIER_HOST: Tier
TIER_DISK: Tier

class NamespaceSpec(_message.Message):
    __slots__ = ("model", "block_tokens", "block_bytes", "num_layers", "num_kv_heads", "head_dim", "dtype", "rank", "world_size", "tenant_salt", "hash_algorithm", "vocab_size")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    TENANT_SALT_FIELD_NUMBER: _ClassVar[int]
    HASH_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    model: str
    block_tokens: int
    block_bytes: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    rank: int
    world_size: int
    tenant_salt: str
    hash_algorithm: str
    vocab_size: int
    def __init__(self, model: str | None = ..., block_tokens: int | None = ..., block_bytes: int | None = ..., num_layers: int | None = ..., num_kv_heads: int | None = ..., head_dim: int | None = ..., dtype: str | None = ..., rank: int | None = ..., world_size: int | None = ..., tenant_salt: str | None = ..., hash_algorithm: str | None = ..., vocab_size: int | None = ...) -> None: ...

class OpenNamespaceRequest(_message.Message):
    __slots__ = ("spec", "name")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    spec: NamespaceSpec
    name: str
    def __init__(self, spec: NamespaceSpec | _Mapping | None = ..., name: str | None = ...) -> None: ...

class DescribeNamespaceRequest(_message.Message):
    __slots__ = ("ns_id",)
    NS_ID_FIELD_NUMBER: _ClassVar[int]
    ns_id: str
    def __init__(self, ns_id: str | None = ...) -> None: ...

class NamespaceInfo(_message.Message):
    __slots__ = ("ns_id", "name", "spec", "block_bytes", "block_tokens", "digest", "key_bytes", "blocks", "bytes", "hits", "misses")
    NS_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    KEY_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    ns_id: str
    name: str
    spec: NamespaceSpec
    block_bytes: int
    block_tokens: int
    digest: bytes
    key_bytes: int
    blocks: int
    bytes: int
    hits: int
    misses: int
    def __init__(self, ns_id: str | None = ..., name: str | None = ..., spec: NamespaceSpec | _Mapping | None = ..., block_bytes: int | None = ..., block_tokens: int | None = ..., digest: bytes | None = ..., key_bytes: int | None = ..., blocks: int | None = ..., bytes: int | None = ..., hits: int | None = ..., misses: int | None = ...) -> None: ...

class ListNamespacesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListNamespacesResponse(_message.Message):
    __slots__ = ("namespaces",)
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceInfo]
    def __init__(self, namespaces: _Iterable[NamespaceInfo | _Mapping] | None = ...) -> None: ...

class ServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerInfoResponse(_message.Message):
    __slots__ = ("version", "platform", "arena_path", "arena_bytes", "host_id", "max_message_bytes", "max_blocks_per_request", "default_lease_ttl_s", "max_lease_ttl_s", "max_chunk_bytes", "max_transfer_bytes", "pid", "uptime_s")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PLATFORM_FIELD_NUMBER: _ClassVar[int]
    ARENA_PATH_FIELD_NUMBER: _ClassVar[int]
    ARENA_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCKS_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    MAX_LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    version: str
    platform: str
    arena_path: str
    arena_bytes: int
    host_id: str
    max_message_bytes: int
    max_blocks_per_request: int
    default_lease_ttl_s: float
    max_lease_ttl_s: float
    max_chunk_bytes: int
    max_transfer_bytes: int
    pid: int
    uptime_s: float
    def __init__(self, version: str | None = ..., platform: str | None = ..., arena_path: str | None = ..., arena_bytes: int | None = ..., host_id: str | None = ..., max_message_bytes: int | None = ..., max_blocks_per_request: int | None = ..., default_lease_ttl_s: float | None = ..., max_lease_ttl_s: float | None = ..., max_chunk_bytes: int | None = ..., max_transfer_bytes: int | None = ..., pid: int | None = ..., uptime_s: float | None = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("ns_id", "tokens", "extra_keys", "wait_pending_s")
    NS_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEYS_FIELD_NUMBER: _ClassVar[int]
    WAIT_PENDING_S_FIELD_NUMBER: _ClassVar[int]
    ns_id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    extra_keys: _containers.RepeatedScalarFieldContainer[bytes]
    wait_pending_s: float
    def __init__(self, ns_id: str | None = ..., tokens: _Iterable[int] | None = ..., extra_keys: _Iterable[bytes] | None = ..., wait_pending_s: float | None = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("ready_blocks", "ready_tokens", "host_blocks", "disk_blocks", "pending_blocks", "total_blocks")
    READY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    READY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DISK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PENDING_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ready_blocks: int
    ready_tokens: int
    host_blocks: int
    disk_blocks: int
    pending_blocks: int
    total_blocks: int
    def __init__(self, ready_blocks: int | None = ..., ready_tokens: int | None = ..., host_blocks: int | None = ..., disk_blocks: int | None = ..., pending_blocks: int | None = ..., total_blocks: int | None = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("ns_id", "tokens", "extra_keys", "start_block", "max_blocks")
    NS_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEYS_FIELD_NUMBER: _ClassVar[int]
    START_BLOCK_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ns_id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    extra_keys: _containers.RepeatedScalarFieldContainer[bytes]
    start_block: int
    max_blocks: int
    def __init__(self, ns_id: str | None = ..., tokens: _Iterable[int] | None = ..., extra_keys: _Iterable[bytes] | None = ..., start_block: int | None = ..., max_blocks: int | None = ...) -> None: ...

class GetHeader(_message.Message):
    __slots__ = ("ready_blocks", "ready_tokens", "start_block", "n_blocks", "block_bytes", "truncated")
    READY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    READY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    START_BLOCK_FIELD_NUMBER: _ClassVar[int]
    N_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    ready_blocks: int
    ready_tokens: int
    start_block: int
    n_blocks: int
    block_bytes: int
    truncated: bool
    def __init__(self, ready_blocks: int | None = ..., ready_tokens: int | None = ..., start_block: int | None = ..., n_blocks: int | None = ..., block_bytes: int | None = ..., truncated: bool | None = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: GetHeader
    data: bytes
    def __init__(self, header: GetHeader | _Mapping | None = ..., data: bytes | None = ...) -> None: ...

class Slot(_message.Message):
    __slots__ = ("index", "offset", "size", "key")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    index: int
    offset: int
    size: int
    key: bytes
    def __init__(self, index: int | None = ..., offset: int | None = ..., size: int | None = ..., key: bytes | None = ...) -> None: ...

class AcquireRequest(_message.Message):
    __slots__ = ("ns_id", "tokens", "extra_keys", "max_blocks", "ttl_s")
    NS_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEYS_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    ns_id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    extra_keys: _containers.RepeatedScalarFieldContainer[bytes]
    max_blocks: int
    ttl_s: float
    def __init__(self, ns_id: str | None = ..., tokens: _Iterable[int] | None = ..., extra_keys: _Iterable[bytes] | None = ..., max_blocks: int | None = ..., ttl_s: float | None = ...) -> None: ...

class AcquireResponse(_message.Message):
    __slots__ = ("lease_id", "expires_in_s", "slots", "ready_tokens")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    READY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    expires_in_s: float
    slots: _containers.RepeatedCompositeFieldContainer[Slot]
    ready_tokens: int
    def __init__(self, lease_id: int | None = ..., expires_in_s: float | None = ..., slots: _Iterable[Slot | _Mapping] | None = ..., ready_tokens: int | None = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    def __init__(self, lease_id: int | None = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PutHeader(_message.Message):
    __slots__ = ("ns_id", "tokens", "extra_keys", "start_block", "n_blocks", "priority")
    NS_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEYS_FIELD_NUMBER: _ClassVar[int]
    START_BLOCK_FIELD_NUMBER: _ClassVar[int]
    N_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    ns_id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    extra_keys: _containers.RepeatedScalarFieldContainer[bytes]
    start_block: int
    n_blocks: int
    priority: int
    def __init__(self, ns_id: str | None = ..., tokens: _Iterable[int] | None = ..., extra_keys: _Iterable[bytes] | None = ..., start_block: int | None = ..., n_blocks: int | None = ..., priority: int | None = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: PutHeader
    data: bytes
    def __init__(self, header: PutHeader | _Mapping | None = ..., data: bytes | None = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("stored", "existing", "refused")
    STORED_FIELD_NUMBER: _ClassVar[int]
    EXISTING_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    stored: int
    existing: int
    refused: int
    def __init__(self, stored: int | None = ..., existing: int | None = ..., refused: int | None = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("ns_id", "tokens", "extra_keys", "start_block", "n_blocks", "ttl_s", "priority")
    NS_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEYS_FIELD_NUMBER: _ClassVar[int]
    START_BLOCK_FIELD_NUMBER: _ClassVar[int]
    N_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    ns_id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    extra_keys: _containers.RepeatedScalarFieldContainer[bytes]
    start_block: int
    n_blocks: int
    ttl_s: float
    priority: int
    def __init__(self, ns_id: str | None = ..., tokens: _Iterable[int] | None = ..., extra_keys: _Iterable[bytes] | None = ..., start_block: int | None = ..., n_blocks: int | None = ..., ttl_s: float | None = ..., priority: int | None = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("lease_id", "expires_in_s", "slots", "existing", "refused")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    EXISTING_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    expires_in_s: float
    slots: _containers.RepeatedCompositeFieldContainer[Slot]
    existing: int
    refused: int
    def __init__(self, lease_id: int | None = ..., expires_in_s: float | None = ..., slots: _Iterable[Slot | _Mapping] | None = ..., existing: int | None = ..., refused: int | None = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("lease_id", "count")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    count: int
    def __init__(self, lease_id: int | None = ..., count: int | None = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("committed",)
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    committed: int
    def __init__(self, committed: int | None = ...) -> None: ...

class AbandonRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    def __init__(self, lease_id: int | None = ...) -> None: ...

class AbandonResponse(_message.Message):
    __slots__ = ("dropped",)
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    dropped: int
    def __init__(self, dropped: int | None = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("ns_id", "tokens", "extra_keys", "start_block")
    NS_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEYS_FIELD_NUMBER: _ClassVar[int]
    START_BLOCK_FIELD_NUMBER: _ClassVar[int]
    ns_id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    extra_keys: _containers.RepeatedScalarFieldContainer[bytes]
    start_block: int
    def __init__(self, ns_id: str | None = ..., tokens: _Iterable[int] | None = ..., extra_keys: _Iterable[bytes] | None = ..., start_block: int | None = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: int
    def __init__(self, removed: int | None = ...) -> None: ...

class ClearRequest(_message.Message):
    __slots__ = ("ns_id",)
    NS_ID_FIELD_NUMBER: _ClassVar[int]
    ns_id: str
    def __init__(self, ns_id: str | None = ...) -> None: ...

class ClearResponse(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: int
    def __init__(self, removed: int | None = ...) -> None: ...

class SetPriorityRequest(_message.Message):
    __slots__ = ("ns_id", "tokens", "extra_keys", "start_block", "priority", "duration_s")
    NS_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEYS_FIELD_NUMBER: _ClassVar[int]
    START_BLOCK_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    ns_id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    extra_keys: _containers.RepeatedScalarFieldContainer[bytes]
    start_block: int
    priority: int
    duration_s: float
    def __init__(self, ns_id: str | None = ..., tokens: _Iterable[int] | None = ..., extra_keys: _Iterable[bytes] | None = ..., start_block: int | None = ..., priority: int | None = ..., duration_s: float | None = ...) -> None: ...

class SetPriorityResponse(_message.Message):
    __slots__ = ("changed",)
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    changed: int
    def __init__(self, changed: int | None = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("name", "capacity_bytes", "used_bytes", "blocks", "hits", "misses", "evictions", "bytes_in", "bytes_out")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    name: str
    capacity_bytes: int
    used_bytes: int
    blocks: int
    hits: int
    misses: int
    evictions: int
    bytes_in: int
    bytes_out: int
    def __init__(self, name: str | None = ..., capacity_bytes: int | None = ..., used_bytes: int | None = ..., blocks: int | None = ..., hits: int | None = ..., misses: int | None = ..., evictions: int | None = ..., bytes_in: int | None = ..., bytes_out: int | None = ...) -> None: ...

class NamespaceStats(_message.Message):
    __slots__ = ("ns_id", "model", "block_tokens", "block_bytes", "blocks", "bytes", "hits", "misses", "name")
    NS_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ns_id: str
    model: str
    block_tokens: int
    block_bytes: int
    blocks: int
    bytes: int
    hits: int
    misses: int
    name: str
    def __init__(self, ns_id: str | None = ..., model: str | None = ..., block_tokens: int | None = ..., block_bytes: int | None = ..., blocks: int | None = ..., bytes: int | None = ..., hits: int | None = ..., misses: int | None = ..., name: str | None = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("tiers", "namespaces", "demotions", "promotions", "pending_blocks", "leases", "corrupt_reads", "disk_queue_bytes", "platform", "uptime_s", "counters")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: str | None = ..., value: int | None = ...) -> None: ...
    TIERS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    PENDING_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_READS_FIELD_NUMBER: _ClassVar[int]
    DISK_QUEUE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PLATFORM_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceStats]
    demotions: int
    promotions: int
    pending_blocks: int
    leases: int
    corrupt_reads: int
    disk_queue_bytes: int
    platform: str
    uptime_s: float
    counters: _containers.ScalarMap[str, int]
    def __init__(self, tiers: _Iterable[TierStats | _Mapping] | None = ..., namespaces: _Iterable[NamespaceStats | _Mapping] | None = ..., demotions: int | None = ..., promotions: int | None = ..., pending_blocks: int | None = ..., leases: int | None = ..., corrupt_reads: int | None = ..., disk_queue_bytes: int | None = ..., platform: str | None = ..., uptime_s: float | None = ..., counters: _Mapping[str, int] | None = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("seq", "kind", "ns_id", "key", "tier", "timestamp")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NS_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    seq: int
    kind: EventKind
    ns_id: str
    key: bytes
    tier: Tier
    timestamp: float
    def __init__(self, seq: int | None = ..., kind: EventKind | str | None = ..., ns_id: str | None = ..., key: bytes | None = ..., tier: Tier | str | None = ..., timestamp: float | None = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("from_seq", "from_now", "ns_id", "kinds")
    FROM_SEQ_FIELD_NUMBER: _ClassVar[int]
    FROM_NOW_FIELD_NUMBER: _ClassVar[int]
    NS_ID_FIELD_NUMBER: _ClassVar[int]
    KINDS_FIELD_NUMBER: _ClassVar[int]
    from_seq: int
    from_now: bool
    ns_id: str
    kinds: _containers.RepeatedScalarFieldContainer[EventKind]
    def __init__(self, from_seq: int | None = ..., from_now: bool | None = ..., ns_id: str | None = ..., kinds: _Iterable[EventKind | str] | None = ...) -> None: ...

class WatchEventsResponse(_message.Message):
    __slots__ = ("events", "missed")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    MISSED_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[Event]
    missed: int
    def __init__(self, events: _Iterable[Event | _Mapping] | None = ..., missed: int | None = ...) -> None: ...
