from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVLayoutKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_LAYOUT_UNSPECIFIED: _ClassVar[KVLayoutKind]
    KV_LAYOUT_PAGED: _ClassVar[KVLayoutKind]
    KV_LAYOUT_HF: _ClassVar[KVLayoutKind]
KV_LAYOUT_UNSPECIFIED: KVLayoutKind
KV_LAYOUT_PAGED: KVLayoutKind
KV_LAYOUT_HF: KVLayoutKind

class GpuInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GpuDevice(_message.Message):
    __slots__ = ("index", "name", "compute_capability_major", "compute_capability_minor", "total_memory", "pci_bus_id", "numa_node", "profile")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_CAPABILITY_MAJOR_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_CAPABILITY_MINOR_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MEMORY_FIELD_NUMBER: _ClassVar[int]
    PCI_BUS_ID_FIELD_NUMBER: _ClassVar[int]
    NUMA_NODE_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    index: int
    name: str
    compute_capability_major: int
    compute_capability_minor: int
    total_memory: int
    pci_bus_id: str
    numa_node: int
    profile: str
    def __init__(self, index: _Optional[int] = ..., name: _Optional[str] = ..., compute_capability_major: _Optional[int] = ..., compute_capability_minor: _Optional[int] = ..., total_memory: _Optional[int] = ..., pci_bus_id: _Optional[str] = ..., numa_node: _Optional[int] = ..., profile: _Optional[str] = ...) -> None: ...

class GpuInfoResponse(_message.Message):
    __slots__ = ("platform", "devices", "arena_pinned", "registrations")
    PLATFORM_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    ARENA_PINNED_FIELD_NUMBER: _ClassVar[int]
    REGISTRATIONS_FIELD_NUMBER: _ClassVar[int]
    platform: str
    devices: _containers.RepeatedCompositeFieldContainer[GpuDevice]
    arena_pinned: bool
    registrations: int
    def __init__(self, platform: _Optional[str] = ..., devices: _Optional[_Iterable[_Union[GpuDevice, _Mapping]]] = ..., arena_pinned: _Optional[bool] = ..., registrations: _Optional[int] = ...) -> None: ...

class CudaIpcStorage(_message.Message):
    __slots__ = ("device", "handle", "storage_size_bytes", "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required", "device_uuid")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    device: int
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    device_uuid: str
    def __init__(self, device: _Optional[int] = ..., handle: _Optional[bytes] = ..., storage_size_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ..., device_uuid: _Optional[str] = ...) -> None: ...

class KVTensor(_message.Message):
    __slots__ = ("shape", "stride", "storage_offset", "cuda")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    STRIDE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    CUDA_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    stride: _containers.RepeatedScalarFieldContainer[int]
    storage_offset: int
    cuda: CudaIpcStorage
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., stride: _Optional[_Iterable[int]] = ..., storage_offset: _Optional[int] = ..., cuda: _Optional[_Union[CudaIpcStorage, _Mapping]] = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("kind", "num_layers", "num_kv_heads", "head_dim", "block_tokens", "dtype", "device", "shm_path", "tensors")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    kind: KVLayoutKind
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_tokens: int
    dtype: str
    device: str
    shm_path: str
    tensors: _containers.RepeatedCompositeFieldContainer[KVTensor]
    def __init__(self, kind: _Optional[_Union[KVLayoutKind, str]] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_tokens: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., shm_path: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[KVTensor, _Mapping]]] = ...) -> None: ...

class RegisterKVRequest(_message.Message):
    __slots__ = ("ns_id", "layout", "client_pid")
    NS_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    CLIENT_PID_FIELD_NUMBER: _ClassVar[int]
    ns_id: str
    layout: KVLayout
    client_pid: int
    def __init__(self, ns_id: _Optional[str] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., client_pid: _Optional[int] = ...) -> None: ...

class RegisterKVResponse(_message.Message):
    __slots__ = ("registration_id", "ns_id", "block_bytes", "num_blocks", "stacked", "platform")
    REGISTRATION_ID_FIELD_NUMBER: _ClassVar[int]
    NS_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STACKED_FIELD_NUMBER: _ClassVar[int]
    PLATFORM_FIELD_NUMBER: _ClassVar[int]
    registration_id: int
    ns_id: str
    block_bytes: int
    num_blocks: int
    stacked: bool
    platform: str
    def __init__(self, registration_id: _Optional[int] = ..., ns_id: _Optional[str] = ..., block_bytes: _Optional[int] = ..., num_blocks: _Optional[int] = ..., stacked: _Optional[bool] = ..., platform: _Optional[str] = ...) -> None: ...

class UnregisterKVRequest(_message.Message):
    __slots__ = ("registration_id",)
    REGISTRATION_ID_FIELD_NUMBER: _ClassVar[int]
    registration_id: int
    def __init__(self, registration_id: _Optional[int] = ...) -> None: ...

class UnregisterKVResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class OffloadRequest(_message.Message):
    __slots__ = ("registration_id", "tokens", "extra_keys", "start_block", "block_ids", "priority", "wait_event")
    REGISTRATION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEYS_FIELD_NUMBER: _ClassVar[int]
    START_BLOCK_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    WAIT_EVENT_FIELD_NUMBER: _ClassVar[int]
    registration_id: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    extra_keys: _containers.RepeatedScalarFieldContainer[bytes]
    start_block: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    priority: int
    wait_event: bytes
    def __init__(self, registration_id: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., extra_keys: _Optional[_Iterable[bytes]] = ..., start_block: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., priority: _Optional[int] = ..., wait_event: _Optional[bytes] = ...) -> None: ...

class OffloadResponse(_message.Message):
    __slots__ = ("stored", "existing", "refused", "out_of_space", "bytes", "copy_s")
    STORED_FIELD_NUMBER: _ClassVar[int]
    EXISTING_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    OUT_OF_SPACE_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    COPY_S_FIELD_NUMBER: _ClassVar[int]
    stored: int
    existing: int
    refused: int
    out_of_space: bool
    bytes: int
    copy_s: float
    def __init__(self, stored: _Optional[int] = ..., existing: _Optional[int] = ..., refused: _Optional[int] = ..., out_of_space: _Optional[bool] = ..., bytes: _Optional[int] = ..., copy_s: _Optional[float] = ...) -> None: ...

class OnboardRequest(_message.Message):
    __slots__ = ("registration_id", "tokens", "extra_keys", "start_block", "block_ids")
    REGISTRATION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEYS_FIELD_NUMBER: _ClassVar[int]
    START_BLOCK_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    registration_id: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    extra_keys: _containers.RepeatedScalarFieldContainer[bytes]
    start_block: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, registration_id: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., extra_keys: _Optional[_Iterable[bytes]] = ..., start_block: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class OnboardResponse(_message.Message):
    __slots__ = ("ready_blocks", "onboarded", "ready_tokens", "bytes", "copy_s")
    READY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ONBOARDED_FIELD_NUMBER: _ClassVar[int]
    READY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    COPY_S_FIELD_NUMBER: _ClassVar[int]
    ready_blocks: int
    onboarded: int
    ready_tokens: int
    bytes: int
    copy_s: float
    def __init__(self, ready_blocks: _Optional[int] = ..., onboarded: _Optional[int] = ..., ready_tokens: _Optional[int] = ..., bytes: _Optional[int] = ..., copy_s: _Optional[float] = ...) -> None: ...
