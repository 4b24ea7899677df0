"""Namespaces and block keys: the one place where token ids become cache keys.

A namespace fixes everything that makes two KV blocks interchangeable: the model id,
the KV layout (layers, KV heads, head dim, dtype, tokens per block, bytes per block,
tensor-parallel rank and world size), a tenant salt and the hash algorithm. Its digest
seeds every chain, so blocks of different models, layouts or tenants never match.

Block keys form a chain::

    key[0] = H(namespace.digest || extra || tokens[0 : T])
    key[i] = H(key[i-1]         || extra || tokens[i*T : (i+1)*T])

where T is tokens per block, tokens are encoded as little-endian uint32 and ``extra``
is a length-prefixed blob of extra keys for that block: those of the whole request (a
LoRA adapter's id), then the block's own (the multimodal items it overlaps, its
prompt embeddings). On the wire a request carries one list of extra keys; a block's
own travel in it as :func:`block_extra_key` entries, which :func:`chain_keys` takes
out of the list and mixes into their block only (a daemon that did not know them
would mix them into every block: fewer matches, never a wrong one).
Only full blocks get keys. H is SHA-256 (default, 32-byte keys) or xxh3-128 (16-byte
keys). Nothing here depends on Python's ``hash()``, PYTHONHASHSEED or any random seed:
the same tokens give the same keys in every process, on every host, after restarts.
The daemon and the client both call :func:`chain_keys`, so they cannot disagree.
"""

from __future__ import annotations

import array
import hashlib
import struct
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, NewType

import numpy as np
import xxhash

from kvstore import codecs
from kvstore.errors import InvalidArgument

BlockKey = NewType("BlockKey", bytes)
"""A block's identity: the chained hash of its namespace, its ancestors and its tokens."""

MIN_BLOCK_TOKENS = 2
MAX_BLOCK_TOKENS = 256
DEFAULT_BLOCK_TOKENS = 16
MAX_TOKEN_ID = 2**32 - 1
MAX_BLOCK_BYTES = 1 << 30
HASH_ALGORITHMS = ("sha256", "xxh3-128")
# a namespace's declared fields that label it without being part of its digest, and
# the most characters each may have
LABELS = {"served_model": 256, "tokenizer": 4096}

DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


