"""KV codecs: how a namespace's colder tiers keep its blocks (:class:`Codec`).

Key and value tensors tolerate 8 bits with accuracy within noise, so the disk and
shared tiers (where bytes cost most, and blocks wait longest) may keep a namespace's
blocks encoded, near half the bytes:

- ``exact``: the block as the engine gave it, bit for bit (the default).
- ``int8``: symmetric integers, one scale per group: ``q = round(x / s)``,
  ``s = max|x| / 127``.
- ``fp8``: float8 e4m3 (the OCP ``e4m3fn``), one scale per group: ``s = max|x| / 448``.
- ``int4``: two symmetric 4-bit integers a byte, ``s = max|x| / 7`` (experimental).

A group is a contiguous run of ``head_dim`` elements: every layout an engine uses
(vLLM's pages, transformers' tensors) keeps a head's vector contiguous, so a codec
needs the namespace's dtype and head dim, never the engine's layout. Scales are
bfloat16 (the range of float32 in 2 bytes), and each value is quantized with its
group's scale as stored, so decoding is one multiply.

Encoded block: the scales of every group (bfloat16, little-endian), then the codes.
Which codec and version encoded a block is kept beside it (the disk record, the
shared tier's value header), never in these bytes. Encode and decode are numpy over
the whole block (``ml_dtypes`` for bfloat16 and float8), no Python loop per element.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import ml_dtypes
import numpy as np

from kvstore.errors import InvalidArgument


def _compiled_decode() -> Callable[[int, int, int, object, object], None] | None:
    """The decoder in C (kvstore/_kvcodec.c: one pass, the GIL released), or None when
    it was not built; numpy is the reference either way."""
    try:
        import kvstore._kvcodec as compiled
    except ImportError:  # pragma: no cover - built without a compiler
        return None
    decode: Callable[[int, int, int, object, object], None] = compiled.decode
    return decode


_DECODE = _compiled_decode()

EXACT = "exact"
CODECS = (EXACT, "fp8", "int8", "int4")
VERSION = 1  # of the encodings below; a block encoded with another one is a miss
# in stored records, and the kinds kvstore/_kvcodec.c decodes (its KIND_* values)
CODE_IDS = {EXACT: 0, "fp8": 1, "int8": 2, "int4": 3}
CODED_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}
SCALE = np.dtype(ml_dtypes.bfloat16)
_C_OUTPUTS = {"bfloat16": 0, "float16": 1, "float32": 2}
_LIMIT = {"int8": 127.0, "int4": 7.0, "fp8": 448.0}


@dataclass(frozen=True)
class Codec:
    """One namespace's codec: ``block_bytes`` of ``dtype`` in groups of ``head_dim``."""

    name: str
    dtype: str
    head_dim: int
    block_bytes: int

    def __post_init__(self) -> None:
        check(self.name, self.dtype, self.head_dim, self.block_bytes)

    @property
    def exact(self) -> bool:
        return self.name == EXACT

    @property
    def code_id(self) -> int:
        return CODE_IDS[self.name]

    @cached_property
    def elements(self) -> int:
        return self.block_bytes // np.dtype(CODED_DTYPES.get(self.dtype, np.uint8)).itemsize

    @cached_property
    def groups(self) -> int:
        return self.elements // self.head_dim if not self.exact else 0

    @cached_property
    def encoded_bytes(self) -> int:
        """Bytes of one encoded block."""
        if self.exact:
            return self.block_bytes
        codes = self.elements // 2 if self.name == "int4" else self.elements
        return self.groups * SCALE.itemsize + codes

    def encode(self, block: bytes | bytearray | memoryview, out: memoryview) -> memoryview:
        """Encode one block into the start of ``out``; the encoded bytes (a view)."""
        if self.exact:
            out[: self.block_bytes] = block
            return out[: self.block_bytes]
        x = np.frombuffer(block, dtype=CODED_DTYPES[self.dtype], count=self.elements)
        x = x.astype(np.float32).reshape(self.groups, self.head_dim)
        limit = _LIMIT[self.name]
        scale = (np.abs(x).max(axis=1) / limit).astype(SCALE)
        wide = scale.astype(np.float32)
        wide[wide == 0] = 1.0  # an all-zero group (its codes are 0 whatever the scale)
        x /= wide[:, None]
        dst = np.frombuffer(out, dtype=np.uint8, count=self.encoded_bytes)
        head = self.groups * SCALE.itemsize
        dst[:head] = scale.view(np.uint8)
        codes = dst[head:]
        if self.name == "fp8":
            np.clip(x, -limit, limit, out=x)
            codes[:] = x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8).ravel()
        elif self.name == "int8":
            codes[:] = np.clip(np.rint(x), -limit, limit).astype(np.int8).view(np.uint8).ravel()
        else:  # int4: two's complement nibbles, even elements in the low half
            q = (np.clip(np.rint(x), -limit, limit).astype(np.int8).ravel() & 0x0F).astype(
                np.uint8
            )
            codes[:] = q[0::2] | (q[1::2] << 4)
        return out[: self.encoded_bytes]

    @cached_property
    def max_scale(self) -> float:
        """The largest scale an encoding of a block of this dtype can have (its
        largest finite value over the codes' limit, and the scale's rounding)."""
        return float(ml_dtypes.finfo(CODED_DTYPES[self.dtype]).max) / _LIMIT[self.name] * 1.01

    @cached_property
    def _max_scale_bits(self) -> int:
        """:attr:`max_scale` as a bfloat16's bits. Non-negative bfloat16s order as their
        bits do, and every negative, infinite or NaN one has bits above it: one max
        over the scales' bits finds any scale no encoding makes."""
        return int(np.array([self.max_scale], dtype=SCALE).view(np.uint16)[0])

    def decode(
        self, encoded: bytes | bytearray | memoryview, out: memoryview, fast: bool = True
    ) -> None:
        """Decode one encoded block into ``out`` (``block_bytes`` of the namespace's
        dtype): in C when built (``fast``), else numpy, with the same result. Raises
        :class:`DamagedBlock` for scales no encoding makes (NaN, infinite, negative,
        or past :attr:`max_scale`: a crafted record), before anything is written."""
        if self.exact:
            out[: self.block_bytes] = encoded
            return
        if np.frombuffer(encoded, dtype=np.uint16, count=self.groups).max() > self._max_scale_bits:
            raise DamagedBlock(f"{self.name} block with scales no encoding makes")
        if fast and _DECODE is not None:
            view = memoryview(out).cast("B")[: self.block_bytes]
            src_view = memoryview(encoded).cast("B")[: self.encoded_bytes]
            _DECODE(
                self.code_id, _C_OUTPUTS[self.dtype], self.head_dim, src_view, view
            )
            return
        src = np.frombuffer(encoded, dtype=np.uint8, count=self.encoded_bytes)
        head = self.groups * SCALE.itemsize
        scale = src[:head].view(SCALE).astype(np.float32)[:, None]
        codes = src[head:]
        if self.name == "fp8":
            x = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
        elif self.name == "int8":
            x = codes.view(np.int8).astype(np.float32)
        else:
            x = np.empty(self.elements, dtype=np.float32)
            signed = codes.view(np.int8)
            x[0::2] = (signed << 4) >> 4  # the low nibble, sign-extended
            x[1::2] = signed >> 4
        x = x.reshape(self.groups, self.head_dim)
        x *= scale
        dst = np.frombuffer(out, dtype=CODED_DTYPES[self.dtype], count=self.elements)
        dst[:] = x.ravel()


