"""LMDB's pages read from ``data.mdb`` itself: every B-tree, each value's overflow run
and the free list, checked to be in the file, of their kind, and held once.

Why: LMDB trusts its file. The walk through LMDB (:func:`kvstore.disk.files.scan_in_child`)
reads keys only, so two kinds of damage went unseen: a damaged free list (LMDB hands
its pages to the next commit: a live page, and a block is overwritten; a page past the
file, and every commit fails, on every restart) and a damaged overflow run (its value
read past the file's end: SIGBUS). Pages are read with ``pread``, never through the
map, so a wrong page number is an error here, not a signal. The check runs in
``scan_in_child``'s child process, before its walk: a large environment's pages are
many, and the daemon's threads must not wait on them.

Protocol: :func:`find_page_damage` returns why the pages are unsound, or None.
``python -m kvstore.disk.pages DIR`` exits 1 with that reason on stderr.

Layout (``mdb.c``, 64-bit): a page starts with a 16-byte header: its number (u64),
pad (u16), flags (u16), then the lower and upper bounds of its free space (u16 each),
which an overflow page holds its run's page count (u32) in. A branch or leaf page has
``(lower - 16) / 2`` node offsets (u16) after its header. A node is lo, hi, flags and
key size (u16 each), its key, then on a leaf its data: ``lo | hi << 16`` bytes (a
branch node's child page is ``lo | hi << 16 | flags << 32``). A leaf node flagged
F_BIGDATA holds the u64 number of its value's overflow run, one flagged F_SUBDATA (in
the main B-tree) the 48-byte record of a named database, whose last u64 is its root.
The free list's leaves map a transaction id to a list of pages: a u64 count, then the
page numbers.
"""

from __future__ import annotations

import os
import struct
import sys

from kvstore.disk.files import DATA_FILE, Meta, read_meta

_HEADER = struct.Struct("<QHHHH")  # page number, pad, flags, lower, upper
_OVERFLOW = struct.Struct("<QHHI")  # page number, pad, flags, pages
_NODE = struct.Struct("<HHHH")  # lo, hi, flags, key size
_U64 = struct.Struct("<Q")
_ROOT_AT = 40  # a named database's root: the last u64 of its 48-byte MDB_db record
P_BRANCH, P_LEAF, P_OVERFLOW = 0x01, 0x02, 0x04
F_BIGDATA, F_SUBDATA, F_DUPDATA = 0x01, 0x02, 0x04
P_INVALID = (1 << 64) - 1
FIRST_PAGE = 2  # pages 0 and 1 are the meta pages


class PageDamage(Exception):
    """A page is not what the page that points at it says."""


class _File:
    """``data.mdb`` read page by page."""

    def __init__(self, fd: int, meta: Meta) -> None:
        self.fd = fd
        self.psize = meta.page_size
        self.last_page = meta.last_page

    def read(self, pgno: int, pages: int = 1) -> bytes:
        if pgno < FIRST_PAGE or pgno + pages - 1 > self.last_page:
            raise PageDamage(f"page {pgno} (+{pages}) is outside pages 2..{self.last_page}")
        raw = os.pread(self.fd, pages * self.psize, pgno * self.psize)
        if len(raw) < pages * self.psize:
            raise PageDamage(f"page {pgno} is past the end of {DATA_FILE}")
        return raw


