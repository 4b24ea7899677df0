"""The disk tier's files before LMDB opens them: one owner at a time, and no damaged
environment ever opened.

Why: LMDB maps ``data.mdb`` and trusts it. A file cut short (a full disk, a bad copy)
kills the process with SIGBUS the first time a page past its end is touched, and two
processes writing one environment with separate indexes silently lose each other's
blocks. So, before a :class:`kvstore.disk.DiskTier` opens a directory:

- :func:`lock_directory` takes an exclusive ``flock`` on ``<dir>/kvstored.lock`` (kept
  until the tier closes; the kernel drops it when the process dies, so a crash never
  leaves a stale lock) and writes the holder's pid into it for the error of the next
  one: :class:`DiskDirInUse`.
- :func:`find_damage` reads the two LMDB meta pages: a file too short for the pages its
  newest valid meta page says it has, or with no valid meta page at all (a file
  truncated to 0 included), is damaged. :func:`scan_in_child` goes further for the
  daemon's start: in a child process, so a damaged page can kill only the child, it
  checks every page of the environment, free list and overflow runs included
  (:mod:`kvstore.disk.pages`), and walks every B-tree through LMDB.
- :func:`move_aside` renames a damaged ``data.mdb`` (and drops its ``lock.mdb``) to
  ``data.mdb.damaged-<UTC time>``, kept for a post-mortem: the tier then starts empty.
- :func:`make_reserve` sets a little disk space aside in ``<dir>/kvstored-reserve``
  and :func:`drop_reserve` gives it back. Why: on a full file system LMDB cannot even
  commit a delete (it writes every change as new pages), so a tier that ran out of
  space could never evict its way back; dropping the reserve when a commit fails lets
  the evictions commit, and the tier goes on at the size that fits.

LMDB meta page layout (``mdb.c``, format version 1): a 16-byte page header, then
``MDB_meta``: magic ``0xBEEFC0DE`` (u32), version (u32), address (u64), map size (u64),
two ``MDB_db`` records of 48 bytes (the first one's leading u32 holds the page size),
the last used page number (u64) and the transaction id (u64). Meta pages are pages 0
and 1; the valid one with the higher transaction id is current.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import struct
import subprocess
import sys
import time
from dataclasses import dataclass

DATA_FILE = "data.mdb"
LOCK_FILE = "lock.mdb"
OWNER_LOCK = "kvstored.lock"
RESERVE_FILE = "kvstored-reserve"
SCAN_TIMEOUT_S = 300.0  # a child scan of a very large environment may take this long
LOCK_FILE_BYTES = 64 << 10  # lock.mdb, allocated before LMDB maps it (allocate_lock_file)
NO_ROOM = (errno.ENOSPC, errno.EDQUOT)  # a file system (or quota) with no room

_PAGE_HEADER = 16
_META = struct.Struct("<IIQQ")  # magic, version, address, map size
_DB = struct.Struct("<IHHQQQQQ")  # MDB_db: pad (page size in db 0), flags, depth, ...
_TAIL = struct.Struct("<QQ")  # last page number, transaction id
_MAGIC = 0xBEEFC0DE
_FORMAT_VERSION = 1
_META_SIZE = _META.size + 2 * _DB.size + _TAIL.size


class DiskDirInUse(Exception):
    """Another process holds the disk directory (its lock file names the pid)."""


@dataclass(frozen=True, slots=True)
class Meta:
    """The current LMDB meta page: what kvstore.disk.pages walks from."""

    page_size: int
    last_page: int
    txn_id: int
    free_root: int  # the free list's B-tree (P_INVALID: empty)
    main_root: int  # the main B-tree, whose leaves name the other databases


def lock_directory(directory: str) -> int:
    """Take the directory's owner lock; the fd that holds it (close it to let go).

    Raises DiskDirInUse naming the holder's pid when another process (or another open
    tier of this process) holds it."""
    path = os.path.join(directory, OWNER_LOCK)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise
        raise DiskDirInUse(
            f"disk_dir {directory} is in use by another kvstore process (pid {holder}); "
            "stop it, or give this one its own disk_dir"
        ) from None
    try:  # the pid is for the next one's error; a full file system leaves it out
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError as exc:
        if exc.errno not in NO_ROOM:
            os.close(fd)
            raise
    return fd


def find_damage(directory: str) -> str | None:
    """Why the environment in ``directory`` cannot be opened safely, or None when its
    files look sound (or there is none yet). Reads two pages; touches no map."""
    path = os.path.join(directory, DATA_FILE)
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        return None
    if size == 0:
        return f"{DATA_FILE} is empty (0 bytes): truncated"
    current = read_meta(path)
    if current is None:
        return f"{DATA_FILE} has no valid LMDB meta page ({size} bytes)"
    needed = (current.last_page + 1) * current.page_size
    if size < needed:
        return f"{DATA_FILE} is {size} bytes but its pages end at byte {needed}: truncated"
    return None


def read_meta(path: str) -> Meta | None:
    """The current meta page of the data file at ``path`` (the valid one of the two
    with the higher transaction id), or None when neither is valid."""
    with open(path, "rb") as file:
        first = _parse_meta(file.read(_PAGE_HEADER + _META_SIZE))
        if first is None:
            return None
        file.seek(first.page_size)
        second = _parse_meta(file.read(_PAGE_HEADER + _META_SIZE))
    return first if second is None or first.txn_id >= second.txn_id else second


def _parse_meta(raw: bytes) -> Meta | None:
    if len(raw) < _PAGE_HEADER + _META_SIZE:
        return None
    magic, version, _, _ = _META.unpack_from(raw, _PAGE_HEADER)
    if magic != _MAGIC or version != _FORMAT_VERSION:
        return None
    free_db = _DB.unpack_from(raw, _PAGE_HEADER + _META.size)
    main_db = _DB.unpack_from(raw, _PAGE_HEADER + _META.size + _DB.size)
    last_page, txn_id = _TAIL.unpack_from(raw, _PAGE_HEADER + _META.size + 2 * _DB.size)
    page_size = free_db[0]
    if page_size < 512 or page_size & (page_size - 1):
        return None
    return Meta(page_size, last_page, txn_id, free_db[-1], main_db[-1])


_SCAN = """
import sys, lmdb
from kvstore.disk.pages import find_page_damage
damage = find_page_damage(sys.argv[1])
if damage is not None:
    sys.exit(damage)
