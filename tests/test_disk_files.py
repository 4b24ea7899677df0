"""Checks on the disk tier's files before LMDB opens them (kvstore.disk.files)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import lmdb
import pytest

from kvbench.torture_kit import damage_free_list, damage_overflow
from kvstore.disk.files import find_damage, move_aside, read_meta, scan_in_child
from kvstore.disk.pages import find_page_damage


def make_env(directory: Path) -> Path:
    """50 values in overflow runs, then half of them deleted one commit at a time (so
    the free list holds pages)."""
    env = lmdb.open(str(directory), map_size=64 << 20, max_dbs=4)
    db = env.open_db(b"payload")
    with env.begin(write=True) as txn:
        for i in range(50):
            txn.put(i.to_bytes(4, "big"), os.urandom(10_000), db=db)
    for i in range(0, 50, 2):
        with env.begin(write=True) as txn:
            txn.delete(i.to_bytes(4, "big"), db=db)
    env.close()
    return directory / "data.mdb"


def test_a_sound_environment_has_no_damage(tmp_path: Path) -> None:
    make_env(tmp_path)
    assert find_damage(str(tmp_path)) is None
    assert find_page_damage(str(tmp_path)) is None
    assert scan_in_child(str(tmp_path)) is None
    assert find_damage(str(tmp_path / "none")) is None  # no file yet: nothing to check


def test_truncation_is_found_without_touching_the_map(tmp_path: Path) -> None:
    data = make_env(tmp_path)
    os.truncate(data, data.stat().st_size - 4096)
    assert "truncated" in (find_damage(str(tmp_path)) or "")
    os.truncate(data, 0)
    assert "empty" in (find_damage(str(tmp_path)) or "")


@pytest.mark.parametrize(
    ("damage", "found"),
    [
        (damage_free_list, "page {root} is held by"),  # a live page handed out as free
        (damage_overflow, "outside pages 2.."),  # a value's run past the file's end
    ],
)
def test_the_free_list_and_overflow_runs_are_checked(
    tmp_path: Path, damage: Callable[[Path], None], found: str
) -> None:
    data = make_env(tmp_path)
    meta = read_meta(str(data))
    assert meta is not None
    damage(data)
    assert find_damage(str(tmp_path)) is None  # the meta pages are sound
    assert found.format(root=meta.main_root) in (find_page_damage(str(tmp_path)) or "")
    assert "checking its pages failed" in (scan_in_child(str(tmp_path)) or "")


def test_noise_has_no_valid_meta_page(tmp_path: Path) -> None:
    data = make_env(tmp_path)
    data.write_bytes(os.urandom(data.stat().st_size))
    assert "no valid LMDB meta page" in (find_damage(str(tmp_path)) or "")


def test_move_aside_keeps_the_file_for_a_post_mortem(tmp_path: Path) -> None:
    data = make_env(tmp_path)
    size = data.stat().st_size
    moved = Path(move_aside(str(tmp_path)))
    assert not data.exists() and not (tmp_path / "lock.mdb").exists()
    assert moved.name.startswith("data.mdb.damaged-") and moved.stat().st_size == size
