"""One slot space of the host arena: a TLSF allocator over ``[base, base + size)``.

The arena (:mod:`kvstore.host.arena`) has one space per region; offsets are the
arena's, so a space's slots never need translating.


Allocator design (two-level segregated fit, "TLSF"). Namespaces with different block
sizes (256 B ... 8 MiB) share the space, so fixed-size pools would strand memory in
the wrong size; instead every slot is one contiguous extent carved from free extents:

1. Sizes are rounded up: requests that round to 4096 bytes or more to a multiple of
   4096, placed at 4096-aligned offsets (page-aligned for DMA); smaller ones to a
   multiple of 64 at 64-aligned offsets. A slot is always one contiguous range, so a
   client can take a zero-copy view of it.
2. Free extents are kept in size classes: 16 linear classes below 1 KiB, then 16
   classes per power of two (each class spans 1/16 of its octave). One Python int is
   the bitmap of non-empty classes, so "first non-empty class >= c" is a shift and a
   lowest-set-bit, O(1) for any space we will ever build (a few hundred bits).
3. alloc looks in the first non-empty class whose every extent is large enough
   (request rounded up to the next class boundary), so it pops any extent there
   without comparing sizes (good fit, O(1)); a page-aligned slot whose extent turns
   out misaligned retries where even the worst alignment pad fits. When that finds
   nothing it scans the extents of the classes it skipped (the request's own class,
   at most a couple), so alloc returns None only when no free extent can hold the
   slot at all. That scan is the only step that is not O(1); it runs when the space
   is nearly full.
4. Boundary tags are two dicts of int -> int (free extent start -> size and end ->
   start); live slots are one dict offset -> size. free() merges the slot with free
   neighbours immediately (O(1) dict lookups), so space freed by one block size is
   reusable by any other, and free extents are always maximal.
5. Large slots are carved from the head of an extent (after its alignment pad, which
   stays free), small ones from its tail, which keeps the start of the remaining
   extent page-aligned for the next large slot. ``alloc(tail=True)`` carves a large
   slot from the tail too: blocks kept encoded in host (kvstore.host_coding) are
   about half a block, and placed so they gather at the far end of free room and
   in each other's holes, instead of cutting the extents the next whole blocks need.
6. ``alloc_run`` carves the slots of a whole put as one run from one extent (one
   lookup and one carve, then split into slots that are freed one by one like any),
   when a free extent holds the run; the store falls back to slot-by-slot alloc
   (with eviction) when none does. Contiguous slots also let the client copy a put
   in one piece.

Per slot this costs one dict entry: hundreds of thousands of slots are fine. A space
is not thread-safe; the store calls it under its own lock.
"""

from __future__ import annotations

import operator

PAGE_SIZE = 4096  # slots of at least this size are page-aligned
GRAIN = 64  # alignment and size granule of smaller slots (one cache line)
_PAGE_MASK = PAGE_SIZE - 1
_GRAIN_MASK = GRAIN - 1
_GRAIN_SHIFT = 6
_SL_LOG2 = 4  # 2**4 = 16 second-level classes per power of two
_SL_COUNT = 1 << _SL_LOG2


# -- size classes ---------------------------------------------------------------------


def _class_of(size: int) -> int:
    """The class holding extents of ``size`` bytes (a multiple of GRAIN)."""
    granules = size >> _GRAIN_SHIFT
    if granules < _SL_COUNT:
        return granules
    fl = granules.bit_length() - 1
    return ((fl - _SL_LOG2 + 1) << _SL_LOG2) + (granules >> (fl - _SL_LOG2)) - _SL_COUNT


def _class_at_least(size: int) -> int:
    """The lowest class whose every extent has at least ``size`` bytes."""
    granules = size >> _GRAIN_SHIFT
    if granules >= _SL_COUNT:
        granules += (1 << (granules.bit_length() - 1 - _SL_LOG2)) - 1
    return _class_of(granules << _GRAIN_SHIFT)


