"""A model named by its weights: the id an engine's namespace carries by default.

Two engines share blocks only when their namespaces match, and the model id is the
part of a namespace that says whose KV a block is. A path names a model badly: the
same weights under two paths would never share, and the name of a base model would
let two fine-tunes of it serve each other's KV. So a model loaded from local files is
named by a digest of (:func:`weights_id`):

1. its weight files' contents: relative file names and xxh3-128 digests of their
   bytes, in name order; the files at the top of the directory, or, where it has
   none there, those in its sub-folders;
2. its configuration (``config.json``, and a LoRA adapter's ``adapter_config.json``):
   every key but those that only name or describe the files (:data:`NAMING_KEYS`),
   because rope scaling and theta, sliding windows, heads, head dim, layers, dtype
   and any knob a model family adds change the KV computed with the same weights. A
   key unknown here counts: a config that differs in it is another model (a miss,
   never another model's KV). Overrides the engine applies on top (vLLM's
   ``hf_overrides``) count as the config does.

Reading a model's weights costs what reading those bytes costs, so each file's digest
is cached (``$XDG_CACHE_HOME/kvstore/weights.json``, and in the process) by its real
path and its stat: device, inode, size, modification and change times. A file
rewritten in place, or replaced by another of the same size and mtime (``cp -p``,
``rsync -t``, images with normalised mtimes), has another inode or change time, which
nobody can set back. File times have a granularity (a few ms, up to seconds on some
file systems): a file whose change time is less than :data:`SETTLED_NS` before it was
looked at could change again without its times showing it, so its digest is not
cached and the next start reads it again (as git treats "racily clean" files).

A model that is not a local path (a hub id) is named by that id and its revision, as
the hub names its weights (plus a digest of the engine's overrides, if any).
:func:`adapter_id` names a LoRA adapter, which must be local files: a name alone never
stands for an adapter's weights.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import xxhash

# the files that hold weights, by suffix (configs, tokenizers and templates do not)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz")
CONFIG_FILES = ("config.json", "adapter_config.json")
# config keys that name or describe the files, or only steer generation: they do not
# change the KV (every other key does, as far as this module knows)
NAMING_KEYS = frozenset(
    {
        "_name_or_path", "name_or_path", "_commit_hash", "transformers_version",
        "base_model_name_or_path", "revision", "inference_mode", "use_cache",
        "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id",
        "decoder_start_token_id", "id2label", "label2id", "task_specific_params",
        "output_attentions", "output_hidden_states", "return_dict", "torchscript",
        "tokenizer_class", "_attn_implementation", "_attn_implementation_autoset",
    }
)  # fmt: skip
READ_BYTES = 16 << 20  # read in pieces of this size: the digest never holds a whole file
SETTLED_NS = 2_000_000_000  # a file changed less than this before its stat is read again
PREFIX = "weights-"

# real path -> (stat key, digest) of files whose digest is settled (this process)
_DIGESTS: dict[str, tuple[str, str]] = {}


class WeightsUnreadable(Exception):
    """An adapter's weights cannot be read (not a local directory, no weight files, an
    I/O error): it cannot be named by them."""


def cache_file() -> Path:
    """``$XDG_CACHE_HOME`` (or ``~/.cache``) ``/kvstore/weights.json``."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "kvstore" / "weights.json"


