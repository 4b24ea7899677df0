"""A model is named by its weights (kvclient.integrations.weights): the same weights
under two paths get one id, different weights (a fine-tune) another; each file's
digest is cached by path, size and modification time."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from kvclient.integrations.weights import cache_file, weights_id


def make_model(directory: Path, seed: int) -> Path:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text('{"model_type": "llama"}')
    data = bytes((i * 31 + seed) % 256 for i in range(1 << 16))
    (directory / "model-00001-of-00002.safetensors").write_bytes(data)
    (directory / "model-00002-of-00002.safetensors").write_bytes(data[::-1])
    return directory


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def test_the_same_weights_under_two_paths_have_one_id_and_a_fine_tune_another(
    tmp_path: Path,
) -> None:
    base = make_model(tmp_path / "base", 0)
    copy = tmp_path / "elsewhere" / "base-copy"
    shutil.copytree(base, copy)
    (copy / "config.json").write_text('{"model_type": "llama", "note": "configs differ"}')
    tuned = make_model(tmp_path / "tuned", 0)
    shard = tuned / "model-00002-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[1000] ^= 1  # one bit of one weight
    shard.write_bytes(bytes(data))

    assert weights_id(str(base)).startswith("weights-")
    assert weights_id(str(base)) == weights_id(str(copy))
    assert weights_id(str(tuned)) != weights_id(str(base))
    # a shard renamed is another model (names say which shard is which)
    (copy / "model-00002-of-00002.safetensors").rename(copy / "model-x.safetensors")
    assert weights_id(str(copy)) != weights_id(str(base))


def test_digests_are_cached_by_path_size_and_mtime(tmp_path: Path) -> None:
    model = make_model(tmp_path / "m", 1)
    first = weights_id(str(model))
    cached = json.loads(cache_file().read_text())
    assert len(cached) == 2 and all(str(model.resolve()) in key for key in cached)
    # the bytes change but size and mtime do not: the cached digest answers
    shard = model / "model-00001-of-00002.safetensors"
    stat = shard.stat()
    shard.write_bytes(bytes(stat.st_size))
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert weights_id(str(model)) == first
    # a new mtime: read again, and the stale entry is replaced
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert weights_id(str(model)) != first
    assert len(json.loads(cache_file().read_text())) == 2


def test_a_cache_that_cannot_be_written_or_read_costs_only_a_reread(tmp_path: Path) -> None:
    model = make_model(tmp_path / "m", 2)
    cache_file().parent.mkdir(parents=True)
    cache_file().write_text("not json")
    first = weights_id(str(model))
    cache_file().unlink()
    cache_file().parent.chmod(0o500)
    try:
        assert weights_id(str(model)) == first
    finally:
        cache_file().parent.chmod(0o700)


def test_a_hub_id_is_named_by_id_and_revision_and_a_dir_without_weights_by_path(
    tmp_path: Path,
) -> None:
    assert weights_id("org/model", "abc123") == "org/model@abc123"
    assert weights_id("org/model") == "org/model"
    empty = tmp_path / "no-weights"
    empty.mkdir()
    assert weights_id(str(empty)) == str(empty.resolve())
    single = tmp_path / "model.gguf"
    single.write_bytes(b"GGUF" + bytes(100))
    assert weights_id(str(single)).startswith("weights-")
