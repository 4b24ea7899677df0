"""A model is named by its weights (kvclient.integrations.weights): the same weights
under two paths get one id, different weights (a fine-tune) another, and so does a
config that changes the KV; each file's digest is cached by path and its stat (size,
modification and change times, inode), never for a file that may still change unseen."""

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
    # what names a copy, not what it computes, may differ
    (copy / "config.json").write_text(
        '{"model_type": "llama", "_name_or_path": "elsewhere", "transformers_version": "9"}'
    )
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


def test_a_config_that_changes_the_kv_is_another_model(tmp_path: Path) -> None:
    base = make_model(tmp_path / "base", 3)
    base_id = weights_id(str(base))
    for name, config in [
        ("rope", '{"model_type": "llama", "rope_theta": 500000.0}'),
        ("scaling", '{"model_type": "llama", "rope_scaling": {"type": "yarn", "factor": 4}}'),
        ("window", '{"model_type": "llama", "sliding_window": 4096}'),
        ("heads", '{"model_type": "llama", "num_key_value_heads": 2}'),
        ("dtype", '{"model_type": "llama", "torch_dtype": "float16"}'),
        ("unknown", '{"model_type": "llama", "some_new_knob": 1}'),
    ]:
        other = tmp_path / name
        shutil.copytree(base, other)
        (other / "config.json").write_text(config)
        assert weights_id(str(other)) != base_id, name
    # overrides given to the engine change the config it runs (vLLM's hf_overrides)
    assert weights_id(str(base), overrides={"rope_theta": 1e6}) != base_id
    assert weights_id(str(base), overrides={}) == base_id


def test_weights_in_sub_folders_get_a_digest_not_the_path(tmp_path: Path) -> None:
    model = tmp_path / "nested"
    (model / "transformer").mkdir(parents=True)
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "transformer" / "model.safetensors").write_bytes(b"w" * 4096)
    copy = tmp_path / "copy"
    shutil.copytree(model, copy)
    assert weights_id(str(model)).startswith("weights-")
    assert weights_id(str(model)) == weights_id(str(copy))
    (copy / "transformer" / "model.safetensors").write_bytes(b"v" * 4096)
    assert weights_id(str(model)) != weights_id(str(copy))


def test_weights_replaced_with_the_same_size_and_mtime_are_another_model(tmp_path: Path) -> None:
    model = make_model(tmp_path / "m", 1)
    first = weights_id(str(model))
    # the bytes change in place, size and mtime put back (cp -p, rsync -t, an image
    # with normalised mtimes): a digest is never reused for a file that changed
    shard = model / "model-00001-of-00002.safetensors"
    stat = shard.stat()
    shard.write_bytes(bytes(stat.st_size))
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert weights_id(str(model)) != first


def test_digests_are_cached_by_stat_and_a_replaced_file_is_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvclient.integrations import weights

    model = make_model(tmp_path / "m", 1)
    # files changed in the last seconds are not cached (their times may not show the
    # next change): this test's files are fresh, so it takes them as settled
    monkeypatch.setattr(weights, "SETTLED_NS", 0)
    read: list[Path] = []
    digest = weights.file_digest
    monkeypatch.setattr(weights, "file_digest", lambda path: read.append(path) or digest(path))
    first = weights_id(str(model))
    assert len(read) == 2
    cached = json.loads(cache_file().read_text())
    assert sorted(cached) == sorted(str(p.resolve()) for p in model.glob("*.safetensors"))
    assert weights_id(str(model)) == first and len(read) == 2  # from the cache
    # a file replaced by another of the same size and mtime (a new inode): read again
    shard = model / "model-00001-of-00002.safetensors"
    stat = shard.stat()
    replacement = model / "replacement.tmp"
    replacement.write_bytes(bytes(stat.st_size))
    os.utime(replacement, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    replacement.replace(shard)
    assert weights_id(str(model)) != first
    assert read[2:] == [shard.resolve()]
    assert len(json.loads(cache_file().read_text())) == 2  # the stale entry replaced


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
