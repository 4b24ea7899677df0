"""The host tier: one shared-memory arena of slots and what reads and writes it.

- :mod:`.arena`: the arena (slots carved from free extents, O(1) alloc and free).
- :mod:`.mapping`: mapping the arena file, in the daemon and in clients on its host.
- :mod:`.slot_epochs`: per-slot counters that let a client read a slot unpinned.
- :mod:`.slot_runs`: runs of adjacent slots, the unit of every copy.
- :mod:`.pinning`: registering the arena with CUDA as pinned memory.
"""
