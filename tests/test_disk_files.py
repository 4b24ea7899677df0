"""Checks on the disk tier's files before LMDB opens them (kvstore.disk.files)."""

from __future__ import annotations

import os
from pathlib import Path

import lmdb

from kvstore.disk.files import find_damage, move_aside, scan_in_child


def make_env(directory: Path) -> Path:
    env = lmdb.open(str(directory), map_size=64 << 20, max_dbs=4)
    db = env.open_db(b"payload")
    with env.begin(write=True) as txn:
        for i in range(50):
            txn.put(i.to_bytes(4, "big"), os.urandom(10_000), db=db)
    env.close()
    return directory / "data.mdb"


def test_a_sound_environment_has_no_damage(tmp_path: Path) -> None:
    make_env(tmp_path)
    assert find_damage(str(tmp_path)) is None
    assert scan_in_child(str(tmp_path)) is None
    assert find_damage(str(tmp_path / "none")) is None  # no file yet: nothing to check


def test_truncation_is_found_without_touching_the_map(tmp_path: Path) -> None:
    data = make_env(tmp_path)
    os.truncate(data, data.stat().st_size - 4096)
    assert "truncated" in (find_damage(str(tmp_path)) or "")
    os.truncate(data, 0)
    assert "empty" in (find_damage(str(tmp_path)) or "")


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