@dataclass(frozen=True, slots=True)
class NamespaceSpec:
    """What a client declares when it opens a namespace.

    ``block_bytes`` is the size of one stored block (all layers, K and V, of
    ``block_tokens`` tokens on this rank). When the layout fields are given
    (``num_layers``, ``num_kv_heads``, ``head_dim``), ``block_bytes`` must equal
    ``2 * num_layers * num_kv_heads * head_dim * dtype_bytes * block_tokens``;
    a zero ``block_bytes`` is then derived from them.
    """

    model: str
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    block_bytes: int = 0
    num_layers: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    dtype: str = "bfloat16"
    rank: int = 0
    world_size: int = 1
    tenant_salt: str = ""
    hash_algorithm: str = "sha256"
    vocab_size: int = 0  # 0: any uint32 token id is accepted
    # how its colder tiers keep its blocks (kvstore.codecs): part of its identity
    codec: str = "exact"
    # labels, not identity (LABELS): the name its engine serves the model under, and
    # where its tokenizer is (a Hugging Face id or a directory: kvctl --text). Kept and
    # sent with the declared fields, outside the digest, so engines that serve the same
    # weights under other names share its blocks; a re-open may relabel it
    served_model: str = field(default="", compare=False)
    tokenizer: str = field(default="", compare=False)
    digest: bytes = field(init=False, repr=False, compare=False)
    # stable printable id: model name plus the first 12 hex digits of the digest (kept,
    # not formatted per use: every event and lookup of a block names it)
    ns_id: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _validate(self)
        if self.block_bytes == 0:
            object.__setattr__(self, "block_bytes", self.layout_bytes())
        codecs.check(self.codec, self.dtype, self.head_dim, self.block_bytes)
        object.__setattr__(self, "digest", _namespace_digest(self))
        object.__setattr__(self, "ns_id", f"{self.model}@{self.digest.hex()[:12]}")

    def layout_bytes(self) -> int:
        """Bytes per block implied by the layout fields (0 when they are not all given)."""
        return layout_bytes(
            self.block_tokens, self.num_layers, self.num_kv_heads, self.head_dim, self.dtype
        )

    @property
    def key_bytes(self) -> int:
        return 32 if self.hash_algorithm == "sha256" else 16

    def to_dict(self) -> dict[str, object]:
        """The declared fields, for persistence (LMDB) and the wire; digest excluded."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.init}

    def identity(self) -> dict[str, object]:
        """The declared fields that make the namespace (its labels left out)."""
        return {k: v for k, v in self.to_dict().items() if k not in LABELS}

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> NamespaceSpec:
        return cls(**data)  # type: ignore[arg-type]


def relabel(held: NamespaceSpec, opened: NamespaceSpec) -> NamespaceSpec:
    """``held`` (a namespace's spec) with the labels a re-open of it declares (its
    non-empty ones: an engine that declares none leaves them as they are); ``held``
    itself when that changes nothing."""
    given = {k: getattr(opened, k) for k in LABELS if getattr(opened, k)}
    if all(getattr(held, k) == v for k, v in given.items()):
        return held
    return replace(held, **given)


def layout_fields(
    block_tokens: int,
    block_bytes: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: str,
) -> dict[str, int | str]:
    """The layout fields of a namespace whose blocks are ``block_bytes`` each: all four
    (the daemon then checks ``block_bytes`` against them) when they account for every
    byte of a block, none when they do not (a padded engine page is described by
    ``block_bytes`` alone). For an engine integration's ``KVClient.namespace`` call."""
    if layout_bytes(block_tokens, num_layers, num_kv_heads, head_dim, dtype) != block_bytes:
        return {}
    return {"num_layers": num_layers, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
            "dtype": dtype}  # fmt: skip


def layout_bytes(
    block_tokens: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: str
) -> int:
    """Bytes of one block the layout fields imply, ``2 (K, V) x layers x KV heads x
    head dim x dtype bytes x tokens``: 0 when one of them is 0 or the dtype unknown."""
    return 2 * num_layers * num_kv_heads * head_dim * DTYPE_BYTES.get(dtype, 0) * block_tokens


