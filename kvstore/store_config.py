"""A store's capacities and policies (:class:`StoreConfig`), and the checks of the
per-call values they bound (priorities, lease TTLs)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvstore.errors import InvalidArgument
from kvstore.host.arena import common_bytes
from kvstore.host.slot_space import PAGE_SIZE
from kvstore.policy import MAX_PRIORITY, OVERFLOW_POLICIES, POLICIES
from kvstore.shared.tier import SharedConfig
from kvstore.tenants import NAME_RE, Quota

DEFAULT_PRIORITY = 35
ADMISSION_POLICIES = ("write-back", "write-through", "selective")
CODEC_TIERS = ("host", "disk", "shared")  # the tiers a codec may apply to
# a promotion of at least this many bytes reads its blocks on PROMOTE_THREADS threads
PARALLEL_PROMOTE_BYTES = 4 << 20
# a caller that must not wait on the disk (the daemon's event loop) promotes at most
# this many bytes, and only from the page cache into free room
QUICK_PROMOTE_BYTES = 4 << 20
PROMOTE_THREADS = max(1, min(4, os.cpu_count() or 1))
DELETE_COMMIT_TIMEOUT_S = 60.0  # clear and delete wait this long for their disk deletions


def codec_tiers_problem(tiers: Sequence[str]) -> str | None:
    """What is wrong with ``tiers`` as ``codec_tiers``, or None."""
    unknown = [name for name in tiers if name not in CODEC_TIERS]
    if unknown:
        return f"{unknown[0]!r} is not a tier a codec applies to; choose from {list(CODEC_TIERS)}"
    if "host" in tiers and not {"disk", "shared"} <= set(tiers):
        return "host needs disk and shared too (a block encoded in host leaves it encoded)"
    return None


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Capacities and policies of one store. Sizes are bytes."""

    host_bytes: int
    disk_dir: str | None = None
    disk_bytes: int = 0  # 0: no disk tier
    admission: str = "write-back"  # write-back | write-through | selective
    selective_hits: int = 2  # selective: demote to disk only after this many hits
    disk_min_priority: int = 0  # blocks below this priority are dropped, not demoted
    default_priority: int = DEFAULT_PRIORITY
    lease_ttl_s: float = 30.0
    max_lease_ttl_s: float = 600.0
    max_blocks_per_request: int = 8192
    arena_dir: str | None = None  # where the shared arena file lives (default /dev/shm)
    shared_arena: bool = True  # False: anonymous memory (single-process tests)
    persist_on_close: bool = True  # close() writes host-only blocks to disk first
    persist_timeout_s: float = 90.0  # ... waiting for the disk writer this long at most
    event_buffer: int = 65536
    eviction_policy: str = "priority-lru"  # priority-lru | plain-lru (baseline only)
    prefault_arena: bool = False  # fault the arena's pages in on a background thread
    # staged slots one staging lease may hold (bytes); 0: a quarter of host_bytes
    max_staged_bytes: int = 0
    disk_queue_bytes: int = 256 << 20  # block bytes waiting for the disk writer, at most
    # a put that needs room only the disk writer can make (every block it could evict
    # is due on disk, the writer's queue is full) waits this long for it, then
    # ``overflow`` decides: refuse what does not fit (wait) or evict unwritten (drop);
    # 0 with drop: evict unwritten at once
    put_wait_ms: int = 5000
    overflow: str = "wait"
    # write-through: how long a commit waits for its disk commit before answering
    write_through_wait_s: float = 30.0
    check_disk_in_child: bool = False  # at open, check the disk tier's pages in a child
    # a disk tier whose data file is at most this size is indexed before the store
    # answers; a larger one in the background (kvstore.index_load); 0: always behind
    sync_index_bytes: int = 512 << 20
    # tenant -> its quota (kvstore.tenants); tenants not named here have none
    quotas: Mapping[str, Quota] = field(default_factory=dict)
    # most namespaces one tenant may open (the empty tenant included); 0: no limit
    tenant_max_namespaces: int = 0
    shared: SharedConfig | None = None  # a shared tier on a Valkey / Redis Cluster
    # the tiers where a namespace with a codec keeps its blocks encoded (kvstore.codecs)
    codec_tiers: tuple[str, ...] = ("disk", "shared")
    # a chain too long for the host tier passes through it in windows of at most this
    # many bytes (and a quarter of the tenant's host room): kvstore.store_writes
    window_bytes: int = 64 << 20
    # token ids (packed) the index keeps for host blocks, for KV events and disk
    # records, at most; past it a block keeps none (kvstore.host.placement)
    index_tokens_bytes: int = 64 << 20

    @property
    def staged_bytes_limit(self) -> int:
        return self.max_staged_bytes or self.host_bytes // 4

    def validate(self) -> None:
        """Raise InvalidArgument naming the first bad field."""
        if self.host_bytes < 4096:
            raise InvalidArgument(f"host_bytes must be >= 4096, got {self.host_bytes}")
        if self.disk_bytes < 0:
            raise InvalidArgument(f"disk_bytes must be >= 0, got {self.disk_bytes}")
        if self.tenant_max_namespaces < 0:
            raise InvalidArgument(
                f"tenant_max_namespaces must be >= 0, got {self.tenant_max_namespaces}"
            )
        if self.disk_bytes and not self.disk_dir:
            raise InvalidArgument("disk_dir is required when disk_bytes > 0")
        if self.admission not in ADMISSION_POLICIES:
            raise InvalidArgument(
                f"admission must be one of {list(ADMISSION_POLICIES)}, got {self.admission!r}"
            )
        if self.eviction_policy not in POLICIES:
            raise InvalidArgument(
                f"eviction_policy must be one of {sorted(POLICIES)}, got {self.eviction_policy!r}"
            )
        for name in ("default_priority", "disk_min_priority"):
            value = getattr(self, name)
            if not 0 <= value <= MAX_PRIORITY:
                raise InvalidArgument(f"{name} must be in [0, {MAX_PRIORITY}], got {value}")
        if not 0 < self.lease_ttl_s <= self.max_lease_ttl_s:
            raise InvalidArgument(
                f"lease_ttl_s must be in (0, max_lease_ttl_s={self.max_lease_ttl_s}], "
                f"got {self.lease_ttl_s}"
            )
        if self.max_blocks_per_request < 1:
            raise InvalidArgument("max_blocks_per_request must be >= 1")
        if self.max_staged_bytes < 0:
            raise InvalidArgument(f"max_staged_bytes must be >= 0, got {self.max_staged_bytes}")
        if self.selective_hits < 0:
            raise InvalidArgument(f"selective_hits must be >= 0, got {self.selective_hits}")
        if self.window_bytes < 1:
            raise InvalidArgument(f"window_bytes must be >= 1, got {self.window_bytes}")
        if self.disk_queue_bytes < 1:
            raise InvalidArgument(f"disk_queue_bytes must be >= 1, got {self.disk_queue_bytes}")
        if self.persist_timeout_s < 0:
            raise InvalidArgument(f"persist_timeout_s must be >= 0, got {self.persist_timeout_s}")
        problem = codec_tiers_problem(self.codec_tiers)
        if problem:
            raise InvalidArgument(f"codec_tiers: {problem}")
        if self.sync_index_bytes < 0:
            raise InvalidArgument(f"sync_index_bytes must be >= 0, got {self.sync_index_bytes}")
        if self.put_wait_ms < 0:
            raise InvalidArgument(f"put_wait_ms must be >= 0, got {self.put_wait_ms}")
        if self.overflow not in OVERFLOW_POLICIES:
            raise InvalidArgument(
                f"overflow must be one of {list(OVERFLOW_POLICIES)}, got {self.overflow!r}"
            )
        if self.write_through_wait_s < 0:
            raise InvalidArgument(
                f"write_through_wait_s must be >= 0, got {self.write_through_wait_s}"
            )
        if self.shared is not None:
            self.shared.validate()
        for tenant, quota in self.quotas.items():
            if not NAME_RE.match(tenant):
                raise InvalidArgument(f"quotas: {tenant!r} is not a tenant name")
            if quota.host_bytes < 0 or quota.disk_bytes < 0:
                raise InvalidArgument(f"quotas: {tenant}: quotas must be >= 0")
            if 0 < quota.host_bytes < PAGE_SIZE:
                raise InvalidArgument(
                    f"quotas: {tenant}: a host quota is the tenant's own arena region: "
                    f"at least {PAGE_SIZE} bytes, got {quota.host_bytes}"
                )
        regions = [quota.host_bytes for quota in self.quotas.values() if quota.host_bytes]
        if regions and common_bytes(self.host_bytes, regions) < PAGE_SIZE:
            raise InvalidArgument(
                f"the tenants' host quotas ({sum(regions)} bytes) are their own arena "
                f"regions and must leave room in host_bytes ({self.host_bytes}) for the rest"
            )


def check_priority(config: StoreConfig, priority: int | None) -> int:
    """A call's block priority: the default for None, else checked."""
    if priority is None:
        return config.default_priority
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidArgument(f"priority must be an integer, got {priority!r}")
    if not 0 <= priority <= MAX_PRIORITY:
        raise InvalidArgument(f"priority must be in [0, {MAX_PRIORITY}], got {priority}")
    return priority


def check_ttl(config: StoreConfig, ttl_s: float | None) -> float:
    """A call's lease TTL: the default for None, else checked."""
    if ttl_s is None:
        return config.lease_ttl_s
    if not 0 < ttl_s <= config.max_lease_ttl_s:
        raise InvalidArgument(f"ttl_s must be in (0, {config.max_lease_ttl_s}], got {ttl_s}")
    return ttl_s
