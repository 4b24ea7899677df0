"""What ``kvctl`` shows: the daemon's answers as JSON-ready dicts (``--json`` prints
them as they are) and those dicts as text (tables, the live ``top`` screen, events).
No I/O but the client calls of the ``collect_*`` functions and the screen's writes."""

from __future__ import annotations

import dataclasses
import re
import shutil
import time
from collections.abc import Iterable, Sequence
from typing import Any, TextIO

from kvclient.namespace import Namespace
from kvclient.sync_client import KVClient
from kvproto.v1.results import Event, NamespaceStats, SharedStats, TierStats

PROG = "kvctl"
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130

JSONDict = dict[str, Any]


class UsageError(Exception):
    """Bad input found after parsing (e.g. a token file that holds no integers)."""


# -- formatting helpers ----------------------------------------------------------------


def human_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``: binary units, one decimal, bytes as integers."""
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
    raise AssertionError("unreachable")


def percent(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.1f}%"


def human_duration(seconds: float) -> str:
    seconds = int(seconds)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s"


def format_table(headers: Sequence[str], rows: Iterable[Sequence[str]], left: int = 1) -> str:
    """Columns padded to fit; the first ``left`` columns left-aligned, the rest right."""
    body = [list(map(str, row)) for row in rows]
    widths = [len(h) for h in headers]
    for row in body:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]

    def line(cells: Sequence[str]) -> str:
        parts = [
            cell.ljust(w) if i < left else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    return "\n".join([line(headers), *(line(row) for row in body)])


# C0 controls, DEL, C1 controls, and the format characters that move or hide text
# (line and paragraph separators, zero-width marks, bidirectional overrides)
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(match: re.Match[str]) -> str:
    code = ord(match[0])
    return _NAMED.get(match[0]) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


def printable(text: str) -> str:
    """``text`` safe to write to a terminal: every control character (C0, DEL, C1) and
    every character that moves or hides text is shown as its escape (``\\x1b``,
    ``\\n``, ``\\u202e``), so a string a client chose (a model id, a name) can neither
    drive the terminal nor forge a row. The one place kvctl escapes what it prints."""
    return _UNPRINTABLE.sub(_escape, text)


def shown(data: Any) -> Any:
    """A collected answer with every string in it :func:`printable` (for the text
    views; ``--json`` prints the answer itself, and JSON escapes control characters)."""
    if isinstance(data, str):
        return printable(data)
    if isinstance(data, dict):
        return {key: shown(value) for key, value in data.items()}
    if isinstance(data, list | tuple):
        return [shown(value) for value in data]
    return data


def one_line(text: str) -> str:
    """A message (an error a daemon sent, which may quote a client's strings) as one
    printable line: its line ends escaped too, so a quoted string cannot forge one."""
    return " ".join(printable(text).split())


# -- collect: daemon -> JSON-ready dicts -----------------------------------------------


def _ratio(hits: int, misses: int) -> float | None:
    return hits / (hits + misses) if hits + misses else None


def tier_dict(tier: TierStats) -> JSONDict:
    """A tier's stats as JSON, with its fill and hit rate."""
    return dataclasses.asdict(tier) | {
        "used_fraction": tier.used_fraction,
        "hit_rate": _ratio(tier.hits, tier.misses),
    }


def namespace_dict(ns: NamespaceStats) -> JSONDict:
    """A namespace's stats as JSON, with its hit rate."""
    return dataclasses.asdict(ns) | {"hit_rate": _ratio(ns.hits, ns.misses)}


def event_dict(event: Event) -> JSONDict:
    return {
        "seq": event.seq,
        "kind": event.kind,
        "ns_id": event.ns_id,
        "key": event.key.hex(),
        "tier": event.tier or None,
        "timestamp": event.timestamp,
    }


STATUS_FIGURES = ("pending_blocks", "leases", "staged_bytes", "demotions", "promotions",
                  "corrupt_reads", "disk_queue_bytes", "disk_fault")  # fmt: skip


def collect_status(client: KVClient) -> JSONDict:
    """Everything ``status`` and ``top`` show: one Stats and one ServerInfo call."""
    stats = client.stats()
    info = client.server_info()
    return {
        "addr": client.addr,
        "version": info.version,
        "platform": stats.platform or info.platform,
        "pid": info.pid,
        "uptime_s": stats.uptime_s or info.uptime_s,
        "arena_path": info.arena_path,
        "arena_bytes": info.arena_bytes,
        "local_socket": info.local_socket,
        "tiers": [tier_dict(t) for t in stats.tiers],
        "namespaces": [namespace_dict(ns) for ns in stats.namespaces],
        **{k: getattr(stats, k) for k in STATUS_FIGURES},
        "counters": dict(stats.counters),
        "tenant": info.tenant,
        "tenants": [dataclasses.asdict(t) for t in stats.tenants],
        "shared": None if stats.shared is None else shared_dict(stats.shared),
        "time": time.time(),
    }


def shared_dict(shared: SharedStats) -> JSONDict:
    """The shared tier's stats as JSON, with its hit rate."""
    misses = shared.lookups - shared.hits
    return dataclasses.asdict(shared) | {"hit_rate": _ratio(shared.hits, misses)}


def collect_namespaces(client: KVClient) -> list[JSONDict]:
    return [namespace_dict(ns) for ns in client.stats().namespaces]


def resolve_namespace(client: KVClient, text: str) -> str:
    """What a user typed (an id, a bound name, a model or served model, a unique id
    prefix) -> an ns_id.

    Raises UsageError naming the candidates when nothing or more than one matches.
    """
    namespaces = client.stats().namespaces
    for matches in (
        [ns for ns in namespaces if text in (ns.ns_id, ns.name)],
        [ns for ns in namespaces if text in (ns.model, ns.served_model)],
        [ns for ns in namespaces if ns.ns_id.startswith(text)],
    ):
        if len(matches) == 1:
            return matches[0].ns_id
        if matches:
            listed = ", ".join(f"{ns.ns_id} ({ns.name or ns.model})" for ns in matches)
            raise UsageError(f"{text!r} matches {len(matches)} namespaces: {listed}; give one id")
    if not namespaces:
        raise UsageError(f"no namespace {text!r}: the daemon holds no namespaces yet")
    listed = ", ".join(
        f"{ns.ns_id} ({', '.join(filter(None, (ns.name, ns.model, ns.served_model)))})"
        for ns in namespaces
    )
    raise UsageError(f"no namespace {text!r}; there are: {listed} (see kvctl ls)")


def collect_lookup(ns: Namespace, tokens: list[int]) -> JSONDict:
    hit = ns.lookup(tokens)
    return {
        "ns_id": ns.ns_id,
        "block_tokens": ns.block_tokens,
        "request_tokens": len(tokens),
        "request_blocks": len(tokens) // ns.block_tokens,
        "tokens": hit.tokens,
        "blocks": hit.blocks,
        "host_blocks": hit.host_blocks,
        "disk_blocks": hit.disk_blocks,
        "pending_blocks": hit.pending_blocks,
        "shared_blocks": hit.shared_blocks,
    }


# -- render: dicts -> text -------------------------------------------------------------


def render_tiers(tiers: Sequence[JSONDict], rates: dict[str, tuple[float, float]] | None) -> str:
    headers = ["TIER", "CAPACITY", "USED", "USED%", "BLOCKS", "HITS", "MISSES", "HIT RATE"]
    if rates is not None:
        headers += ["IN/s", "OUT/s"]
    rows = []
    for t in tiers:
        used = t["used_bytes"] / t["capacity_bytes"] if t["capacity_bytes"] else None
        row = [
            t["name"],
            human_bytes(t["capacity_bytes"]),
            human_bytes(t["used_bytes"]),
            percent(used),
            str(t["blocks"]),
            str(t["hits"]),
            str(t["misses"]),
            percent(t["hit_rate"]),
        ]
        if rates is not None:
            rate = rates.get(t["name"])
            row += ["-", "-"] if rate is None else [human_bytes(r) for r in rate]
        rows.append(row)
    return format_table(headers, rows)


def render_namespaces(namespaces: Sequence[JSONDict], limit: int | None = None) -> str:
    if not namespaces:
        return "no namespaces"
    ordered = sorted(namespaces, key=lambda ns: (-ns["bytes"], ns["ns_id"]))
    shown = ordered if limit is None else ordered[:limit]
    rows = [
        [
            ns["ns_id"],
            ns["name"] or "-",
            ns["model"] or "-",
            ns.get("served_model") or "-",
            str(ns["block_tokens"]),
            human_bytes(ns["block_bytes"]),
            str(ns["blocks"]),
            human_bytes(ns["bytes"]),
            percent(ns["hit_rate"]),
            ns.get("codec", "exact"),
            human_bytes(ns.get("saved_bytes", 0)),
        ]
        for ns in shown
    ]
    table = format_table(
        ["NAMESPACE", "NAME", "MODEL", "SERVED", "TOKENS/BLOCK", "BLOCK", "BLOCKS", "BYTES",
         "HIT RATE", "CODEC", "SAVED"], rows, left=4,
    )  # fmt: skip
    if len(shown) < len(ordered):
        table += f"\n... {len(ordered) - len(shown)} more"
    return table


def render_status(data: JSONDict) -> str:
    head = (
        f"kvstored {data['version']} at {data['addr']}  platform {data['platform']}  "
        f"pid {data['pid']}  up {human_duration(data['uptime_s'])}"
    )
    summary = (
        f"namespaces {len(data['namespaces'])}  pending blocks {data['pending_blocks']}  "
        f"leases {data['leases']}  demotions {data['demotions']}  "
        f"promotions {data['promotions']}  corrupt reads {data['corrupt_reads']}  "
        f"disk queue {human_bytes(data['disk_queue_bytes'])}"
    )
    lines = [head, "", render_tiers(data["tiers"], None), "", summary]
    if data.get("shared"):
        lines.append(render_shared(data["shared"]))
    n = {"index_records_loaded": 0, "index_records_total": 0, **data.get("counters", {})}
    if n["index_records_loaded"] < n["index_records_total"]:
        lines.append("disk index loading: {index_records_loaded} of {index_records_total} "
                     "records (the rest are misses)".format_map(n))
    if any(n.get(k) for k in ("put_waits", "writer_refused", "dirty_dropped")):
        lines.append("disk writer behind: puts waited {put_waits}  blocks refused "
                     "{writer_refused}  dropped unwritten {dirty_dropped}".format_map(n))
    if data.get("disk_fault"):
        lines.append(f"disk tier NOT TAKING WRITES: {data['disk_fault']} (retrying)")
    if data.get("tenant"):
        lines.append(f"tenant {data['tenant']}: the namespaces above are its own")
    return "\n".join(lines)


def render_shared(shared: JSONDict) -> str:
    """One line: the shared tier's cluster, what went each way, and its trouble."""
    if not shared["connected"]:
        return f"shared tier {shared['url']}: NOT CONNECTED (retrying; reads are misses)"
    mac = f"MAC-refused {shared['unauthenticated']}  " if shared["keyed"] else ""
    return (
        f"shared tier {shared['url']}: nodes {shared['reachable_nodes']}/{shared['nodes']} "
        f"reachable  read {human_bytes(shared['bytes_read'])} "
        f"({shared['blocks_read']} blocks, hit rate {percent(shared['hit_rate'])})  "
        f"written {human_bytes(shared['bytes_written'])} ({shared['blocks_written']} blocks)  "
        f"errors {shared['errors']}  write errors {shared['write_errors']}  dropped "
        f"{shared['writes_dropped']}  corrupt {shared['corrupt']}  {mac}queue "
        f"{human_bytes(shared['queue_bytes'])} of {human_bytes(shared['queue_limit_bytes'])}"
    )


def render_tenants(tenants: list[JSONDict]) -> str:
    """Per-tenant usage against quotas (admin only)."""
    if not tenants:
        return "no tenants"

    def used(held: int, quota: int) -> str:
        return human_bytes(held) + (f" / {human_bytes(quota)}" if quota else "")

    rows = [("TENANT", "HOST", "DISK", "NS", "BLOCKS", "HIT RATE", "QUOTA EVICTIONS")]
    for t in tenants:
        looked = t["hits"] + t["misses"]
        rows.append(
            (
                t["tenant"] or "(none)",
                used(t["host_bytes"], t["host_quota"]),
                used(t["disk_bytes"], t["disk_quota"]),
                str(t["namespaces"]),
                str(t["blocks"]),
                f"{t['hits'] / looked:.0%}" if looked else "-",
                str(t["quota_evictions"]),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows)
    trust = (
        "a host quota is a tenant's own arena region; one user is one trust domain "
        "(docs/operations/tenants.md)"
    )
    return "\n".join([*(line.rstrip() for line in lines), trust])


def tier_rates(now: JSONDict, before: JSONDict | None) -> dict[str, tuple[float, float]]:
    """Bytes in/out per second of each tier between two status snapshots."""
    if before is None:
        return {}
    elapsed = max(now["time"] - before["time"], 1e-6)
    old = {t["name"]: t for t in before["tiers"]}
    rates = {}
    for t in now["tiers"]:
        prev = old.get(t["name"])
        if prev is not None:
            rates[t["name"]] = (
                max(0, t["bytes_in"] - prev["bytes_in"]) / elapsed,
                max(0, t["bytes_out"] - prev["bytes_out"]) / elapsed,
            )
    return rates


def render_top(data: JSONDict, before: JSONDict | None, height: int) -> str:
    clock = time.strftime("%H:%M:%S", time.localtime(data["time"]))
    head = (
        f"kvstored {data['version']} at {data['addr']}  platform {data['platform']}  "
        f"up {human_duration(data['uptime_s'])}  {clock}"
    )
    counts = (
        f"namespaces {len(data['namespaces'])}  pending {data['pending_blocks']}  "
        f"leases {data['leases']}  demotions {data['demotions']}  "
        f"promotions {data['promotions']}  disk queue {human_bytes(data['disk_queue_bytes'])}"
    )
    tiers = render_tiers(data["tiers"], tier_rates(data, before))
    used = 4 + tiers.count("\n") + 1 + 2  # head, blank, tiers, blank, counts, blank, header
    limit = max(1, height - used - 2)
    namespaces = render_namespaces(data["namespaces"], limit)
    return "\n".join([head, "", tiers, "", counts, "", namespaces])


def short_tokens_note(request_tokens: int, block_tokens: int) -> str:
    """What a lookup of ``request_tokens`` cannot see: a prompt shorter than a block, or
    the tokens after its last full block (only full blocks are cached)."""
    if request_tokens < block_tokens:
        return (
            f"; {request_tokens} tokens are less than one block of {block_tokens}: only "
            "full blocks are cached"
        )
    tail = request_tokens % block_tokens
    if tail:
        return f"; the last {tail} tokens are not a full block of {block_tokens} (never cached)"
    return ""


def render_lookup(data: JSONDict) -> str:
    line = (
        f"{data['ns_id']}: {data['tokens']} of {data['request_tokens']} tokens cached "
        f"({data['blocks']} of {data['request_blocks']} blocks: "
        f"{data['host_blocks']} host, {data['disk_blocks']} disk)"
    )
    if data.get("shared_blocks"):
        line += f", {data['shared_blocks']} of them just pulled from the shared tier"
    if data["pending_blocks"]:
        line += f", {data['pending_blocks']} pending"
    return line + short_tokens_note(data["request_tokens"], data["block_tokens"])


def render_event(event: JSONDict) -> str:
    stamp = time.strftime("%H:%M:%S", time.localtime(event["timestamp"]))
    millis = int((event["timestamp"] % 1) * 1000)
    return (
        f"{event['seq']:>8}  {stamp}.{millis:03d}  {event['kind']:<15}  "
        f"{event['tier'] or '-':<4}  {event['ns_id']}  {event['key'][:16]}"
    )


# -- the live screen -------------------------------------------------------------------


class LiveScreen:
    """Alternate screen with the cursor hidden while open; both restored on any exit."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def __enter__(self) -> LiveScreen:
        self.stream.write("\x1b[?1049h\x1b[?25l")
        self.stream.flush()
        return self

    def draw(self, frame: str) -> None:
        """Repaint from the top-left corner, erasing what the last frame left behind."""
        width = shutil.get_terminal_size().columns
        lines = [line[:width] + "\x1b[K" for line in frame.splitlines()]
        self.stream.write("\x1b[H" + "\n".join(lines) + "\x1b[J")
        self.stream.flush()

    def __exit__(self, *exc: object) -> None:
        self.stream.write("\x1b[?25h\x1b[?1049l")
        self.stream.flush()
