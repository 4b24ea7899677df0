"""Tenants in the core: whose a namespace is, and how much each tenant may hold.

A tenant owns the namespaces the daemon opened for it. The daemon folds the tenant's
name into the namespace's salt (:func:`tenant_salt`), so two tenants that open the
same model get two namespaces whose keys never match, and the owner of a namespace
is a function of its spec (:func:`tenant_of`): it survives a restart with the disk
tier's records, with nothing else to persist. The salt is the same for a tenant on
every node, so its keys are too.

The store groups namespaces by tenant (a :class:`Group` per tenant, the empty name for
namespaces opened without one) and counts the bytes each group holds in each tier. A
group with a quota that would go over it evicts its own least valuable blocks first,
in the tier's usual order (leaf first, lowest priority, least recently used), and
never another group's; when its own blocks cannot make room, the write is refused as
if the tier were full. Host slots set aside for a tenant's next puts (staged slots)
count against its host quota too: they are held, never evicted, until used or freed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

SALT_PREFIX = "tenant:"
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")


def tenant_salt(tenant: str, salt: str) -> str:
    """The salt of a namespace ``tenant`` opens with its own ``salt`` (may be "")."""
    return f"{SALT_PREFIX}{tenant}/{salt}"


def tenant_of(salt: str | bytes) -> str:
    """The tenant whose namespace has ``salt``; "" for a namespace opened without one
    (a salt given as bytes by an in-process caller is never a tenant's)."""
    if not isinstance(salt, str) or not salt.startswith(SALT_PREFIX):
        return ""
    return salt[len(SALT_PREFIX) :].partition("/")[0]


@dataclass(frozen=True, slots=True)
class Quota:
    """Most block bytes a tenant may hold per tier; 0: no limit beyond the tier's."""

    host_bytes: int = 0
    disk_bytes: int = 0


@dataclass(slots=True, eq=False)
class Group:
    """The namespaces of one tenant, with its quota and what it holds (under the
    store's lock)."""

    name: str
    quota: Quota = field(default_factory=Quota)
    namespaces: int = 0  # registered (tenant_max_namespaces bounds the ones it opens)
    host_bytes: int = 0  # its blocks' bytes in the host tier (pending ones included)
    staged_bytes: int = 0  # empty host slots set aside for its writers' next puts
    disk_bytes: int = 0
    quota_evictions: int = 0  # blocks it evicted to stay within its quota

    @property
    def host_held(self) -> int:
        """What counts against its host quota: its blocks and its staged slots."""
        return self.host_bytes + self.staged_bytes