def _class_min(cls: int) -> int:
    """Smallest extent size (bytes) that falls in class ``cls``."""
    if cls < _SL_COUNT:
        return cls << _GRAIN_SHIFT
    fl = (cls >> _SL_LOG2) + _SL_LOG2 - 1
    sl = cls & (_SL_COUNT - 1)
    return ((_SL_COUNT + sl) << (fl - _SL_LOG2)) << _GRAIN_SHIFT


def _slot_shape(size: int) -> tuple[int, int]:
    """(rounded size, alignment) of a slot asked for ``size`` bytes."""
    if size > PAGE_SIZE - GRAIN:  # rounds to a page or more: a page-aligned slot
        return (size + _PAGE_MASK) & ~_PAGE_MASK, PAGE_SIZE
    return (size + _GRAIN_MASK) & ~_GRAIN_MASK, GRAIN


def _slot_start(start: int, extent: int, rounded: int, align: int) -> int:
    """Where a slot goes inside a free extent: large at the aligned head, small at the tail."""
    if align == GRAIN:
        return start + extent - rounded
    return (start + _PAGE_MASK) & ~_PAGE_MASK


def _fits(start: int, extent: int, rounded: int, align: int) -> bool:
    slot = _slot_start(start, extent, rounded, align)
    return start <= slot and slot + rounded <= start + extent