def weight_files(model: Path) -> list[Path]:
    """The weight files of a model directory (top level, by name; where the top level
    has none, those of its sub-folders, hidden ones skipped), or the file itself."""
    if model.is_file():
        return [model]
    top = sorted(p for p in model.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
    if top:
        return top
    return sorted(
        p
        for p in model.rglob("*")
        if p.suffix in WEIGHT_SUFFIXES
        and p.is_file()
        and not any(part.startswith(".") for part in p.relative_to(model).parts)
    )


def file_digest(path: Path) -> str:
    """xxh3-128 of a file's bytes, hex."""
    digest = xxhash.xxh3_128()
    with open(path, "rb", buffering=0) as f:
        while piece := f.read(READ_BYTES):
            digest.update(piece)
    return digest.hexdigest()


def weights_id(
    model: str, revision: str | None = None, overrides: Mapping[str, Any] | None = None
) -> str:
    """The model id of ``model`` (a local directory or file, or a hub id) with the
    engine's config ``overrides``: see the module docstring. A local model without
    weight files is named by its path."""
    path = Path(model).expanduser()
    if not path.exists():
        name = f"{model}@{revision}" if revision else model
        return f"{name}+config-{_config_digest({}, overrides)[:16]}" if overrides else name
    files = weight_files(path)
    if not files:
        return str(path.resolve())
    return _files_id(path, files, overrides)


def adapter_id(path: str) -> str:
    """The id of the LoRA adapter in directory ``path`` (its weights and
    ``adapter_config.json``); :class:`WeightsUnreadable` where it has no weights to
    read."""
    if not path:  # ("" would be the working directory)
        raise WeightsUnreadable("a LoRA adapter without a path")
    directory = Path(path).expanduser()
    try:
        files = weight_files(directory) if directory.is_dir() else []
        if not files:
            raise WeightsUnreadable(f"no LoRA weight files in {path!r}")
        return _files_id(directory, files, None)
    except OSError as exc:
        raise WeightsUnreadable(f"LoRA adapter {path!r}: {exc}") from None


def _files_id(path: Path, files: list[Path], overrides: Mapping[str, Any] | None) -> str:
    """The digest of ``files`` (under ``path``) and of ``path``'s config files."""
    digests = _digests(files)
    total = xxhash.xxh3_128()
    for file, digest in zip(files, digests, strict=True):
        name = file.name if file == path else file.relative_to(path).as_posix()
        total.update(f"{name}\0{digest}\0".encode())
    config = _read_configs(path) if path.is_dir() else {}
    if config or overrides:
        total.update(f"config\0{_config_digest(config, overrides)}\0".encode())
    return PREFIX + total.hexdigest()


def _digests(files: list[Path]) -> list[str]:
    """Each file's digest: from the process's or the disk's cache where its stat key is
    the one cached, else read (and cached when settled: module docstring). An entry
    is cached only for a file settled when it was read, so any later change shows in
    its key: a key that matches needs no second look."""
    out: list[str] = []
    cached: dict[str, tuple[str, str]] | None = None  # the disk cache, read when needed
    changed = False
    for file in files:
        real = str(file.resolve())
        looked_ns = time.time_ns()
        stat = os.stat(real)
        key = _stat_key(stat)
        entry = _DIGESTS.get(real)
        if entry is None or entry[0] != key:
            cached = _load_cache() if cached is None else cached
            entry = cached.get(real)
        if entry is not None and entry[0] == key:
            _DIGESTS[real] = entry
            out.append(entry[1])
            continue
        digest = file_digest(Path(real))
        out.append(digest)
        assert cached is not None
        if _stat_key(os.stat(real)) == key and _settled(stat, looked_ns):
            _DIGESTS[real] = cached[real] = (key, digest)
            changed = True
        elif cached.pop(real, None) is not None:  # changed lately: read it next time
            changed = True
    if changed and cached is not None:
        _save_cache(cached)
    return out


def _stat_key(stat: os.stat_result) -> str:
    """What tells a file's bytes apart without reading them: device, inode, size,
    modification and change times (the change time cannot be set back)."""
    return f"{stat.st_dev}:{stat.st_ino}:{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ctime_ns}"


def _settled(stat: os.stat_result, looked_ns: int) -> bool:
    """Whether a change after ``looked_ns`` must show in the file's change time."""
    return looked_ns - stat.st_ctime_ns >= SETTLED_NS


def _read_configs(directory: Path) -> dict[str, Any]:
    """The config files of a model directory, by name (a file that is not JSON counts
    by its bytes: any change to it is another model)."""
    configs: dict[str, Any] = {}
    for name in CONFIG_FILES:
        file = directory / name
        if not file.is_file():
            continue
        raw = file.read_bytes()
        try:
            configs[name] = json.loads(raw)
        except ValueError:
            configs[name] = {"unparsed-bytes": xxhash.xxh3_128_hexdigest(raw)}
    return configs


def _without_naming_keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_naming_keys(v) for k, v in value.items() if k not in NAMING_KEYS}
    if isinstance(value, list):
        return [_without_naming_keys(v) for v in value]
    return value


def _config_digest(configs: dict[str, Any], overrides: Mapping[str, Any] | None) -> str:
    """xxh3-128 of the configs and the overrides, naming keys left out, as canonical
    JSON (sorted keys: the same settings in another order are the same model)."""
    kept = _without_naming_keys(configs)
    if overrides:
        kept["overrides"] = _without_naming_keys(dict(overrides))
    text = json.dumps(kept, sort_keys=True, separators=(",", ":"), default=repr)
    return xxhash.xxh3_128_hexdigest(text.encode())


def _load_cache() -> dict[str, tuple[str, str]]:
    """real path -> (stat key, digest); entries of another form are left out."""
    try:
        data = json.loads(cache_file().read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {
        path: (entry[0], entry[1])
        for path, entry in data.items()
        if isinstance(entry, list) and len(entry) == 2 and all(isinstance(e, str) for e in entry)
    }


def _save_cache(cached: dict[str, tuple[str, str]]) -> None:
    """Write the cache whole, by rename (another engine may read it meanwhile); a cache
    that cannot be written is no error: the next start reads the files again."""
    target = cache_file()
    with contextlib.suppress(OSError):
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".weights-")
        with os.fdopen(fd, "w") as f:
            json.dump(cached, f, indent=0, sort_keys=True)
        os.replace(tmp, target)