class DamagedBlock(ValueError):
    """An encoded block that no encoder made: a miss, counted as damage."""


@functools.lru_cache(maxsize=1024)
def codec_of(name: str, dtype: str, head_dim: int, block_bytes: int) -> Codec | None:
    """The codec of a namespace with these fields; None for exact."""
    return None if name == EXACT else Codec(name, dtype, head_dim, block_bytes)


def check(name: str, dtype: str, head_dim: int, block_bytes: int) -> None:
    """InvalidArgument unless codec ``name`` can encode blocks of this namespace."""
    if name not in CODECS:
        raise InvalidArgument(f"codec must be one of {list(CODECS)}, got {name!r}")
    if name == EXACT:
        return
    if dtype not in CODED_DTYPES:
        raise InvalidArgument(
            f"codec {name} encodes {sorted(CODED_DTYPES)} blocks, not {dtype}: use exact"
        )
    if head_dim <= 0:
        raise InvalidArgument(f"codec {name} needs the namespace's head_dim (its groups)")
    itemsize = np.dtype(CODED_DTYPES[dtype]).itemsize
    if block_bytes % (itemsize * head_dim * 2):
        raise InvalidArgument(
            f"codec {name}: block_bytes={block_bytes} is not a whole number of pairs of "
            f"groups of head_dim={head_dim} {dtype} elements"
        )
