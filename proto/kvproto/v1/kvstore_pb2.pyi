from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

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
    __slots__ = ("model", "block_tokens", "block_bytes", "num_layers", "num_kv_heads", "head_dim", "dtype", "rank", "world_size", "tenant_salt", "hash_algorithm", "vocab_size", "codec", "served_model", "tokenizer")
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
    CODEC_FIELD_NUMBER: _ClassVar[int]
    SERVED_MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
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
    codec: str
    served_model: str
    tokenizer: str
    def __init__(self, model: _Optional[str] = ..., block_tokens: _Optional[int] = ..., block_bytes: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., tenant_salt: _Optional[str] = ..., hash_algorithm: _Optional[str] = ..., vocab_size: _Optional[int] = ..., codec: _Optional[str] = ..., served_model: _Optional[str] = ..., tokenizer: _Optional[str] = ...) -> None: ...

class OpenNamespaceRequest(_message.Message):
    __slots__ = ("spec", "name")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    spec: NamespaceSpec
    name: str
    def __init__(self, spec: _Optional[_Union[NamespaceSpec, _Mapping]] = ..., name: _Optional[str] = ...) -> None: ...

class DescribeNamespaceRequest(_message.Message):
    __slots__ = ("ns_id",)
    NS_ID_FIELD_NUMBER: _ClassVar[int]
    ns_id: str
    def __init__(self, ns_id: _Optional[str] = ...) -> None: ...

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
    def __init__(self, ns_id: _Optional[str] = ..., name: _Optional[str] = ..., spec: _Optional[_Union[NamespaceSpec, _Mapping]] = ..., block_bytes: _Optional[int] = ..., block_tokens: _Optional[int] = ..., digest: _Optional[bytes] = ..., key_bytes: _Optional[int] = ..., blocks: _Optional[int] = ..., bytes: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ...) -> None: ...

class ListNamespacesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListNamespacesResponse(_message.Message):
    __slots__ = ("namespaces",)
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceInfo]
    def __init__(self, namespaces: _Optional[_Iterable[_Union[NamespaceInfo, _Mapping]]] = ...) -> None: ...

class ServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerInfoResponse(_message.Message):
    __slots__ = ("version", "platform", "arena_path", "arena_bytes", "host_id", "max_message_bytes", "max_blocks_per_request", "default_lease_ttl_s", "max_lease_ttl_s", "max_chunk_bytes", "max_transfer_bytes", "pid", "uptime_s", "local_socket", "slot_epochs_offset", "slot_epochs_count", "arena_prefaulted", "admission", "uid", "tenant", "arena_socket")
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
    LOCAL_SOCKET_FIELD_NUMBER: _ClassVar[int]
    SLOT_EPOCHS_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SLOT_EPOCHS_COUNT_FIELD_NUMBER: _ClassVar[int]
    ARENA_PREFAULTED_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    ARENA_SOCKET_FIELD_NUMBER: _ClassVar[int]
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
    local_socket: str
    slot_epochs_offset: int
    slot_epochs_count: int
    arena_prefaulted: bool
    admission: str
    uid: int
    tenant: str
    arena_socket: str
    def __init__(self, version: _Optional[str] = ..., platform: _Optional[str] = ..., arena_path: _Optional[str] = ..., arena_bytes: _Optional[int] = ..., host_id: _Optional[str] = ..., max_message_bytes: _Optional[int] = ..., max_blocks_per_request: _Optional[int] = ..., default_lease_ttl_s: _Optional[float] = ..., max_lease_ttl_s: _Optional[float] = ..., max_chunk_bytes: _Optional[int] = ..., max_transfer_bytes: _Optional[int] = ..., pid: _Optional[int] = ..., uptime_s: _Optional[float] = ..., local_socket: _Optional[str] = ..., slot_epochs_offset: _Optional[int] = ..., slot_epochs_count: _Optional[int] = ..., arena_prefaulted: _Optional[bool] = ..., admission: _Optional[str] = ..., uid: _Optional[int] = ..., tenant: _Optional[str] = ..., arena_socket: _Optional[str] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class SessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("ns_id", "tokens", "extra_keys", "wait_pending_s", "explain")
    NS_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEYS_FIELD_NUMBER: _ClassVar[int]
    WAIT_PENDING_S_FIELD_NUMBER: _ClassVar[int]
    EXPLAIN_FIELD_NUMBER: _ClassVar[int]
    ns_id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    extra_keys: _containers.RepeatedScalarFieldContainer[bytes]
    wait_pending_s: float
    explain: bool
    def __init__(self, ns_id: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., extra_keys: _Optional[_Iterable[bytes]] = ..., wait_pending_s: _Optional[float] = ..., explain: _Optional[bool] = ...) -> None: ...

class MissReason(_message.Message):
    __slots__ = ("block", "reason", "tier", "rule", "when", "other_ns", "differs")
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    RULE_FIELD_NUMBER: _ClassVar[int]
    WHEN_FIELD_NUMBER: _ClassVar[int]
    OTHER_NS_FIELD_NUMBER: _ClassVar[int]
    DIFFERS_FIELD_NUMBER: _ClassVar[int]
    block: int
    reason: str
    tier: str
    rule: str
    when: float
    other_ns: str
    differs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, block: _Optional[int] = ..., reason: _Optional[str] = ..., tier: _Optional[str] = ..., rule: _Optional[str] = ..., when: _Optional[float] = ..., other_ns: _Optional[str] = ..., differs: _Optional[_Iterable[str]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("ready_blocks", "ready_tokens", "host_blocks", "disk_blocks", "pending_blocks", "total_blocks", "shared_blocks", "miss")
    READY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    READY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DISK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PENDING_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SHARED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MISS_FIELD_NUMBER: _ClassVar[int]
    ready_blocks: int
    ready_tokens: int
    host_blocks: int
    disk_blocks: int
    pending_blocks: int
    total_blocks: int
    shared_blocks: int
    miss: MissReason
    def __init__(self, ready_blocks: _Optional[int] = ..., ready_tokens: _Optional[int] = ..., host_blocks: _Optional[int] = ..., disk_blocks: _Optional[int] = ..., pending_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ..., shared_blocks: _Optional[int] = ..., miss: _Optional[_Union[MissReason, _Mapping]] = ...) -> None: ...

class LookupBatchRequest(_message.Message):
    __slots__ = ("ns_id", "chains")
    class Chain(_message.Message):
        __slots__ = ("tokens", "extra_keys")
        TOKENS_FIELD_NUMBER: _ClassVar[int]
        EXTRA_KEYS_FIELD_NUMBER: _ClassVar[int]
        tokens: _containers.RepeatedScalarFieldContainer[int]
        extra_keys: _containers.RepeatedScalarFieldContainer[bytes]
        def __init__(self, tokens: _Optional[_Iterable[int]] = ..., extra_keys: _Optional[_Iterable[bytes]] = ...) -> None: ...
    NS_ID_FIELD_NUMBER: _ClassVar[int]
    CHAINS_FIELD_NUMBER: _ClassVar[int]
    ns_id: str
    chains: _containers.RepeatedCompositeFieldContainer[LookupBatchRequest.Chain]
    def __init__(self, ns_id: _Optional[str] = ..., chains: _Optional[_Iterable[_Union[LookupBatchRequest.Chain, _Mapping]]] = ...) -> None: ...

class LookupBatchResponse(_message.Message):
    __slots__ = ("answers",)
    ANSWERS_FIELD_NUMBER: _ClassVar[int]
    answers: _containers.RepeatedCompositeFieldContainer[LookupResponse]
    def __init__(self, answers: _Optional[_Iterable[_Union[LookupResponse, _Mapping]]] = ...) -> None: ...

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
    def __init__(self, ns_id: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., extra_keys: _Optional[_Iterable[bytes]] = ..., start_block: _Optional[int] = ..., max_blocks: _Optional[int] = ...) -> None: ...

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
    def __init__(self, ready_blocks: _Optional[int] = ..., ready_tokens: _Optional[int] = ..., start_block: _Optional[int] = ..., n_blocks: _Optional[int] = ..., block_bytes: _Optional[int] = ..., truncated: _Optional[bool] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: GetHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[GetHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

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
    def __init__(self, index: _Optional[int] = ..., offset: _Optional[int] = ..., size: _Optional[int] = ..., key: _Optional[bytes] = ...) -> None: ...

class AcquireRequest(_message.Message):
    __slots__ = ("ns_id", "tokens", "extra_keys", "max_blocks", "ttl_s", "release_lease_ids", "compact_slots", "unpinned", "counted", "start_block", "read_ahead")
    NS_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEYS_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    RELEASE_LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPACT_SLOTS_FIELD_NUMBER: _ClassVar[int]
    UNPINNED_FIELD_NUMBER: _ClassVar[int]
    COUNTED_FIELD_NUMBER: _ClassVar[int]
    START_BLOCK_FIELD_NUMBER: _ClassVar[int]
    READ_AHEAD_FIELD_NUMBER: _ClassVar[int]
    ns_id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    extra_keys: _containers.RepeatedScalarFieldContainer[bytes]
    max_blocks: int
    ttl_s: float
    release_lease_ids: _containers.RepeatedScalarFieldContainer[int]
    compact_slots: bool
    unpinned: bool
    counted: bool
    start_block: int
    read_ahead: bool
    def __init__(self, ns_id: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., extra_keys: _Optional[_Iterable[bytes]] = ..., max_blocks: _Optional[int] = ..., ttl_s: _Optional[float] = ..., release_lease_ids: _Optional[_Iterable[int]] = ..., compact_slots: _Optional[bool] = ..., unpinned: _Optional[bool] = ..., counted: _Optional[bool] = ..., start_block: _Optional[int] = ..., read_ahead: _Optional[bool] = ...) -> None: ...

class AcquireResponse(_message.Message):
    __slots__ = ("lease_id", "expires_in_s", "slots", "ready_tokens", "arena_path", "slot_offsets", "slot_epochs", "ready_blocks")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    READY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ARENA_PATH_FIELD_NUMBER: _ClassVar[int]
    SLOT_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    SLOT_EPOCHS_FIELD_NUMBER: _ClassVar[int]
    READY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    expires_in_s: float
    slots: _containers.RepeatedCompositeFieldContainer[Slot]
    ready_tokens: int
    arena_path: str
    slot_offsets: _containers.RepeatedScalarFieldContainer[int]
    slot_epochs: _containers.RepeatedScalarFieldContainer[int]
    ready_blocks: int
    def __init__(self, lease_id: _Optional[int] = ..., expires_in_s: _Optional[float] = ..., slots: _Optional[_Iterable[_Union[Slot, _Mapping]]] = ..., ready_tokens: _Optional[int] = ..., arena_path: _Optional[str] = ..., slot_offsets: _Optional[_Iterable[int]] = ..., slot_epochs: _Optional[_Iterable[int]] = ..., ready_blocks: _Optional[int] = ...) -> None: ...

class PrefixReads(_message.Message):
    __slots__ = ("ns_id", "tokens", "extra_keys", "n_blocks", "reads")
    NS_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEYS_FIELD_NUMBER: _ClassVar[int]
    N_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    READS_FIELD_NUMBER: _ClassVar[int]
    ns_id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    extra_keys: _containers.RepeatedScalarFieldContainer[bytes]
    n_blocks: int
    reads: int
    def __init__(self, ns_id: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., extra_keys: _Optional[_Iterable[bytes]] = ..., n_blocks: _Optional[int] = ..., reads: _Optional[int] = ...) -> None: ...

class ReportReadsRequest(_message.Message):
    __slots__ = ("prefixes", "release_lease_ids")
    PREFIXES_FIELD_NUMBER: _ClassVar[int]
    RELEASE_LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    prefixes: _containers.RepeatedCompositeFieldContainer[PrefixReads]
    release_lease_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, prefixes: _Optional[_Iterable[_Union[PrefixReads, _Mapping]]] = ..., release_lease_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReportReadsResponse(_message.Message):
    __slots__ = ("blocks_counted",)
    BLOCKS_COUNTED_FIELD_NUMBER: _ClassVar[int]
    blocks_counted: int
    def __init__(self, blocks_counted: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_id", "more_lease_ids")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    MORE_LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    more_lease_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lease_id: _Optional[int] = ..., more_lease_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PutHeader(_message.Message):
    __slots__ = ("ns_id", "tokens", "extra_keys", "start_block", "n_blocks", "priority", "lease_id")
    NS_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEYS_FIELD_NUMBER: _ClassVar[int]
    START_BLOCK_FIELD_NUMBER: _ClassVar[int]
    N_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    ns_id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    extra_keys: _containers.RepeatedScalarFieldContainer[bytes]
    start_block: int
    n_blocks: int
    priority: int
    lease_id: int
    def __init__(self, ns_id: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., extra_keys: _Optional[_Iterable[bytes]] = ..., start_block: _Optional[int] = ..., n_blocks: _Optional[int] = ..., priority: _Optional[int] = ..., lease_id: _Optional[int] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: PutHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[PutHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("stored", "existing", "refused", "durable")
    STORED_FIELD_NUMBER: _ClassVar[int]
    EXISTING_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    stored: int
    existing: int
    refused: int
    durable: int
    def __init__(self, stored: _Optional[int] = ..., existing: _Optional[int] = ..., refused: _Optional[int] = ..., durable: _Optional[int] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("ns_id", "tokens", "extra_keys", "start_block", "n_blocks", "ttl_s", "priority", "compact_slots", "stage_lease_id", "staged_offsets", "stage_more", "commit")
    NS_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEYS_FIELD_NUMBER: _ClassVar[int]
    START_BLOCK_FIELD_NUMBER: _ClassVar[int]
    N_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    COMPACT_SLOTS_FIELD_NUMBER: _ClassVar[int]
    STAGE_LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    STAGED_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    STAGE_MORE_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    ns_id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    extra_keys: _containers.RepeatedScalarFieldContainer[bytes]
    start_block: int
    n_blocks: int
    ttl_s: float
    priority: int
    compact_slots: bool
    stage_lease_id: int
    staged_offsets: _containers.RepeatedScalarFieldContainer[int]
    stage_more: int
    commit: bool
    def __init__(self, ns_id: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., extra_keys: _Optional[_Iterable[bytes]] = ..., start_block: _Optional[int] = ..., n_blocks: _Optional[int] = ..., ttl_s: _Optional[float] = ..., priority: _Optional[int] = ..., compact_slots: _Optional[bool] = ..., stage_lease_id: _Optional[int] = ..., staged_offsets: _Optional[_Iterable[int]] = ..., stage_more: _Optional[int] = ..., commit: _Optional[bool] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("lease_id", "expires_in_s", "slots", "existing", "refused", "arena_path", "out_of_space", "slot_indices", "slot_offsets", "stage_lease_id", "staged_offsets", "stage_ttl_s", "durable")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    EXISTING_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    ARENA_PATH_FIELD_NUMBER: _ClassVar[int]
    OUT_OF_SPACE_FIELD_NUMBER: _ClassVar[int]
    SLOT_INDICES_FIELD_NUMBER: _ClassVar[int]
    SLOT_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    STAGE_LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    STAGED_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    STAGE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    expires_in_s: float
    slots: _containers.RepeatedCompositeFieldContainer[Slot]
    existing: int
    refused: int
    arena_path: str
    out_of_space: bool
    slot_indices: _containers.RepeatedScalarFieldContainer[int]
    slot_offsets: _containers.RepeatedScalarFieldContainer[int]
    stage_lease_id: int
    staged_offsets: _containers.RepeatedScalarFieldContainer[int]
    stage_ttl_s: float
    durable: int
    def __init__(self, lease_id: _Optional[int] = ..., expires_in_s: _Optional[float] = ..., slots: _Optional[_Iterable[_Union[Slot, _Mapping]]] = ..., existing: _Optional[int] = ..., refused: _Optional[int] = ..., arena_path: _Optional[str] = ..., out_of_space: _Optional[bool] = ..., slot_indices: _Optional[_Iterable[int]] = ..., slot_offsets: _Optional[_Iterable[int]] = ..., stage_lease_id: _Optional[int] = ..., staged_offsets: _Optional[_Iterable[int]] = ..., stage_ttl_s: _Optional[float] = ..., durable: _Optional[int] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("lease_id", "count")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    count: int
    def __init__(self, lease_id: _Optional[int] = ..., count: _Optional[int] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("committed", "durable")
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    committed: int
    durable: int
    def __init__(self, committed: _Optional[int] = ..., durable: _Optional[int] = ...) -> None: ...

class AbandonRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    def __init__(self, lease_id: _Optional[int] = ...) -> None: ...

class AbandonResponse(_message.Message):
    __slots__ = ("dropped",)
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    dropped: int
    def __init__(self, dropped: _Optional[int] = ...) -> None: ...

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
    def __init__(self, ns_id: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., extra_keys: _Optional[_Iterable[bytes]] = ..., start_block: _Optional[int] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: int
    def __init__(self, removed: _Optional[int] = ...) -> None: ...

class ClearRequest(_message.Message):
    __slots__ = ("ns_id",)
    NS_ID_FIELD_NUMBER: _ClassVar[int]
    ns_id: str
    def __init__(self, ns_id: _Optional[str] = ...) -> None: ...

class ClearResponse(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: int
    def __init__(self, removed: _Optional[int] = ...) -> None: ...

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
    def __init__(self, ns_id: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., extra_keys: _Optional[_Iterable[bytes]] = ..., start_block: _Optional[int] = ..., priority: _Optional[int] = ..., duration_s: _Optional[float] = ...) -> None: ...

class SetPriorityResponse(_message.Message):
    __slots__ = ("changed",)
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    changed: int
    def __init__(self, changed: _Optional[int] = ...) -> None: ...

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
    def __init__(self, name: _Optional[str] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., blocks: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ...) -> None: ...

class NamespaceStats(_message.Message):
    __slots__ = ("ns_id", "model", "block_tokens", "block_bytes", "blocks", "bytes", "hits", "misses", "name", "codec", "saved_bytes", "served_model", "tokenizer")
    NS_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    SAVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SERVED_MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    ns_id: str
    model: str
    block_tokens: int
    block_bytes: int
    blocks: int
    bytes: int
    hits: int
    misses: int
    name: str
    codec: str
    saved_bytes: int
    served_model: str
    tokenizer: str
    def __init__(self, ns_id: _Optional[str] = ..., model: _Optional[str] = ..., block_tokens: _Optional[int] = ..., block_bytes: _Optional[int] = ..., blocks: _Optional[int] = ..., bytes: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., name: _Optional[str] = ..., codec: _Optional[str] = ..., saved_bytes: _Optional[int] = ..., served_model: _Optional[str] = ..., tokenizer: _Optional[str] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("tiers", "namespaces", "demotions", "promotions", "pending_blocks", "leases", "corrupt_reads", "disk_queue_bytes", "platform", "uptime_s", "counters", "staged_bytes", "disk_writable", "disk_fault", "tenants", "shared")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
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
    STAGED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_WRITABLE_FIELD_NUMBER: _ClassVar[int]
    DISK_FAULT_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
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
    staged_bytes: int
    disk_writable: bool
    disk_fault: str
    tenants: _containers.RepeatedCompositeFieldContainer[TenantStats]
    shared: SharedTierStats
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., namespaces: _Optional[_Iterable[_Union[NamespaceStats, _Mapping]]] = ..., demotions: _Optional[int] = ..., promotions: _Optional[int] = ..., pending_blocks: _Optional[int] = ..., leases: _Optional[int] = ..., corrupt_reads: _Optional[int] = ..., disk_queue_bytes: _Optional[int] = ..., platform: _Optional[str] = ..., uptime_s: _Optional[float] = ..., counters: _Optional[_Mapping[str, int]] = ..., staged_bytes: _Optional[int] = ..., disk_writable: _Optional[bool] = ..., disk_fault: _Optional[str] = ..., tenants: _Optional[_Iterable[_Union[TenantStats, _Mapping]]] = ..., shared: _Optional[_Union[SharedTierStats, _Mapping]] = ...) -> None: ...

class SharedTierStats(_message.Message):
    __slots__ = ("url", "connected", "nodes", "reachable_nodes", "lookups", "hits", "blocks_read", "bytes_read", "blocks_written", "bytes_written", "write_errors", "writes_dropped", "corrupt", "errors", "breaker_changes", "queue_bytes", "queue_limit_bytes", "unauthenticated", "keyed")
    URL_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    REACHABLE_NODES_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_READ_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    WRITE_ERRORS_FIELD_NUMBER: _ClassVar[int]
    WRITES_DROPPED_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    BREAKER_CHANGES_FIELD_NUMBER: _ClassVar[int]
    QUEUE_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUEUE_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    UNAUTHENTICATED_FIELD_NUMBER: _ClassVar[int]
    KEYED_FIELD_NUMBER: _ClassVar[int]
    url: str
    connected: bool
    nodes: int
    reachable_nodes: int
    lookups: int
    hits: int
    blocks_read: int
    bytes_read: int
    blocks_written: int
    bytes_written: int
    write_errors: int
    writes_dropped: int
    corrupt: int
    errors: int
    breaker_changes: int
    queue_bytes: int
    queue_limit_bytes: int
    unauthenticated: int
    keyed: bool
    def __init__(self, url: _Optional[str] = ..., connected: _Optional[bool] = ..., nodes: _Optional[int] = ..., reachable_nodes: _Optional[int] = ..., lookups: _Optional[int] = ..., hits: _Optional[int] = ..., blocks_read: _Optional[int] = ..., bytes_read: _Optional[int] = ..., blocks_written: _Optional[int] = ..., bytes_written: _Optional[int] = ..., write_errors: _Optional[int] = ..., writes_dropped: _Optional[int] = ..., corrupt: _Optional[int] = ..., errors: _Optional[int] = ..., breaker_changes: _Optional[int] = ..., queue_bytes: _Optional[int] = ..., queue_limit_bytes: _Optional[int] = ..., unauthenticated: _Optional[int] = ..., keyed: _Optional[bool] = ...) -> None: ...

class TenantStats(_message.Message):
    __slots__ = ("tenant", "host_bytes", "disk_bytes", "host_quota", "disk_quota", "namespaces", "blocks", "hits", "misses", "quota_evictions")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    HOST_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_QUOTA_FIELD_NUMBER: _ClassVar[int]
    DISK_QUOTA_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    QUOTA_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    host_bytes: int
    disk_bytes: int
    host_quota: int
    disk_quota: int
    namespaces: int
    blocks: int
    hits: int
    misses: int
    quota_evictions: int
    def __init__(self, tenant: _Optional[str] = ..., host_bytes: _Optional[int] = ..., disk_bytes: _Optional[int] = ..., host_quota: _Optional[int] = ..., disk_quota: _Optional[int] = ..., namespaces: _Optional[int] = ..., blocks: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., quota_evictions: _Optional[int] = ...) -> None: ...

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
    def __init__(self, seq: _Optional[int] = ..., kind: _Optional[_Union[EventKind, str]] = ..., ns_id: _Optional[str] = ..., key: _Optional[bytes] = ..., tier: _Optional[_Union[Tier, str]] = ..., timestamp: _Optional[float] = ...) -> None: ...

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
    def __init__(self, from_seq: _Optional[int] = ..., from_now: _Optional[bool] = ..., ns_id: _Optional[str] = ..., kinds: _Optional[_Iterable[_Union[EventKind, str]]] = ...) -> None: ...

class WatchEventsResponse(_message.Message):
    __slots__ = ("events", "missed")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    MISSED_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[Event]
    missed: int
    def __init__(self, events: _Optional[_Iterable[_Union[Event, _Mapping]]] = ..., missed: _Optional[int] = ...) -> None: ...
