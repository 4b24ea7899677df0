"""Result types <-> protobuf messages, written once for the daemon and the client.

A result's fields carry the names of its message's fields, so one pair of functions
converts every type: :func:`to_message` (the daemon's side) and :func:`from_message`
(the client's). What differs by more than a name is spelt out below: the nested stats,
the event enums, and the few fields whose wire form is not the Python one.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, TypeVar

from kvproto.v1 import kvstore_pb2 as pb
from kvproto.v1 import results as r

R = TypeVar("R")
M = TypeVar("M")

EVENT_KINDS: dict[str, pb.EventKind] = {
    "stored": pb.EVENT_KIND_STORED,
    "removed": pb.EVENT_KIND_REMOVED,
    "demoted": pb.EVENT_KIND_DEMOTED,
    "promoted": pb.EVENT_KIND_PROMOTED,
    "pending_dropped": pb.EVENT_KIND_PENDING_DROPPED,
    "corrupt": pb.EVENT_KIND_CORRUPT,
}
TIERS: dict[str, int] = {"": pb.TIER_UNSPECIFIED, "host": pb.TIER_HOST, "disk": pb.TIER_DISK}
_KIND_NAMES = {value: name for name, value in EVENT_KINDS.items()}
_TIER_NAMES = {value: name for name, value in TIERS.items()}


def to_message(result: Any, message_class: type[M], **given: Any) -> M:
    """The message of ``result``: every field the message has, by name, and ``given``."""
    names = message_class.DESCRIPTOR.fields_by_name  # type: ignore[attr-defined]
    values = {f.name: getattr(result, f.name) for f in fields(result) if f.name in names}
    return message_class(**(values | given))


def from_message(result_class: type[R], message: Any, **given: Any) -> R:
    """The ``result_class`` of ``message``: every field by name, and ``given``."""
    values = {f.name: getattr(message, f.name) for f in fields(result_class) if f.name not in given}  # type: ignore[arg-type]
    return result_class(**values, **given)


def put_response(result: r.PutResult) -> pb.PutResponse:
    return to_message(result, pb.PutResponse)


def put_result(message: pb.PutResponse) -> r.PutResult:
    return from_message(r.PutResult, message, out_of_space=False)


def lookup_result(message: pb.LookupResponse) -> r.LookupResult:
    return r.LookupResult(
        tokens=message.ready_tokens,
        blocks=message.ready_blocks,
        host_blocks=message.host_blocks,
        disk_blocks=message.disk_blocks,
        pending_blocks=message.pending_blocks,
        shared_blocks=message.shared_blocks,
    )


def miss_reason(message: pb.MissReason) -> r.MissReason:
    return from_message(r.MissReason, message, differs=tuple(message.differs))


def server_info(message: pb.ServerInfoResponse) -> r.ServerInfo:
    """The daemon's ServerInfo (a daemon too old to say its uid says no version)."""
    return from_message(r.ServerInfo, message, uid=message.uid if message.version else None)


def stats_response(stats: r.Stats) -> pb.StatsResponse:
    return to_message(
        stats,
        pb.StatsResponse,
        tiers=[to_message(t, pb.TierStats) for t in stats.tiers],
        namespaces=[to_message(n, pb.NamespaceStats) for n in stats.namespaces],
        tenants=[to_message(t, pb.TenantStats) for t in stats.tenants],
        disk_writable=not stats.disk_fault,
        shared=None if stats.shared is None else to_message(stats.shared, pb.SharedTierStats),
    )


def stats(message: pb.StatsResponse) -> r.Stats:
    return from_message(
        r.Stats,
        message,
        tiers=tuple(from_message(r.TierStats, t) for t in message.tiers),
        namespaces=tuple(from_message(r.NamespaceStats, n) for n in message.namespaces),
        tenants=tuple(from_message(r.TenantStats, t) for t in message.tenants),
        counters=dict(message.counters),
        disk_fault="" if message.disk_writable else message.disk_fault,
        shared=from_message(r.SharedStats, message.shared) if message.HasField("shared") else None,
    )


def event_message(event: r.Event) -> pb.Event:
    return pb.Event(
        seq=event.seq,
        kind=EVENT_KINDS[event.kind],  # type: ignore[arg-type]
        ns_id=event.ns_id,
        key=event.key,
        tier=TIERS[event.tier],  # type: ignore[arg-type]
        timestamp=event.timestamp,
    )


def events(message: pb.WatchEventsResponse) -> list[r.Event]:
    return [
        r.Event(
            e.seq,
            _KIND_NAMES.get(e.kind, "unknown"),
            e.ns_id,
            e.key,
            _TIER_NAMES.get(e.tier, ""),
            e.timestamp,
        )
        for e in message.events
    ]


def event_kind_values(kinds: list[str] | tuple[str, ...]) -> list[pb.EventKind]:
    return [EVENT_KINDS[k] for k in kinds]
