"""The sizes kvstored chooses from the machine when none is given: the host arena's
(a share of the memory) and the disk tier's (a share of the free disk, chosen at the
first start on a directory and kept there, ``DISK_SIZE_FILE``). :mod:`kvstored.config`
names them as the defaults of ``host_bytes`` and ``disk_bytes``."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvstored import hostinfo
from kvstored.config_values import format_size, parse_size

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

AUTO_HOST_MAX = 4 << 30
AUTO_DISK_MAX = 64 << 30
DISK_SIZE_FILE = "kvstored-disk-bytes"  # in disk_dir: the size chosen at the first start
MIN_AUTO_DISK_BYTES = 64 << 20  # an automatic disk size below this is no tier at all
FULL_DISK_SOURCE = "the file system is full, 25% of its size, chosen again at the next start"


def _auto_host_bytes(_: Mapping[str, Any]) -> int:
    """25% of the machine's memory (its cgroup limit in a container), 64 MiB .. 4 GiB,
    so that restarts on one machine get one size; lowered to half of what is
    available at start only when memory is that short."""
    size = min(AUTO_HOST_MAX, hostinfo.mem_total_bytes() // 4)
    size = min(size, hostinfo.mem_available_bytes() // 2)
    return max(64 << 20, size) >> 20 << 20


def kept_disk_bytes(disk_dir: str) -> int | None:
    """The automatic disk size kept in ``disk_dir`` at its first start (None: none kept)."""
    try:
        text = (Path(disk_dir) / DISK_SIZE_FILE).read_text()
        return parse_size(tomllib.loads(text)["disk_bytes"])
    except (OSError, KeyError, ValueError, tomllib.TOMLDecodeError):
        return None


def keep_disk_bytes(disk_dir: str, value: int) -> None:
    """Write the automatic disk size into ``disk_dir`` so later starts keep it."""
    path = Path(disk_dir) / DISK_SIZE_FILE
    path.write_text(
        "# Chosen by kvstored at the first start on this directory: 25% of the free disk,\n"
        f"# at most {format_size(AUTO_DISK_MAX)}. Set disk_bytes to change it, or delete this\n"
        "# file to choose again from the free space.\n"
        f"disk_bytes = {value}  # {format_size(value)}\n"
    )


def _auto_disk_bytes(resolved: Mapping[str, Any]) -> int:
    return _auto_disk(resolved["disk_dir"])[0]


def _auto_disk(disk_dir: str) -> tuple[int, str]:
    """The automatic disk size and its source: the one kept in ``disk_dir``; else 25% of
    the free space; else, on a file system too full for that (under
    MIN_AUTO_DISK_BYTES) but large enough for a tier, 25% of its size for this start
    only (not kept: the tier waits for room, as it does when its files cannot be
    created); else the too small size, which preflight refuses."""
    if not disk_dir:
        return 0, "default (auto)"
    kept = kept_disk_bytes(disk_dir)
    if kept is not None:
        return kept, f"default (auto, kept in disk_dir/{DISK_SIZE_FILE})"
    free_quarter = min(AUTO_DISK_MAX, hostinfo.disk_free_bytes(disk_dir) // 4) >> 20 << 20
    if free_quarter < MIN_AUTO_DISK_BYTES:
        size_quarter = min(AUTO_DISK_MAX, hostinfo.disk_size_bytes(disk_dir) // 4) >> 20 << 20
        if size_quarter >= MIN_AUTO_DISK_BYTES:
            return size_quarter, f"default (auto: {FULL_DISK_SOURCE})"
    return free_quarter, "default (auto)"
