"""New locks in a forked child.

When a process forks, the child gets a copy of every lock in the state the parent's
threads left it: a lock one of them held at that moment stays held in the child, where
no thread will ever release it, and the child's first call that takes it waits forever.
The same goes for helper threads: a thread pool of the parent has no threads in the
child, and work handed to it there never runs.

Objects whose locks a child may take register with :func:`renew_in_child`; after a
fork, in the child, each one's ``_after_fork_in_child()`` makes its locks new (and drops
whatever else belongs to the parent's threads). Module-level state registers its own
hook with ``os.register_at_fork``. What a child must not share with its parent
(sockets, leases, staged slots) is handled where it is used, by comparing
``os.getpid()``; this module only makes sure the child gets that far.
"""

from __future__ import annotations

import os
import weakref
from typing import Protocol


class RenewedInChild(Protocol):
    def _after_fork_in_child(self) -> None:
        """Called in a forked child, before anything else runs there: new locks."""


_objects: weakref.WeakSet[RenewedInChild] = weakref.WeakSet()


def renew_in_child(obj: RenewedInChild) -> None:
    """Call ``obj._after_fork_in_child()`` in every child forked while ``obj`` lives."""
    _objects.add(obj)


def _renew_all() -> None:
    for obj in list(_objects):
        obj._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_renew_all)
