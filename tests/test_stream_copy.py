"""Tests of the streaming copy: the C extension kvstore._streamcopy and kvstore.stream_copy.

Every result is compared with numpy's. The extension's tests skip only when it is not
built; copy_into is tested on both paths (streaming and the np.copyto fallback).
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from kvstore import stream_copy

try:
    import kvstore._streamcopy as _streamcopy
except ImportError:
    _streamcopy = None

KiB = 1024
MiB = 1024 * KiB
MIN = stream_copy.MIN_ROW_BYTES
GUARD = 64  # bytes around each destination that no copy may touch
FILL = 0xA5

needs_ext = pytest.mark.skipif(
    _streamcopy is None,
    reason="kvstore._streamcopy is not built (pip install -e . compiles it); "
    "only the numpy fallback is tested",
)

LENGTHS = [0, 1, 15, 16, 17, 63, 64, 65, 4095, 4096, 65535, 65536, 65537, MiB + 3]


def random_bytes(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def guarded(n: int, offset: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(whole buffer, destination of n bytes at GUARD + offset inside it), all FILL."""
    whole = np.full(n + 2 * GUARD + offset, FILL, dtype=np.uint8)
    return whole, whole[GUARD + offset : GUARD + offset + n]


def assert_guards(whole: np.ndarray, dst: np.ndarray) -> None:
    start = dst.ctypes.data - whole.ctypes.data
    assert (whole[:start] == FILL).all(), "bytes before dst were written"
    assert (whole[start + dst.nbytes :] == FILL).all(), "bytes after dst were written"


# -- the extension --------------------------------------------------------------------


@needs_ext
@pytest.mark.parametrize("n", LENGTHS)
def test_ext_copy_lengths(n: int) -> None:
    src = random_bytes(n, seed=n)
    whole, dst = guarded(n)
    _streamcopy.copy(dst, src)
    assert np.array_equal(dst, src)
    assert_guards(whole, dst)


@needs_ext
@pytest.mark.parametrize("dst_offset", range(18))
def test_ext_copy_misaligned(dst_offset: int) -> None:
    # Lengths on both sides of the streaming threshold, and odd ones for the tail.
    for n in (_streamcopy.STREAM_MIN - 1, _streamcopy.STREAM_MIN + 37, 256 * KiB + 129):
        base = random_bytes(n + 32, seed=dst_offset)
        for src_offset in range(18):
            src = base[src_offset : src_offset + n]
            whole, dst = guarded(n, dst_offset)
            _streamcopy.copy(dst, src)
            assert np.array_equal(dst, src), (n, src_offset, dst_offset)
            assert_guards(whole, dst)


