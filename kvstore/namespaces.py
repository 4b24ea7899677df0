"""The namespaces a store holds: by id, by digest (how disk records name theirs), and
the tenant groups they belong to (:mod:`kvstore.tenants`), with the checks every call
makes of a namespace and its keys. No lock of its own: the store's lock guards it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from kvstore.codecs import codec_of
from kvstore.errors import InvalidArgument, UnknownNamespace
from kvstore.index import NamespaceEntry
from kvstore.keys import BlockKey, NamespaceSpec
from kvstore.tenants import Group, Quota, tenant_of


class Namespaces:
    """Namespace entries and tenant groups (see the module docstring)."""

    def __init__(self, quotas: Mapping[str, Quota], max_blocks_per_request: int) -> None:
        self._quotas = quotas
        self._max_blocks = max_blocks_per_request
        self._entries: dict[str, NamespaceEntry] = {}
        self.by_digest: dict[bytes, NamespaceEntry] = {}
        self.groups: dict[str, Group] = {}  # tenant -> its group
        self._of_tenant: dict[str, list[NamespaceEntry]] = {}  # tenant -> its namespaces

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[NamespaceEntry]:
        return iter(list(self._entries.values()))

    def of_tenant(self, tenant: str) -> list[NamespaceEntry]:
        """A tenant's namespaces (no walk over other tenants': what one tenant's call
        costs does not depend on how many namespaces the others have)."""
        return list(self._of_tenant.get(tenant, ()))

    def get(self, ns_id: str) -> NamespaceEntry | None:
        return self._entries.get(ns_id)

    def entry(self, ns_id: str | None) -> NamespaceEntry:
        """The open namespace ``ns_id``; UnknownNamespace otherwise."""
        entry = self._entries.get(ns_id or "")
        if entry is None:
            raise UnknownNamespace(f"unknown namespace {ns_id!r}; open it first")
        return entry

    def register(self, spec: NamespaceSpec) -> NamespaceEntry:
        """Add a namespace, in its tenant's group (made with the tenant's quota)."""
        tenant = tenant_of(spec.tenant_salt)
        group = self.groups.get(tenant)
        if group is None:
            group = self.groups[tenant] = Group(tenant, self._quotas.get(tenant, Quota()))
        codec = codec_of(spec.codec, spec.dtype, spec.head_dim, spec.block_bytes)
        entry = NamespaceEntry(spec, group, codec)
        group.namespaces += 1
        self._entries[spec.ns_id] = entry
        self._of_tenant.setdefault(tenant, []).append(entry)
        self.by_digest[spec.digest] = entry
        return entry

    def check_keys(self, entry: NamespaceEntry, keys: Sequence[BlockKey]) -> None:
        """InvalidArgument unless ``keys`` are at most max_blocks_per_request keys of
        ``entry``'s width."""
        if len(keys) > self._max_blocks:
            raise InvalidArgument(
                f"{len(keys)} blocks in one request, more than "
                f"max_blocks_per_request={self._max_blocks}"
            )
        width = entry.spec.key_bytes
        # set(map(...)) runs in C: this is on every lookup of up to thousands of keys
        if keys and (set(map(type, keys)) != {bytes} or set(map(len, keys)) != {width}):
            raise InvalidArgument(f"block keys of namespace {entry.spec.ns_id} are {width} bytes")
