"""Protobuf <-> client types: the only module besides the clients that touches ``kvproto``.

Requests are built from already-validated Python values; answers become the shared
result types of :mod:`kvproto.v1.results` through :mod:`kvproto.v1.result_messages`
(written once for both sides), except the arena paths' slot tables here. No I/O here.

Data chunks skip protobuf objects: the client calls Get and Put with identity
(de)serializers, :func:`put_messages` frames each chunk itself (one copy from the
caller's array into the message) and :func:`data_of` finds the bytes inside a
received ``GetResponse`` without copying them (see ``kvproto.v1.data_frames``). The bytes on
the wire are ordinary messages, so this works against any daemon of the protocol.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from kvclient.arena_path import Slot, SlotTable
from kvclient.errors import InvalidArgumentError
from kvproto.v1 import kvstore_pb2 as pb
from kvproto.v1.data_frames import data_prefix, data_span
from kvproto.v1.results import NamespaceInfo, PutResult

ExtraKeys = Sequence[bytes | str | int]

# Layout fields a caller may pass to KVClient.namespace(), with their wire defaults.
LAYOUT_FIELDS = (
    "num_layers",
    "num_kv_heads",
    "head_dim",
    "dtype",
    "rank",
    "world_size",
    "tenant_salt",
    "hash_algorithm",
    "vocab_size",
    "codec",
    "served_model",  # labels, not layout (kvstore.keys.LABELS)
    "tokenizer",
)

DEFAULT_CHUNK_BYTES = 4 << 20  # data chunk size when the daemon does not say


def extra_bytes(extra_keys: ExtraKeys) -> list[bytes]:
    """Extra keys as bytes, encoded as kvstore.keys.encode_extra encodes them."""
    out = []
    for part in extra_keys:
        if isinstance(part, (bytes, bytearray, memoryview)):
            out.append(bytes(part))
        else:
            out.append(str(part).encode())
    return out


def namespace_request(
    model: str, block_tokens: int, block_bytes: int, name: str, layout: dict[str, Any]
) -> pb.OpenNamespaceRequest:
    """OpenNamespace request; InvalidArgumentError for fields the wire cannot carry."""
    unknown = sorted(set(layout) - set(LAYOUT_FIELDS))
    if unknown:
        raise InvalidArgumentError(
            f"unknown layout field(s) {unknown}; expected some of {list(LAYOUT_FIELDS)}"
        )
    if not isinstance(model, str) or not model:
        raise InvalidArgumentError("model must be a non-empty string")
    try:
        spec = pb.NamespaceSpec(
            model=model, block_tokens=block_tokens, block_bytes=block_bytes, **layout
        )
        return pb.OpenNamespaceRequest(spec=spec, name=name)
    except (TypeError, ValueError) as exc:  # negative or non-integer sizes, wrong types
        raise InvalidArgumentError(f"bad namespace spec: {exc}") from None


def get_request(
    ns_id: str,
    tokens: list[int],
    extra: list[bytes],
    max_blocks: int,
    release_lease_ids: list[int],
    *,
    unpinned: bool = False,
    counted: bool = False,
) -> pb.AcquireRequest:
    """The Acquire of an arena get: packed slots, the client's finished read leases
    riding along; ``unpinned`` asks for slots and epochs and no lease
    (kvclient.unpinned_reads); ``counted`` when it repeats an Acquire
    of the same get whose answer could not be used (the daemon counted that one)."""
    return pb.AcquireRequest(
        ns_id=ns_id,
        tokens=tokens,
        extra_keys=extra,
        max_blocks=max_blocks,
        release_lease_ids=release_lease_ids,
        compact_slots=True,
        unpinned=unpinned,
        counted=counted,
    )


def namespace_info(msg: pb.NamespaceInfo) -> NamespaceInfo:
    return NamespaceInfo(
        ns_id=msg.ns_id,
        model=msg.spec.model,
        block_tokens=msg.block_tokens,
        block_bytes=msg.block_bytes,
        served_model=msg.spec.served_model,
        tokenizer=msg.spec.tokenizer,
    )


def committed_put(
    reserved: pb.ReserveResponse, n_slots: int, commit: pb.CommitResponse | None
) -> PutResult:
    """What an arena put did: its Reserve answered ``n_slots`` slots, and ``commit``
    (None: nothing to commit) made some of them ready; the slots not committed are
    refused with the blocks the Reserve refused."""
    if commit is None:
        return PutResult.of_reservation(reserved.existing, reserved.refused, n_slots, 0)
    return PutResult.of_reservation(
        reserved.existing, reserved.refused, n_slots, commit.committed, commit.durable
    )


def more_windows(reserved: pb.ReserveResponse, n_slots: int) -> bool:
    """Whether a Reserve answered one window of a chain too long for the daemon's host
    tier: it reserved slots and refused the rest without running out of room, so the
    rest is for the next Reserve, from the block after the last slot (commit first)."""
    return n_slots > 0 and reserved.refused > 0 and not reserved.out_of_space


def slots(msgs: Sequence[pb.Slot]) -> list[Slot]:
    return [Slot(index=s.index, offset=s.offset, size=s.size) for s in msgs]


def slot_table(msg: pb.AcquireResponse | pb.ReserveResponse) -> SlotTable:
    """The slots of an Acquire or Reserve answer as arrays (what the copy routines work
    on), from its packed ``slot_offsets`` (asked for with ``compact_slots``) or else from
    its Slot messages."""
    if msg.slot_offsets:
        offsets = np.array(msg.slot_offsets, np.int64)
        if isinstance(msg, pb.ReserveResponse):
            return SlotTable(np.array(msg.slot_indices, np.int64), offsets)
        return SlotTable(np.arange(offsets.size, dtype=np.int64), offsets)
    indices: list[int] = []
    offsets_list: list[int] = []
    for s in msg.slots:  # one pass over the messages (each attribute read builds an int)
        indices.append(s.index)
        offsets_list.append(s.offset)
    return SlotTable(np.array(indices, np.int64), np.array(offsets_list, np.int64))


def put_messages(
    header: pb.PutHeader, data: np.ndarray | list[np.ndarray], chunk_bytes: int
) -> Iterator[bytes]:
    """The Put stream, serialized: the header, then the block bytes framed as data
    messages of at most ``chunk_bytes`` each, one copy per chunk.

    ``data`` is ``uint8[n, block_bytes]`` (sliced flat) or a list of per-block views
    (gathered into chunks the same way).
    """
    yield pb.PutRequest(header=header).SerializeToString()
    if isinstance(data, np.ndarray):
        flat = data.reshape(-1)
        for offset in range(0, flat.size, chunk_bytes):
            piece = flat[offset : offset + chunk_bytes]
            yield b"".join((data_prefix(piece.size), piece.data))
        return
    pending: list[memoryview] = []
    size = 0
    for row in data:
        raw = row.reshape(-1).data
        for offset in range(0, len(raw), chunk_bytes):
            part = raw[offset : offset + chunk_bytes]
            if size + len(part) > chunk_bytes:
                yield b"".join((data_prefix(size), *pending))
                pending, size = [], 0
            pending.append(part)
            size += len(part)
    if pending:
        yield b"".join((data_prefix(size), *pending))


def get_header(raw: bytes) -> pb.GetHeader | None:
    """The header of a serialized GetResponse; None if it is a data message."""
    msg = pb.GetResponse.FromString(raw)
    return msg.header if msg.WhichOneof("kind") == "header" else None


def data_of(raw: bytes) -> memoryview:
    """The bytes of a serialized data GetResponse, without copying them."""
    span = data_span(raw)
    if span is not None:
        offset, size = span
        return memoryview(raw)[offset : offset + size]
    return memoryview(pb.GetResponse.FromString(raw).data)  # any other valid encoding