@needs_ext
def test_ext_copy_other_buffers() -> None:
    # Any buffer-protocol object: bytearray, memoryview, bytes as the source.
    src = bytes(random_bytes(MIN + 5))
    dst = bytearray(len(src))
    _streamcopy.copy(memoryview(dst), src)
    assert dst == src
    # Bytes, not elements: a float64 array into a uint8 one of the same byte length.
    floats = np.arange(MIN // 8, dtype=np.float64)
    raw = np.zeros(floats.nbytes, dtype=np.uint8)
    _streamcopy.copy(raw, floats)
    assert raw.tobytes() == floats.tobytes()


@needs_ext
def test_ext_copy_overlapping_is_memmove() -> None:
    n = 256 * KiB
    buf = random_bytes(n + 100)
    want = buf.copy()
    want[100:] = want[:-100].copy()
    _streamcopy.copy(buf[100:], buf[:-100])
    assert np.array_equal(buf, want)


@needs_ext
def test_ext_copy_readonly_dst_raises() -> None:
    dst = np.zeros(MIN, dtype=np.uint8)
    dst.flags.writeable = False
    with pytest.raises(ValueError, match=r"dst is read-only"):
        _streamcopy.copy(dst, np.ones(MIN, dtype=np.uint8))
    with pytest.raises(ValueError, match=r"dst is read-only"):
        _streamcopy.copy(bytes(16), bytearray(16))
    assert not dst.any()


@needs_ext
def test_ext_copy_length_mismatch_raises() -> None:
    with pytest.raises(ValueError, match=r"dst has 100 bytes, src has 101"):
        _streamcopy.copy(np.zeros(100, dtype=np.uint8), np.zeros(101, dtype=np.uint8))


@needs_ext
def test_ext_copy_non_contiguous_raises() -> None:
    strided = np.zeros(2 * MIN, dtype=np.uint8)[::2]
    contiguous = np.zeros(MIN, dtype=np.uint8)
    with pytest.raises(ValueError, match=r"dst is not C-contiguous"):
        _streamcopy.copy(strided, contiguous)
    with pytest.raises(ValueError, match=r"src is not C-contiguous"):
        _streamcopy.copy(contiguous, strided)
    rows = np.zeros((4, 2 * KiB), dtype=np.uint8)[:, :KiB]  # contiguous rows, gaps between
    with pytest.raises(ValueError, match=r"dst is not C-contiguous"):
        _streamcopy.copy(rows, np.zeros((4, KiB), dtype=np.uint8))


@needs_ext
def test_ext_copy_bad_arguments_raise() -> None:
    with pytest.raises(TypeError, match=r"bytes-like object"):
        _streamcopy.copy(bytearray(4), 1234)
    with pytest.raises(TypeError, match=r"exactly 2 arguments"):
        _streamcopy.copy(bytearray(4))


@needs_ext
def test_streaming_flag_matches_build() -> None:
    on_x86_64 = platform.machine().lower() in ("x86_64", "amd64")
    assert bool(_streamcopy.STREAMING) == on_x86_64
    if os.environ.get(stream_copy.ENV, "1").strip() != "0":
        assert on_x86_64 == stream_copy.STREAMING


def test_env_zero_disables_streaming() -> None:
    code = "import kvstore.stream_copy as s; print(s.STREAMING, s._copy is None)"
    env = {**os.environ, stream_copy.ENV: "0"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["False", "True"]


# -- copy_into, on both paths ---------------------------------------------------------


@pytest.fixture(params=["stream", "fallback"])
def calls(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Run the test with the extension (counting its calls) and with np.copyto only."""
    counted: list[int] = []
    if request.param == "fallback":
        monkeypatch.setattr(stream_copy, "_copy", None)
    else:
        if _streamcopy is None:
            pytest.skip("kvstore._streamcopy is not built: no streaming path to test")
        ext_copy: Callable[[np.ndarray, np.ndarray], None] = _streamcopy.copy

        def counting(dst: np.ndarray, src: np.ndarray) -> None:
            counted.append(dst.nbytes)
            ext_copy(dst, src)

        monkeypatch.setattr(stream_copy, "_copy", counting)
    yield counted


def expected(dst: np.ndarray, src: np.ndarray) -> np.ndarray:
    """What np.copyto makes of the whole buffer behind dst."""
    base = dst.base if dst.base is not None else dst
    assert isinstance(base, np.ndarray)
    want = base.copy()
    view = np.ndarray(dst.shape, dst.dtype, want, dst.ctypes.data - base.ctypes.data, dst.strides)
    np.copyto(view, src)
    return want


def check(dst: np.ndarray, src: np.ndarray) -> None:
    base = dst.base if dst.base is not None else dst
    assert isinstance(base, np.ndarray)
    want = expected(dst, src)
    stream_copy.copy_into(dst, src)
    assert np.array_equal(base, want)


def test_copy_into_contiguous_is_one_call(calls: list[int]) -> None:
    src = random_bytes(16 * MIN).reshape(16, MIN)
    dst = np.zeros_like(src)
    check(dst, src)
    if stream_copy._copy is not None:
        assert calls == [src.nbytes]


@pytest.mark.parametrize("row", [MIN, MIN + 5])
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reversed"])
def test_copy_into_strided_rows(calls: list[int], row: int, reverse: bool) -> None:
    # A slot view: rows of `row` bytes at a larger stride, e.g. one layer of a block.
    rows = 6
    base = np.full((rows, row + 3 * KiB + 1), FILL, dtype=np.uint8)
    dst = base[::-1, 7 : 7 + row] if reverse else base[:, 7 : 7 + row]
    src = random_bytes(rows * row).reshape(rows, row)
    check(dst, src)
    if stream_copy._copy is not None:
        assert calls == [row] * rows


def test_copy_into_strided_src(calls: list[int]) -> None:
    src = random_bytes(4 * 2 * MIN).reshape(4, 2 * MIN)[::-1, 3 : 3 + MIN]
    dst = np.zeros((4, MIN), dtype=np.uint8)
    check(dst, src)
    if stream_copy._copy is not None:
        assert calls == [MIN] * 4


def test_copy_into_other_dtypes(calls: list[int]) -> None:
    src = np.random.default_rng(1).standard_normal((3, MIN // 2)).astype(np.float16)
    base = np.zeros((3, MIN), dtype=np.float16)
    check(base[:, 1 : 1 + MIN // 2], src)
    if stream_copy._copy is not None:
        assert calls == [MIN] * 3


def test_copy_into_small_rows_use_numpy(calls: list[int]) -> None:
    src = random_bytes(64 * (MIN // 2)).reshape(64, MIN // 2)
    base = np.zeros((64, MIN), dtype=np.uint8)
    check(base[:, : MIN // 2], src)  # large in all, but rows below the threshold
    check(np.zeros(100, dtype=np.uint8), random_bytes(100))
    assert calls == []


def test_copy_into_numpy_cases(calls: list[int]) -> None:
    # Overlap, broadcasting, casting and object arrays all go to np.copyto.
    buf = random_bytes(4 * MIN).reshape(4, MIN)
    check(buf[1:], buf[:-1])
    check(np.zeros((4, MIN), dtype=np.uint8), random_bytes(MIN))
    check(np.zeros((4, MIN), dtype=np.uint16), random_bytes(4 * MIN).reshape(4, MIN))
    objects = np.array([object()] * MIN, dtype=object)
    target = np.empty(MIN, dtype=object)
    stream_copy.copy_into(target, objects)
    assert all(a is b for a, b in zip(target, objects, strict=True))
    assert calls == []


@pytest.mark.parametrize("n", LENGTHS)
def test_copy_into_lengths(calls: list[int], n: int) -> None:
    whole, dst = guarded(n, 3)
    src = random_bytes(n, seed=n)
    stream_copy.copy_into(dst, src)
    assert np.array_equal(dst, src)
    assert_guards(whole, dst)


def test_copy_into_readonly_raises(calls: list[int]) -> None:
    dst = np.zeros((2, MIN), dtype=np.uint8)
    dst.flags.writeable = False
    with pytest.raises(ValueError, match=r"read-only"):
        stream_copy.copy_into(dst, np.ones((2, MIN), dtype=np.uint8))
    assert not dst.any()


def test_copy_into_shape_mismatch_raises(calls: list[int]) -> None:
    with pytest.raises(ValueError):
        stream_copy.copy_into(np.zeros((2, MIN), np.uint8), np.zeros((3, MIN), np.uint8))
    with pytest.raises(ValueError):
        stream_copy.copy_into(np.zeros(MIN, np.uint8), np.zeros(MIN + 1, np.uint8))