env = lmdb.open(sys.argv[1], readonly=True, lock=False, max_dbs=8, subdir=True)
with env.begin() as txn:
    names = [bytes(name) for name, _ in txn.cursor()]
    for name in names:
        db = env.open_db(name, txn=txn, create=False)
        for _ in txn.cursor(db=db).iternext(keys=True, values=False):
            pass
"""


def scan_in_child(directory: str, timeout: float = SCAN_TIMEOUT_S) -> str | None:
    """Check the environment's pages in a child process: every page of its B-trees,
    its values' overflow runs and its free list read from the file
    (:mod:`kvstore.disk.pages`), then every B-tree walked through LMDB (keys only:
    payload values are checked by their checksums when read); why it failed, or None."""
    if not os.path.exists(os.path.join(directory, DATA_FILE)):
        return None
    try:
        done = subprocess.run(
            [sys.executable, "-c", _SCAN, directory],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return None  # slow is not damaged: the open path still checks what it reads
    if done.returncode == 0:
        return None
    if done.returncode < 0:
        return f"checking its pages killed a child process (signal {-done.returncode})"
    lines = done.stderr.strip().splitlines()
    return f"checking its pages failed: {lines[-1] if lines else f'exit {done.returncode}'}"


def allocate_lock_file(directory: str) -> None:
    """Give LMDB's lock file its disk blocks before LMDB maps it. LMDB extends a missing
    or short one with ftruncate and writes it through its map, and on a full file
    system a write to a page the file system cannot back kills the process (SIGBUS).
    Raises OSError (ENOSPC) instead. A longer file only gives LMDB more reader slots."""
    path = os.path.join(directory, LOCK_FILE)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        os.posix_fallocate(fd, 0, LOCK_FILE_BYTES)
    finally:
        os.close(fd)


def free_bytes(directory: str) -> int:
    """Bytes an unprivileged writer may still take on ``directory``'s file system."""
    vfs = os.statvfs(directory)
    return vfs.f_bavail * vfs.f_frsize


def has_reserve(directory: str) -> bool:
    """Whether the reserve file is there."""
    return os.path.exists(os.path.join(directory, RESERVE_FILE))


def make_reserve(directory: str, size: int) -> bool:
    """Allocate ``size`` bytes in the reserve file (no-op if it is there); False when
    the file system has no room for it (nothing is left behind then)."""
    path = os.path.join(directory, RESERVE_FILE)
    if os.path.exists(path):
        return True
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError:
        os.close(fd)
        os.unlink(path)
        return False
    os.close(fd)
    return True


def drop_reserve(directory: str) -> int:
    """Delete the reserve file; the bytes it held (0 if there was none)."""
    path = os.path.join(directory, RESERVE_FILE)
    try:
        size = os.stat(path).st_size
        os.unlink(path)
    except FileNotFoundError:
        return 0
    return size


def move_aside(directory: str) -> str:
    """Rename the environment's data file out of the way; the new name."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = os.path.join(directory, f"{DATA_FILE}.damaged-{stamp}")
    os.rename(os.path.join(directory, DATA_FILE), target)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(directory, LOCK_FILE))
    return target