class SlotSpace:
    """The slots of ``[base, base + size)``: alloc, alloc_run, free, slot_size."""

    def __init__(self, base: int, size: int) -> None:
        self.base = base
        self.capacity_bytes = size
        n_classes = _class_of(size) + 1
        self._slots: dict[int, int] = {}  # live slot offset -> rounded size
        self._free_size: dict[int, int] = {}  # free extent start -> size
        self._free_start: dict[int, int] = {}  # free extent end -> start
        self._classes: list[dict[int, int]] = [{} for _ in range(n_classes)]  # start -> size
        self._bitmap = 0  # bit c set <=> self._classes[c] is not empty
        self._used_bytes = 0
        self._insert(base, size)

    @property
    def used_bytes(self) -> int:
        """Bytes held by live slots (rounded sizes); never more than capacity_bytes."""
        return self._used_bytes

    def alloc(self, size: int, tail: bool = False) -> int | None:
        """Offset of a new slot of at least ``size`` bytes, or None when nothing fits.
        ``tail``: a large slot goes at the end of its extent, not the head (see 5.)."""
        size = operator.index(size)
        if size <= 0:
            raise ValueError(f"slot size must be positive, got {size}")
        rounded, align = _slot_shape(size)
        if rounded > self.capacity_bytes:
            return None
        found = self._good_fit(rounded, align)
        if found is None:
            found = self._scan_fit(rounded, align)
            if found is None:
                return None
        start, extent = found
        return self._carve(start, extent, rounded, align, tail)

    def alloc_run(self, size: int, count: int) -> list[int]:
        """Offsets of ``count`` new slots of ``size`` bytes carved as one contiguous run
        (one free-extent lookup and one carve instead of ``count``, and the blocks of a
        put land next to each other, so the client copies them in one piece); [] when
        no free extent holds the whole run (the caller allocates slot by slot)."""
        size, count = operator.index(size), operator.index(count)
        if size <= 0 or count <= 0:
            raise ValueError(f"a run of {count} slots of {size} bytes")
        rounded, align = _slot_shape(size)
        total = rounded * count
        if count == 1:
            offset = self.alloc(size)
            return [] if offset is None else [offset]
        if total > self.capacity_bytes:
            return []
        found = self._good_fit(total, align)
        if found is None:
            return []
        first = self._carve(found[0], found[1], total, align)
        del self._slots[first]  # carved as one slot of the whole run: split it
        offsets = list(range(first, first + total, rounded))
        for offset in offsets:
            self._slots[offset] = rounded
        return offsets

    def free(self, offset: int) -> None:
        """Return a slot; merges it with free neighbours. Unknown offsets raise ValueError."""
        size = self._slots.pop(offset, None)
        if size is None:
            raise ValueError(f"offset {offset} is not a live slot (double free?)")
        self._used_bytes -= size
        start, end = offset, offset + size
        right = self._free_size.get(end)
        if right is not None:
            self._remove(end, right)
            end += right
        left = self._free_start.get(start)
        if left is not None:
            self._remove(left, start - left)
            start = left
        self._insert(start, end - start)

    def slot_size(self, offset: int) -> int:
        """Bytes reserved for the live slot at ``offset`` (after rounding)."""
        size = self._slots.get(offset)
        if size is None:
            raise ValueError(f"offset {offset} is not a live slot")
        return size

    @property
    def slots(self) -> int:
        """Live slots."""
        return len(self._slots)

    def largest_free(self) -> int:
        """Bytes of the largest free extent (0 when full)."""
        if not self._bitmap:
            return 0
        return max(self._classes[self._bitmap.bit_length() - 1].values())

    def owns(self, offset: int) -> bool:
        return self.base <= offset < self.base + self.capacity_bytes

    # -- free-extent bookkeeping

    def _insert(self, start: int, size: int) -> None:
        cls = _class_of(size)
        self._free_size[start] = size
        self._free_start[start + size] = start
        self._classes[cls][start] = size
        self._bitmap |= 1 << cls

    def _remove(self, start: int, size: int) -> None:
        cls = _class_of(size)
        del self._free_size[start]
        del self._free_start[start + size]
        members = self._classes[cls]
        del members[start]
        if not members:
            self._bitmap &= ~(1 << cls)

    def _good_fit(self, rounded: int, align: int) -> tuple[int, int] | None:
        """O(1): an extent of the first non-empty class where every extent fits.

        Large slots first ignore the alignment pad: extents almost always start on a
        page (see _slot_start), and counting the pad would send the search one class
        up, splitting a bigger extent while an exact hole sits unused.
        """
        found = self._pop_first(_class_at_least(rounded))
        if found is None or align == GRAIN or _fits(found[0], found[1], rounded, align):
            return found
        self._insert(*found)  # misaligned: put it back, look where the pad always fits
        return self._pop_first(_class_at_least(rounded + align - GRAIN))

    def _pop_first(self, cls: int) -> tuple[int, int] | None:
        """Unlist and return any extent of the first non-empty class >= cls."""
        candidates = self._bitmap >> cls
        if not candidates:
            return None
        cls += (candidates & -candidates).bit_length() - 1
        members = self._classes[cls]
        # popitem, not peek-then-del: it is O(1) and hands back the most recently freed
        start, size = members.popitem()
        if not members:
            self._bitmap &= ~(1 << cls)
        del self._free_size[start]
        del self._free_start[start + size]
        return start, size

    def _scan_fit(self, rounded: int, align: int) -> tuple[int, int] | None:
        """Fallback: look at each extent of the classes the good fit skipped."""
        first = _class_of(rounded)
        last = _class_at_least(rounded + align - GRAIN)  # exclusive: _good_fit saw those
        for cls in range(first, last):
            if not (self._bitmap >> cls) & 1:
                continue
            for start, size in self._classes[cls].items():
                if _fits(start, size, rounded, align):
                    self._remove(start, size)
                    return start, size
        return None

    def _carve(self, start: int, extent: int, rounded: int, align: int, tail: bool = False) -> int:
        """Place a slot in a free extent (already unlisted); list what is left of it."""
        slot = _slot_start(start, extent, rounded, align)
        if tail and align == PAGE_SIZE and (start + extent - rounded) & ~_PAGE_MASK >= start:
            slot = (start + extent - rounded) & ~_PAGE_MASK
        if slot > start:
            self._insert(start, slot - start)
        end, extent_end = slot + rounded, start + extent
        if extent_end > end:
            self._insert(end, extent_end - end)
        self._slots[slot] = rounded
        self._used_bytes += rounded
        return slot

    def free_extents(self) -> list[tuple[int, int]]:
        """Sorted (start, size) of every free extent: for tests and debugging, O(n)."""
        return sorted(self._free_size.items())
