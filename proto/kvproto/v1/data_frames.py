"""The data messages of Get and Put, built and read without the generated classes.

A ``GetResponse`` or ``PutRequest`` that carries only block bytes is one field: tag
``DATA_TAG`` (field 2, length-delimited), a varint length, the bytes. The daemon builds
Get's with one copy of the bytes (:func:`framed`) and reads Put's in place
(:func:`data_span`); the client does the same on its side. The bytes on the wire are
ordinary messages either way, so any client or daemon may use the generated classes.
"""

from __future__ import annotations

from collections.abc import Sequence

DATA_TAG = 0x12  # field 2 (``data`` of GetResponse and PutRequest), wire type 2
_DATA_TAG_BYTE = bytes([DATA_TAG])


def data_prefix(length: int) -> bytes:
    """Tag and varint length that put in front of ``length`` bytes make a data message."""
    out = bytearray(_DATA_TAG_BYTE)
    while length >= 0x80:
        out.append((length & 0x7F) | 0x80)
        length >>= 7
    out.append(length)
    return bytes(out)


def data_span(raw: bytes | memoryview) -> tuple[int, int] | None:
    """(offset, length) of the payload of a message that holds exactly one data field.

    None for anything else (a header, an empty message, extra fields): the caller then
    parses the message with the generated class, which handles every valid encoding.
    """
    size = len(raw)
    if size < 2 or raw[0] != DATA_TAG:
        return None
    length = shift = 0
    pos = 1
    while pos < size and pos <= 10:
        byte = raw[pos]
        pos += 1
        length |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return (pos, length) if pos + length == size else None
        shift += 7
    return None


def framed(pieces: Sequence[bytes | memoryview], length: int) -> bytes:
    """One data message holding the concatenation of ``pieces`` (``length`` bytes):
    a single copy of the payload into the new message."""
    return b"".join((data_prefix(length), *pieces))