class _Walk:
    """One pass over the trees and the free list; what each page is claimed by."""

    def __init__(self, file: _File) -> None:
        self.file = file
        self.claims: list[tuple[int, int, str]] = []  # first page, pages, what
        self.seen: set[int] = set()  # branch and leaf pages (a cycle ends the walk)

    def tree(self, root: int, what: str, *, main: bool = False, free: bool = False) -> None:
        stack = [root] if root != P_INVALID else []
        while stack:
            pgno = stack.pop()
            if pgno in self.seen:
                raise PageDamage(f"{what}: page {pgno} is reached twice")
            self.seen.add(pgno)
            page = self.file.read(pgno)
            number, _, flags, lower, upper = _HEADER.unpack_from(page)
            if number != pgno or not flags & (P_BRANCH | P_LEAF) or flags & P_OVERFLOW:
                raise PageDamage(f"{what}: page {pgno} is not a B-tree page")
            self.claims.append((pgno, 1, what))
            count = (lower - _HEADER.size) // 2
            if lower < _HEADER.size or upper > self.file.psize or lower > upper:
                raise PageDamage(f"{what}: page {pgno} has bounds {lower}..{upper}")
            for index in range(count):
                (offset,) = struct.unpack_from("<H", page, _HEADER.size + 2 * index)
                if not upper <= offset <= self.file.psize - _NODE.size:
                    raise PageDamage(f"{what}: page {pgno} node {index} at {offset}")
                lo, hi, node_flags, ksize = _NODE.unpack_from(page, offset)
                data_at = offset + _NODE.size + ksize
                if flags & P_BRANCH:
                    stack.append(lo | hi << 16 | node_flags << 32)
                    continue
                size = lo | hi << 16
                if node_flags & F_DUPDATA:
                    raise PageDamage(f"{what}: page {pgno} has a duplicate-key node")
                if node_flags & F_BIGDATA:
                    data = self._overflow(_unpack_u64(page, data_at, what), size, what)
                else:
                    if data_at + size > self.file.psize:
                        raise PageDamage(f"{what}: page {pgno} node {index} runs off it")
                    data = page[data_at : data_at + size]
                if main and node_flags & F_SUBDATA:
                    name = page[offset + _NODE.size : data_at].decode(errors="replace")
                    self.tree(_unpack_u64(data, _ROOT_AT, what), name)
                elif free:
                    self._free_pages(data, what)

    def _overflow(self, pgno: int, size: int, what: str) -> bytes:
        """A value's overflow run: its header checked, the run claimed; its bytes only
        where they are read (the free list's), else its first page."""
        head = self.file.read(pgno)
        number, _, flags, pages = _OVERFLOW.unpack_from(head)
        if number != pgno or not flags & P_OVERFLOW or pages * self.file.psize < size + 16:
            raise PageDamage(f"{what}: page {pgno} is not the overflow run of a value")
        self.claims.append((pgno, pages, what))
        if what != "the free list":
            return b""
        return self.file.read(pgno, pages)[16 : 16 + size]

    def _free_pages(self, data: bytes, what: str) -> None:
        (count,) = _U64.unpack_from(data) if len(data) >= 8 else (-1,)
        if count < 0 or 8 + 8 * count > len(data):
            raise PageDamage(f"{what}: a list of {count} pages in {len(data)} bytes")
        for (pgno,) in _U64.iter_unpack(data[8 : 8 + 8 * count]):
            self.claims.append((pgno, 1, what))

    def overlaps(self) -> str | None:
        """Whether two claims share a page, or one lies outside the file's pages."""
        last = self.file.last_page
        end, owner = FIRST_PAGE, "the meta pages"
        for first, pages, what in sorted(self.claims):
            if first < FIRST_PAGE or first + pages - 1 > last:
                return f"{what} holds page {first} (+{pages}), outside pages 2..{last}"
            if first < end:
                return f"page {first} is held by {what} and by {owner}"
            end, owner = first + pages, what
        return None


def _unpack_u64(raw: bytes, at: int, what: str) -> int:
    if at + 8 > len(raw):
        raise PageDamage(f"{what}: a page number runs off its page")
    return int(_U64.unpack_from(raw, at)[0])


def find_page_damage(directory: str) -> str | None:
    """Why the pages of the environment in ``directory`` are unsound, or None (also
    when there is no data file yet; a meta page :func:`find_damage` refuses is its to
    report)."""
    path = os.path.join(directory, DATA_FILE)
    if not os.path.exists(path):
        return None
    meta = read_meta(path)
    if meta is None:
        return None
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        walk = _Walk(_File(fd, meta))
        walk.tree(meta.free_root, "the free list", free=True)
        walk.tree(meta.main_root, "the main database", main=True)
        return walk.overlaps()
    except (PageDamage, struct.error) as exc:
        return str(exc)
    finally:
        os.close(fd)


def main() -> int:
    damage = find_page_damage(sys.argv[1])
    if damage is not None:
        print(damage, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
