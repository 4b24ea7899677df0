"""A model named by its weights: the id an engine's namespace carries by default.

Two engines share blocks only when their namespaces match, and the model id is the
part of a namespace that says whose KV a block is. A path names a model badly: the
same weights under two paths would never share, and the name of a base model would
let two fine-tunes of it serve each other's KV. So a model loaded from local files is
named by a digest of its weight files' contents (:func:`weights_id`): file names and
xxh3-128 digests of their bytes, in name order. Reading a model's weights costs what
reading those bytes costs, so each file's digest is cached by its real path, size
and modification time (``$XDG_CACHE_HOME/kvstore/weights.json``): an engine started
again on the same files does not read them again.

A model that is not a local path (a hub id) is named by that id and its revision, as
the hub names its weights.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path

import xxhash

# the files that hold weights, by suffix (configs, tokenizers and templates do not)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz")
READ_BYTES = 16 << 20  # read in pieces of this size: the digest never holds a whole file
PREFIX = "weights-"


def cache_file() -> Path:
    """``$XDG_CACHE_HOME`` (or ``~/.cache``) ``/kvstore/weights.json``."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "kvstore" / "weights.json"


def weight_files(model: Path) -> list[Path]:
    """The weight files of a model directory (top level, by name), or the file itself."""
    if model.is_file():
        return [model]
    return sorted(p for p in model.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES)


def file_digest(path: Path) -> str:
    """xxh3-128 of a file's bytes, hex."""
    digest = xxhash.xxh3_128()
    with open(path, "rb", buffering=0) as f:
        while piece := f.read(READ_BYTES):
            digest.update(piece)
    return digest.hexdigest()


def weights_id(model: str, revision: str | None = None) -> str:
    """The model id of ``model`` (a local directory or file, or a hub id): see the
    module docstring. A local model without weight files is named by its path."""
    path = Path(model).expanduser()
    if not path.exists():
        return f"{model}@{revision}" if revision else model
    files = weight_files(path)
    if not files:
        return str(path.resolve())
    cached = _load_cache()
    total = xxhash.xxh3_128()
    changed = False
    for file in files:
        real = file.resolve()
        stat = real.stat()
        key = f"{real}:{stat.st_size}:{stat.st_mtime_ns}"
        digest = cached.get(key)
        if digest is None:
            for old in [k for k in cached if k.rpartition(":")[0].rpartition(":")[0] == str(real)]:
                del cached[old]  # the file changed since
            digest = cached[key] = file_digest(real)
            changed = True
        total.update(f"{file.name}\0{digest}\0".encode())
    if changed:
        _save_cache(cached)
    return PREFIX + total.hexdigest()


def _load_cache() -> dict[str, str]:
    try:
        data = json.loads(cache_file().read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, str)} if isinstance(data, dict) else {}


def _save_cache(cached: dict[str, str]) -> None:
    """Write the cache whole, by rename (another engine may read it meanwhile); a cache
    that cannot be written is no error: the next start reads the files again."""
    target = cache_file()
    with contextlib.suppress(OSError):
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".weights-")
        with os.fdopen(fd, "w") as f:
            json.dump(cached, f, indent=0, sort_keys=True)
        os.replace(tmp, target)
