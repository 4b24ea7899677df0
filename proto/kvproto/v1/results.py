"""The result types that cross the wire, one set for the store, the daemon and the client.

Plain frozen dataclasses (and one named tuple) of Python ints, strs and bytes: the core
returns them, the daemon turns them into messages and the client turns the messages
back into them, both through :mod:`kvproto.v1.result_messages`, which maps fields of the
same name. Nothing here imports protobuf, so the core can use them without it.

Fields the core cannot know (the daemon's platform and uptime, a namespace's bound
name, the durable count of a write-through put) default to empty and are filled in by
the daemon with :func:`dataclasses.replace`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


@dataclass(frozen=True, slots=True)
class PutResult:
    """What a put did with each offered block: the three counts add up to the offer."""

    stored: int  # newly stored and ready
    existing: int  # already stored (or being computed by another owner): nothing written
    refused: int  # not admitted: no room, or an ancestor is missing
    # of the stored, committed to the daemon's disk before it answered: only with its
    # write-through admission (ServerInfo.admission); these survive a crash of the daemon
    durable: int = 0
    out_of_space: bool = False  # a block was refused because no room could be made

    @classmethod
    def of_reservation(
        cls, existing: int, refused: int, reserved: int, committed: int, durable: int = 0
    ) -> PutResult:
        """A put that reserved ``reserved`` slots (beside the ``existing`` and
        ``refused`` blocks) and committed ``committed`` of them: the daemon's Put answer
        and the client's arena put count alike, the slots not committed as refused."""
        return cls(committed, existing, refused + reserved - committed, durable)

    @property
    def offered(self) -> int:
        return self.stored + self.existing + self.refused

    def __add__(self, other: PutResult) -> PutResult:
        return PutResult(
            self.stored + other.stored,
            self.existing + other.existing,
            self.refused + other.refused,
            self.durable + other.durable,
            self.out_of_space or other.out_of_space,
        )


@dataclass(frozen=True, slots=True)
class MissReason:
    """Why a prompt is not served whole (``Namespace.why``; ``kvctl why``): its first
    block that is not, and the reason the daemon knows.

    ``reason``: ``served`` (every block is), ``pending`` (another writer is computing
    it), ``lost`` (it left the store: from ``tier``, by ``rule`` -- priority, quota,
    ttl, corrupt, deleted -- at wall-clock ``when``), ``never_stored`` (or lost longer
    ago than the daemon remembers), ``other_namespace`` (namespace ``other_ns`` holds
    it; the two differ in the fields ``differs`` names).
    """

    block: int
    reason: str
    tier: str = ""
    rule: str = ""
    when: float = 0.0
    other_ns: str = ""
    differs: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class LookupResult:
    """Longest usable prefix of a prompt.

    ``tokens`` is how many leading tokens are covered by ready blocks
    (``blocks * block_tokens``); ``host_blocks + disk_blocks == blocks``.
    ``pending_blocks`` follow the ready prefix and are being computed by another
    session (early reuse: wait for them or recompute). ``shared_blocks`` of the
    ``host_blocks`` came from the shared tier (another node) during this call.
    """

    tokens: int
    blocks: int
    host_blocks: int
    disk_blocks: int
    pending_blocks: int
    shared_blocks: int = 0


@dataclass(frozen=True, slots=True)
class TierStats:
    name: str  # "host" | "disk"
    capacity_bytes: int
    used_bytes: int
    blocks: int
    hits: int
    misses: int
    evictions: int
    bytes_in: int
    bytes_out: int

    @property
    def used_fraction(self) -> float:
        return self.used_bytes / self.capacity_bytes if self.capacity_bytes else 0.0

    @property
    def hit_rate(self) -> float:
        lookups = self.hits + self.misses
        return self.hits / lookups if lookups else 0.0


@dataclass(frozen=True, slots=True)
class NamespaceStats:
    ns_id: str
    model: str
    block_tokens: int
    block_bytes: int
    blocks: int
    bytes: int
    hits: int
    misses: int
    name: str = ""  # bound name, "" if none (the daemon's, not the store's)
    codec: str = "exact"  # how its disk and shared tiers keep its blocks (kvstore.codecs)
    saved_bytes: int = 0  # bytes the codec saves: blocks encoded on disk and in host x bytes saved
    served_model: str = ""  # the name its engine serves the model under ("": none declared)
    tokenizer: str = ""  # where its tokenizer is: a Hugging Face id or a directory


