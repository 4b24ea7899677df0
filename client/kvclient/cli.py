"""kvctl: look at and manage a running kvstored.

    kvctl status [--tenants] [--json]
    kvctl top [--interval S] [--once] [--json]
    kvctl ls [--json]
    kvctl lookup NAMESPACE (TOKENS... | --file F) [--json]
    kvctl clear [--ns NAMESPACE] --yes
    kvctl events [--count N [--follow]] [--from SEQ] [--duration S] [--ns NAMESPACE]
                 [--kind K] [--json]
    kvctl bench [--quick] [--report FILE.md] [--json FILE] ...

``--addr ADDR``, ``--timeout S`` and ``--token-file F`` go before or after the
command; without ``--token-file`` the token is ``$KVSTORE_TOKEN`` or the file
``$KVSTORE_TOKEN_FILE`` (a daemon with tenants: the admin token sees everything, and
``status --tenants`` needs it; TLS from ``$KVSTORE_TLS_CA`` and friends). A NAMESPACE is
what ``kvctl ls`` shows: its id, its bound name, or its model when only one namespace
has that model (a unique prefix of an id works too); anything else is one line listing
the namespaces there are. ``events --count N`` is a tail: the last N buffered events,
then exit (``--follow``: keep printing new ones).

Each command is two steps kept apart: *collect* asks the daemon and returns plain
JSON-ready dicts (exactly what ``--json`` prints), *render* turns those dicts into
text. ``top`` is the status view redrawn in place on a TTY (alternate screen, cursor
hidden, both restored on exit or Ctrl-C by :class:`LiveScreen`); when stdout is not a
TTY, or with ``--once``, it prints one frame. ``bench`` (:mod:`kvbench`, the harness
beside the benchmark programs) measures the data path against ``--addr``, or against
a daemon it starts itself when no ``--addr`` is given.

Exit codes: 0 ok, 1 the daemon is unreachable or a request failed (one line on
stderr), 2 usage, 130 interrupted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import Any, TextIO

from kvclient.address import ADDR_ENV, resolve_address
from kvclient.errors import InvalidArgumentError, KVStoreError
from kvclient.security import read_token_file
from kvclient.sync_client import KVClient
from kvproto.v1.results import Event, NamespaceStats, TierStats

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


def one_line(text: str) -> str:
    return " ".join(text.split())


# -- collect: daemon -> JSON-ready dicts -----------------------------------------------


def _ratio(hits: int, misses: int) -> float | None:
    return hits / (hits + misses) if hits + misses else None


def tier_dict(tier: TierStats) -> JSONDict:
    return {
        "name": tier.name,
        "capacity_bytes": tier.capacity_bytes,
        "used_bytes": tier.used_bytes,
        "used_fraction": tier.used_fraction,
        "blocks": tier.blocks,
        "hits": tier.hits,
        "misses": tier.misses,
        "hit_rate": _ratio(tier.hits, tier.misses),
        "evictions": tier.evictions,
        "bytes_in": tier.bytes_in,
        "bytes_out": tier.bytes_out,
    }


def namespace_dict(ns: NamespaceStats) -> JSONDict:
    return {
        "ns_id": ns.ns_id,
        "name": ns.name,
        "model": ns.model,
        "block_tokens": ns.block_tokens,
        "block_bytes": ns.block_bytes,
        "blocks": ns.blocks,
        "bytes": ns.bytes,
        "hits": ns.hits,
        "misses": ns.misses,
        "hit_rate": _ratio(ns.hits, ns.misses),
    }


def event_dict(event: Event) -> JSONDict:
    return {
        "seq": event.seq,
        "kind": event.kind,
        "ns_id": event.ns_id,
        "key": event.key.hex(),
        "tier": event.tier or None,
        "timestamp": event.timestamp,
    }


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
        "pending_blocks": stats.pending_blocks,
        "leases": stats.leases,
        "staged_bytes": stats.staged_bytes,
        "demotions": stats.demotions,
        "promotions": stats.promotions,
        "corrupt_reads": stats.corrupt_reads,
        "disk_queue_bytes": stats.disk_queue_bytes,
        "disk_fault": stats.disk_fault,
        "counters": dict(stats.counters),
        "tenant": info.tenant,
        "tenants": [dataclasses.asdict(t) for t in stats.tenants],
        "time": time.time(),
    }


def collect_namespaces(client: KVClient) -> list[JSONDict]:
    return [namespace_dict(ns) for ns in client.stats().namespaces]


def resolve_namespace(client: KVClient, text: str) -> str:
    """What a user typed (an id, a bound name, a model, a unique id prefix) -> an ns_id.

    Raises UsageError naming the candidates when nothing or more than one matches.
    """
    namespaces = client.stats().namespaces
    for matches in (
        [ns for ns in namespaces if text in (ns.ns_id, ns.name)],
        [ns for ns in namespaces if ns.model == text],
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
        f"{ns.ns_id} ({', '.join(filter(None, (ns.name, ns.model)))})" for ns in namespaces
    )
    raise UsageError(f"no namespace {text!r}; there are: {listed} (see kvctl ls)")


def collect_lookup(client: KVClient, ns_id: str, tokens: list[int]) -> JSONDict:
    ns = client.open_namespace(resolve_namespace(client, ns_id))
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
            str(ns["block_tokens"]),
            human_bytes(ns["block_bytes"]),
            str(ns["blocks"]),
            human_bytes(ns["bytes"]),
            percent(ns["hit_rate"]),
        ]
        for ns in shown
    ]
    table = format_table(
        ["NAMESPACE", "NAME", "MODEL", "TOKENS/BLOCK", "BLOCK", "BLOCKS", "BYTES", "HIT RATE"],
        rows,
        left=3,
    )
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
    if data.get("disk_fault"):
        lines.append(f"disk tier NOT TAKING WRITES: {data['disk_fault']} (retrying)")
    if data.get("tenant"):
        lines.append(f"tenant {data['tenant']}: the namespaces above are its own")
    return "\n".join(lines)


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
    return "\n".join(line.rstrip() for line in lines)


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


def render_lookup(data: JSONDict) -> str:
    line = (
        f"{data['ns_id']}: {data['tokens']} of {data['request_tokens']} tokens cached "
        f"({data['blocks']} of {data['request_blocks']} blocks: "
        f"{data['host_blocks']} host, {data['disk_blocks']} disk)"
    )
    if data["pending_blocks"]:
        line += f", {data['pending_blocks']} pending"
    return line


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

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stream.write("\x1b[?25h\x1b[?1049l")
        self.stream.flush()


# -- commands --------------------------------------------------------------------------


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=False))


def cmd_status(client: KVClient, args: argparse.Namespace) -> int:
    data = collect_status(client)
    if args.tenants and data["tenant"]:
        raise KVStoreError(
            f"status --tenants needs the admin token; this token is tenant {data['tenant']}'s"
        )
    if args.json:
        _print_json(data)
    elif args.tenants:
        print(render_tenants(data["tenants"]))
    else:
        print(render_status(data))
    return EXIT_OK


def cmd_top(client: KVClient, args: argparse.Namespace) -> int:
    if args.interval <= 0:
        raise UsageError("--interval must be > 0")
    data = collect_status(client)  # fail with one line before touching the terminal
    if args.once or not sys.stdout.isatty():
        if args.json:
            print(json.dumps(data))
        else:
            print(render_top(data, None, shutil.get_terminal_size().lines))
        return EXIT_OK
    before: JSONDict | None = None
    try:
        with LiveScreen(sys.stdout) as screen:
            frame = render_top(data, None, shutil.get_terminal_size().lines)
            while True:
                screen.draw(frame)
                time.sleep(args.interval)
                try:
                    before, data = data, collect_status(client)
                except KVStoreError as exc:  # keep watching: the daemon may come back
                    frame = f"{one_line(str(exc))}\nretrying every {args.interval:g} s ..."
                    continue
                frame = render_top(data, before, shutil.get_terminal_size().lines)
    except KeyboardInterrupt:
        return EXIT_OK


def cmd_ls(client: KVClient, args: argparse.Namespace) -> int:
    namespaces = collect_namespaces(client)
    if args.json:
        _print_json({"namespaces": namespaces})
    else:
        print(render_namespaces(namespaces))
    return EXIT_OK


def read_tokens(args: argparse.Namespace) -> list[int]:
    """Token ids from argv or from a file (``-``: stdin) of whitespace-separated ints."""
    if args.file is not None and args.tokens:
        raise UsageError("give tokens on the command line or with --file, not both")
    if args.file is not None:
        try:
            if args.file == "-":
                text = sys.stdin.read()
            else:
                with open(args.file) as f:
                    text = f.read()
        except OSError as exc:
            raise UsageError(f"cannot read {args.file}: {exc.strerror}") from None
        words = text.split()
    else:
        words = args.tokens
    if not words:
        raise UsageError("no tokens given")
    try:
        return [int(w) for w in words]
    except ValueError as exc:
        raise UsageError(f"tokens must be integers: {exc}") from None


def cmd_lookup(client: KVClient, args: argparse.Namespace) -> int:
    data = collect_lookup(client, args.ns_id, read_tokens(args))
    if args.json:
        _print_json(data)
    else:
        print(render_lookup(data))
    return EXIT_OK


def cmd_clear(client: KVClient, args: argparse.Namespace) -> int:
    if not args.yes:
        what = f"namespace {args.ns}" if args.ns else "every namespace"
        raise UsageError(f"clear removes every block of {what}; pass --yes to confirm")
    removed = client.clear(resolve_namespace(client, args.ns) if args.ns else None)
    print(f"removed {removed} blocks")
    return EXIT_OK


def _wanted(data: JSONDict, ns_id: str, kinds: Sequence[str]) -> bool:
    return (not ns_id or data["ns_id"] == ns_id) and (not kinds or data["kind"] in kinds)


def _print_event(data: JSONDict, as_json: bool) -> None:
    print(json.dumps(data) if as_json else render_event(data), flush=True)


def tail_events(
    client: KVClient,
    from_seq: int,
    count: int,
    newest: int,
    ns_id: str,
    kinds: Sequence[str],
    timeout: float,
) -> tuple[list[JSONDict], int]:
    """The last ``count`` buffered events after ``from_seq`` up to seq ``newest`` (the
    newest when asked) that pass the filters -> (events, seq of the last one read).

    Filters apply here, not in the daemon: the stream must reach ``newest`` to know the
    buffer was read to its end, and filtered-out events would never arrive."""
    kept: deque[JSONDict] = deque(maxlen=count)
    last = from_seq
    if newest <= from_seq:
        return [], last
    stream = client.events(from_seq, duration_s=timeout)
    try:
        for event in stream:
            last = event.seq
            data = event_dict(event)
            if _wanted(data, ns_id, kinds):
                kept.append(data)
            if event.seq >= newest:
                break
    finally:
        stream.close()
    return list(kept), last


def cmd_events(client: KVClient, args: argparse.Namespace) -> int:
    if args.count is not None and args.count <= 0:
        raise UsageError("--count must be > 0")
    if args.follow and args.count is None:
        raise UsageError("--follow goes with --count (without --count, events are followed)")
    ns_id = resolve_namespace(client, args.ns) if args.ns else ""
    kinds = tuple(args.kind or ())
    from_seq = args.from_seq
    try:
        if args.count is not None:  # a tail: the last N buffered, then exit or follow
            newest = int(client.stats().counters.get("event_seq", 0))
            shown, from_seq = tail_events(
                client, from_seq, args.count, newest, ns_id, kinds, args.timeout
            )
            for data in shown:
                _print_event(data, args.json)
            if not args.follow:
                return EXIT_OK
        stream = client.events(from_seq, ns_id=ns_id, kinds=kinds, duration_s=args.duration)
        try:
            for event in stream:
                _print_event(event_dict(event), args.json)
        finally:
            stream.close()
    except KeyboardInterrupt:
        pass
    return EXIT_OK


# -- entry point -----------------------------------------------------------------------


def token_of(path: str) -> str:
    """--token-file: the token, or a usage error (exit 2) naming the file."""
    try:
        return read_token_file(path, "the token file")
    except InvalidArgumentError as exc:
        raise UsageError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Look at and manage a running kvstored.",
        epilog="--addr and --timeout go before or after the command.",
    )
    _add_connection_arguments(parser, argparse.SUPPRESS)
    parser.set_defaults(addr=None, timeout=10.0, token_file=None)
    common = argparse.ArgumentParser(add_help=False)
    _add_connection_arguments(common, argparse.SUPPRESS)  # after the command: wins
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("status", parents=[common], help="tier occupancy, hit rates, platform")
    p.add_argument(
        "--tenants", action="store_true", help="usage per tenant against its quotas (admin token)"
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(handler=cmd_status)

    p = sub.add_parser("top", parents=[common], help="live status view")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.add_argument("--json", action="store_true", help="print the status snapshot as JSON")
    p.set_defaults(handler=cmd_top)

    p = sub.add_parser("ls", parents=[common], help="namespaces with blocks and bytes")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(handler=cmd_ls)

    p = sub.add_parser("lookup", parents=[common], help="how much of a token sequence is cached")
    p.add_argument(
        "ns_id",
        metavar="NAMESPACE",
        help="what kvctl ls shows: namespace id, bound name, or model (when unique)",
    )
    p.add_argument("tokens", metavar="TOKENS", nargs="*", help="token ids")
    p.add_argument("--file", "-f", help="file of whitespace-separated token ids ('-': stdin)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(handler=cmd_lookup)

    p = sub.add_parser("clear", parents=[common], help="remove every block (of one namespace)")
    p.add_argument("--ns", metavar="NAMESPACE", help="only this namespace (as kvctl ls shows)")
    p.add_argument("--yes", action="store_true", help="confirm")
    p.set_defaults(handler=cmd_clear)

    p = sub.add_parser(
        "events",
        parents=[common],
        help="follow the event stream, or tail it (--count)",
        description="Without --count: every buffered event (after --from), then new ones "
        "as they come. With --count N: the last N buffered events, then exit.",
    )
    p.add_argument(
        "--from",
        dest="from_seq",
        type=int,
        default=0,
        metavar="SEQ",
        help="start after this sequence number (default: every buffered event)",
    )
    p.add_argument("--count", type=int, metavar="N", help="the last N buffered events")
    p.add_argument(
        "--follow", "-f", action="store_true", help="with --count: then keep printing new ones"
    )
    p.add_argument("--duration", type=float, metavar="S", help="stop following after S seconds")
    p.add_argument("--ns", metavar="NAMESPACE", help="only this namespace (as kvctl ls shows)")
    p.add_argument(
        "--kind",
        action="append",
        help="only this kind (repeatable)",
        choices=["stored", "removed", "demoted", "promoted", "pending_dropped", "corrupt"],
    )
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.set_defaults(handler=cmd_events)

    from kvbench.cli import add_arguments as add_bench_arguments  # its options only

    p = sub.add_parser(
        "bench",
        parents=[common],
        help="data-path speed beside memcpy, raw gRPC and Redis",
        description="Measure put/get/lookup against --addr, or against a daemon started "
        "in a temp dir when no --addr is given.",
    )
    add_bench_arguments(p)
    p.set_defaults(handler=None)
    return parser


def _add_connection_arguments(parser: argparse.ArgumentParser, default: Any) -> None:
    parser.add_argument(
        "--addr",
        default=default,
        help=f"daemon address: unix:///path, /path or host:port (default ${ADDR_ENV}, "
        "else the default socket)",
    )
    parser.add_argument(
        "--timeout", type=float, default=default, help="seconds per request (default 10)"
    )
    parser.add_argument(
        "--token-file",
        default=default,
        metavar="FILE",
        help="file holding the token (default $KVSTORE_TOKEN, else $KVSTORE_TOKEN_FILE)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    # Ctrl-C stops any command, even when kvctl was started with SIGINT ignored (a
    # background job of a shell, nohup): Python then raises no KeyboardInterrupt
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2), already printed
        return int(exc.code or 0)
    if args.command == "bench":  # may start its own daemon: no client to make first
        from kvbench.cli import run_bench  # the harness: only for this command

        return run_bench(args, args.addr, [PROG, *(sys.argv[1:] if argv is None else argv)])
    handler: Callable[[KVClient, argparse.Namespace], int] = args.handler
    addr = resolve_address(args.addr)
    try:
        token = token_of(args.token_file) if args.token_file else None
        with KVClient(addr, timeout=args.timeout, use_arena=False, token=token) as client:
            return handler(client, args)
    except UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KVStoreError as exc:
        print(f"{PROG}: {one_line(str(exc))}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `kvctl events | head`: the reader left, not an error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