def _validate(spec: NamespaceSpec) -> None:
    if not spec.model or len(spec.model) > 256:
        raise InvalidArgument("model must be a non-empty string of at most 256 characters")
    for label, most in LABELS.items():
        if not isinstance(getattr(spec, label), str) or len(getattr(spec, label)) > most:
            raise InvalidArgument(f"{label} must be a string of at most {most} characters")
    if not MIN_BLOCK_TOKENS <= spec.block_tokens <= MAX_BLOCK_TOKENS:
        raise InvalidArgument(
            f"block_tokens must be in [{MIN_BLOCK_TOKENS}, {MAX_BLOCK_TOKENS}], "
            f"got {spec.block_tokens}"
        )
    if spec.dtype not in DTYPE_BYTES:
        raise InvalidArgument(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {spec.dtype!r}")
    if spec.hash_algorithm not in HASH_ALGORITHMS:
        raise InvalidArgument(
            f"hash_algorithm must be one of {list(HASH_ALGORITHMS)}, got {spec.hash_algorithm!r}"
        )
    for name in ("num_layers", "num_kv_heads", "head_dim", "rank", "vocab_size"):
        if getattr(spec, name) < 0:
            raise InvalidArgument(f"{name} must be >= 0, got {getattr(spec, name)}")
    if spec.world_size < 1 or not 0 <= spec.rank < spec.world_size:
        raise InvalidArgument(
            f"rank must be in [0, world_size), got rank={spec.rank} world_size={spec.world_size}"
        )
    implied = spec.layout_bytes()
    if spec.block_bytes < 0 or spec.block_bytes > MAX_BLOCK_BYTES:
        raise InvalidArgument(
            f"block_bytes must be in [1, {MAX_BLOCK_BYTES}], got {spec.block_bytes}"
        )
    if spec.block_bytes == 0 and implied == 0:
        raise InvalidArgument(
            "block_bytes is required unless num_layers, num_kv_heads and head_dim are all given"
        )
    if spec.block_bytes and implied and spec.block_bytes != implied:
        raise InvalidArgument(
            f"block_bytes={spec.block_bytes} does not match the layout "
            f"(2 x {spec.num_layers} layers x {spec.num_kv_heads} heads x {spec.head_dim} "
            f"x {DTYPE_BYTES[spec.dtype]} bytes x {spec.block_tokens} tokens = {implied})"
        )


def _namespace_digest(spec: NamespaceSpec) -> bytes:
    """SHA-256 over a canonical, length-prefixed encoding of every declared field (the
    codec only when it is not exact: namespaces from before codecs keep their keys)."""
    h = hashlib.sha256(b"kvstore.namespace.v1")
    declared = spec.identity()
    if declared["codec"] == codecs.EXACT:
        del declared["codec"]
    for name, value in sorted(declared.items()):
        encoded = str(value).encode()
        h.update(struct.pack("<I", len(name)) + name.encode())
        h.update(struct.pack("<I", len(encoded)) + encoded)
    return h.digest()


def encode_extra(parts: Sequence[bytes | str | int]) -> bytes:
    """Count- and length-prefixed encoding of extra keys (LoRA id, multimodal hashes).

    The prefixes make the encoding unambiguous, so no two different lists of extra
    keys can hash alike.
    """
    out = bytearray(struct.pack("<I", len(parts)))
    for part in parts:
        if isinstance(part, int):
            raw = str(part).encode()
        elif isinstance(part, str):
            raw = part.encode()
        else:
            raw = bytes(part)
        out += struct.pack("<I", len(raw)) + raw
    return bytes(out)


# the start of a wire extra key that belongs to one block (block_extra_key)
BLOCK_EXTRA_TAG = b"\x00kvstore.block-extra.v1\x00"


def block_extra_key(block: int, parts: Sequence[bytes | str | int]) -> bytes:
    """The extra key, for the wire's one list of them, that gives block ``block`` of a
    chain the extra keys ``parts`` (what ``chain_keys``'s ``block_extra`` does)."""
    if not 0 <= block < 2**32:
        raise InvalidArgument(f"a block extra key's block must be in [0, 2**32), got {block}")
    return BLOCK_EXTRA_TAG + struct.pack("<I", block) + encode_extra(parts)


def split_extra(
    extra: Sequence[bytes | str | int],
) -> tuple[list[bytes | str | int], dict[int, list[bytes]]]:
    """Extra keys of a request -> (those of every block, those of one block each):
    :func:`block_extra_key` entries are the latter. InvalidArgument for a malformed
    one, or two for one block."""
    common: list[bytes | str | int] = []
    per_block: dict[int, list[bytes]] = {}
    for part in extra:
        if not isinstance(part, (bytes, bytearray, memoryview)):
            common.append(part)
            continue
        raw = bytes(part)
        if not raw.startswith(BLOCK_EXTRA_TAG):
            common.append(raw)
            continue
        body = raw[len(BLOCK_EXTRA_TAG) :]
        if len(body) < 4:
            raise InvalidArgument("a block extra key is cut short before its block number")
        (block,) = struct.unpack_from("<I", body)
        if block in per_block:
            raise InvalidArgument(f"two block extra keys for block {block}")
        per_block[block] = _decode_extra(body[4:])
    return common, per_block


def _decode_extra(raw: bytes) -> list[bytes]:
    """The parts :func:`encode_extra` encoded (as bytes); InvalidArgument when ``raw``
    is not exactly one such encoding."""
    if len(raw) < 4:
        raise InvalidArgument("a block extra key's parts are cut short")
    (count,) = struct.unpack_from("<I", raw)
    parts: list[bytes] = []
    offset = 4
    for _ in range(count):
        if offset + 4 > len(raw):
            raise InvalidArgument("a block extra key's parts are cut short")
        (size,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if offset + size > len(raw):
            raise InvalidArgument("a block extra key's parts are cut short")
        parts.append(raw[offset : offset + size])
        offset += size
    if offset != len(raw):
        raise InvalidArgument("a block extra key has bytes after its parts")
    return parts


_U32_FAST = array.array("I").itemsize == 4 and sys.byteorder == "little"


def _tokens_int64(tokens: Sequence[int]) -> np.ndarray:
    try:
        return np.frombuffer(array.array("q", tokens), dtype=np.int64)
    except OverflowError:
        raise InvalidArgument(f"token ids must be < {MAX_TOKEN_ID + 1}") from None
    except TypeError as exc:
        raise InvalidArgument(f"tokens must be a flat sequence of integers ({exc})") from None


def tokens_array(tokens: Sequence[int] | np.ndarray, vocab_size: int = 0) -> np.ndarray:
    """Validate token ids and return them as a contiguous little-endian uint32 array.

    Raises InvalidArgument for negative ids, ids >= 2**32, ids >= vocab_size (when
    the namespace sets one), or anything that is not a flat sequence of integers.
    Python sequences go through ``array.array('I')``: one C loop that refuses floats,
    negative and too large ids, several times faster than numpy's inference on a list.
    """
    if isinstance(tokens, np.ndarray):
        arr = tokens
        if arr.ndim != 1:
            raise InvalidArgument(
                f"tokens must be a flat sequence of integers, got shape {arr.shape}"
            )
        if arr.size and arr.dtype.kind not in "iu":
            raise InvalidArgument(f"tokens must be integers, got dtype {arr.dtype}")
    elif _U32_FAST:
        try:  # 4-byte unsigned: one C loop, no int64 round trip; refuses <0 and >=2**32
            arr = np.frombuffer(array.array("I", tokens), dtype="<u4")
        except OverflowError:
            arr = _tokens_int64(tokens)  # only to name the offending value below
        except TypeError as exc:
            raise InvalidArgument(f"tokens must be a flat sequence of integers ({exc})") from None
    else:  # pragma: no cover - big-endian or unusual C int sizes
        arr = _tokens_int64(tokens)
    if arr.size == 0:
        return np.empty(0, dtype="<u4")
    low, high = int(arr.min()), int(arr.max())
    if low < 0:
        raise InvalidArgument(f"token ids must be >= 0, got {low}")
    limit = vocab_size if vocab_size else MAX_TOKEN_ID + 1
    if high >= limit:
        raise InvalidArgument(f"token ids must be < {limit}, got {high}")
    return np.ascontiguousarray(arr, dtype="<u4")


def _hasher(spec: NamespaceSpec) -> Any:
    """The hash a namespace's block keys are made with (a new hash object per call)."""
    return hashlib.sha256 if spec.hash_algorithm == "sha256" else xxhash.xxh3_128


def chain_keys(
    spec: NamespaceSpec,
    tokens: Sequence[int] | np.ndarray,
    extra: Sequence[bytes | str | int] = (),
    block_extra: Mapping[int, Sequence[bytes | str | int]] | None = None,
    max_blocks: int | None = None,
) -> list[BlockKey]:
    """Keys of every full block of ``tokens`` in namespace ``spec``, root first.

    ``extra`` is mixed into every block (e.g. a LoRA adapter id); ``block_extra``
    maps a block index to extra keys for that block only (e.g. the hash of an image
    whose placeholder tokens fall inside it), as do :func:`block_extra_key` entries of
    ``extra`` (the wire's form; a block named by both is InvalidArgument). A trailing
    partial block gets no key.
    """
    if extra and any(
        isinstance(part, (bytes, bytearray, memoryview))
        and bytes(part[: len(BLOCK_EXTRA_TAG)]) == BLOCK_EXTRA_TAG
        for part in extra
    ):
        extra, wired = split_extra(extra)
        if block_extra and wired.keys() & block_extra.keys():
            raise InvalidArgument("a block has extra keys both on the wire and by argument")
        block_extra = {**(block_extra or {}), **wired}
    arr = tokens_array(tokens, spec.vocab_size)
    n_blocks = arr.size // spec.block_tokens
    if max_blocks is not None:
        n_blocks = min(n_blocks, max_blocks)
    if n_blocks == 0:
        return []
    raw = arr[: n_blocks * spec.block_tokens].tobytes()
    stride = spec.block_tokens * 4
    common = encode_extra(extra)
    per_block = block_extra or {}
    new = _hasher(spec)
    keys: list[bytes] = []
    append = keys.append
    parent = spec.digest
    if not per_block:  # the hot path: one small concat, one update, one digest per block
        for offset in range(0, n_blocks * stride, stride):
            h = new(parent + common)
            h.update(raw[offset : offset + stride])
            parent = h.digest()
            append(parent)
    else:
        for i in range(n_blocks):
            suffix = common + encode_extra(per_block[i]) if i in per_block else common
            h = new(parent + suffix)
            h.update(raw[i * stride : (i + 1) * stride])
            parent = h.digest()
            append(parent)
    return keys  # type: ignore[return-value]  # BlockKey is bytes at run time


def tokens_name_block(spec: NamespaceSpec, parent: bytes | None, key: bytes, tokens: bytes) -> bool:
    """Whether ``tokens`` (packed little-endian uint32, one block's) are what ``key``
    was hashed from, after ``parent`` (None: the namespace's root) and no extra keys:
    so that tokens read from a disk record are told to routers only when they are the
    block's. (A block stored with extra keys, a LoRA id say, fails: its tokens are
    then not told, as a record without tokens; a miss of a router, never a wrong hit.)"""
    if len(tokens) != 4 * spec.block_tokens:
        return False
    h = _hasher(spec)((spec.digest if parent is None else parent) + _NO_EXTRA)
    h.update(tokens)
    return h.digest() == key


_NO_EXTRA = encode_extra(())


class KeyChain(list[BlockKey]):
    """The key chain of a prompt together with its tokens: block ``i`` covers
    ``tokens[i * block_tokens : (i + 1) * block_tokens]`` (little-endian uint32).

    The store keeps each stored block's tokens (what KV events and disk records carry)
    from the chain that names it. A prefix of a chain is a chain (``chain[:n]`` keeps
    the tokens); any other slice, or a plain list of keys, knows no tokens.
    """

    __slots__ = ("block_tokens", "tokens")

    def __init__(self, keys: Sequence[BlockKey], tokens: np.ndarray, block_tokens: int) -> None:
        super().__init__(keys)
        self.tokens = tokens
        self.block_tokens = block_tokens

    def __getitem__(self, item):  # type: ignore[no-untyped-def,override]
        if isinstance(item, slice) and item.start in (None, 0) and item.step in (None, 1):
            return KeyChain(list.__getitem__(self, item), self.tokens, self.block_tokens)
        return list.__getitem__(self, item)


def run_tokens(keys: Sequence[BlockKey], first: int, end: int) -> list[bytes | None]:
    """The tokens (packed little-endian uint32) of blocks ``first .. end - 1`` of a
    chain; Nones when ``keys`` is not a :class:`KeyChain`."""
    if not isinstance(keys, KeyChain):
        return [None] * (end - first)
    step = keys.block_tokens
    raw = keys.tokens[first * step : end * step].astype("<u4", copy=False).tobytes()
    width = 4 * step
    return [raw[i * width : (i + 1) * width] for i in range(end - first)]