@dataclass(frozen=True, slots=True)
class TenantStats:
    """One tenant's part of the daemon (``kvctl status --tenants``, admin token)."""

    tenant: str
    host_bytes: int
    disk_bytes: int
    host_quota: int  # 0: none
    disk_quota: int
    namespaces: int
    blocks: int
    hits: int
    misses: int
    quota_evictions: int  # blocks it evicted of its own to stay within its quota


@dataclass(frozen=True, slots=True)
class SharedStats:
    """The shared tier (a Valkey / Redis Cluster behind the node's own tiers)."""

    url: str  # without its password
    connected: bool
    nodes: int  # primaries in the cluster's slot map
    reachable_nodes: int  # of those, answering (breaker closed)
    lookups: int  # reads that asked the cluster
    hits: int  # of those, found at least one block
    blocks_read: int
    bytes_read: int
    blocks_written: int
    bytes_written: int
    write_errors: int  # blocks a node did not store (failed, timed out)
    writes_dropped: int  # stored blocks never sent (writer behind, evicted, no parent)
    corrupt: int  # values that failed their check (served as misses)
    errors: int  # failed node calls
    breaker_changes: int
    queue_bytes: int = 0  # block bytes stored and not sent yet (the write-behind queue)
    queue_limit_bytes: int = 0  # shared_queue_bytes
    unauthenticated: int = 0  # values the keyed MAC refused (served as misses)
    keyed: bool = False  # values carry a MAC (shared_key_file)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


@dataclass(frozen=True, slots=True)
class Stats:
    """Occupancy and counters of the whole daemon (``kvctl status``)."""

    tiers: tuple[TierStats, ...]
    namespaces: tuple[NamespaceStats, ...]
    demotions: int = 0
    promotions: int = 0
    pending_blocks: int = 0
    leases: int = 0
    corrupt_reads: int = 0
    disk_queue_bytes: int = 0
    counters: dict[str, int] = field(default_factory=dict)
    staged_bytes: int = 0  # host slots set aside for writers' next puts
    disk_fault: str = ""  # why the disk tier takes no writes now ("" when it does)
    tenants: tuple[TenantStats, ...] = ()  # per tenant: the admin's view only
    platform: str = ""  # the daemon's: "cpu-only" | "pcie" | "c2c"
    uptime_s: float = 0.0
    shared: SharedStats | None = None  # None: no shared tier

    def tier(self, name: str) -> TierStats | None:
        for tier in self.tiers:
            if tier.name == name:
                return tier
        return None


class Event(NamedTuple):
    """One change of a block's tier (a tuple: the store makes one per block it stores,
    moves or drops, under its lock, and a tuple costs a third of a frozen dataclass)."""

    seq: int  # strictly increasing from 1 within one daemon lifetime
    kind: str  # stored | removed | demoted | promoted | pending_dropped | corrupt
    ns_id: str
    key: bytes
    tier: str  # "host" | "disk" | "" (the block left the store)
    timestamp: float  # wall clock (time.time())


@dataclass(frozen=True, slots=True)
class ServerInfo:
    """Who the daemon is and where its shared arena lives."""

    version: str
    host_id: str  # equal to kvproto.v1.host.host_id() on the daemon's host
    platform: str  # "cpu-only" | "pcie" | "c2c"
    arena_path: str  # "" when the daemon has no shared arena
    arena_bytes: int
    pid: int
    uptime_s: float
    default_lease_ttl_s: float
    max_blocks_per_request: int
    max_message_bytes: int
    max_chunk_bytes: int  # largest data chunk of one Put / Get message
    max_transfer_bytes: int  # most block bytes one Put or Get call moves
    local_socket: str = ""  # unix socket of local calls (same host); "" when not offered
    slot_epochs_offset: int = 0  # where the slot epoch table is in the arena file
    slot_epochs_count: int = 0  # its counters; 0: no unpinned reads
    arena_prefaulted: bool = False  # the daemon faulted its arena's pages in at start-up
    admission: str = ""  # the daemon's disk admission: write-back | write-through | selective
    uid: int | None = None  # the daemon's uid (None from a daemon that does not say)
    tenant: str = ""  # this client's tenant ("" for the admin or a daemon without tenants)
    arena_socket: str = ""  # where an arena_path "fd:..." is handed out (arena_handout)


@dataclass(frozen=True, slots=True)
class NamespaceInfo:
    """What the daemon answered when a namespace was opened."""

    ns_id: str
    model: str
    block_tokens: int
    block_bytes: int
    served_model: str = ""  # labels (kvstore.keys.LABELS): the served model's name
    tokenizer: str = ""  # and where its tokenizer is
