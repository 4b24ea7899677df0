"""kvctl: look at and manage a running kvstored.

    kvctl status [--tenants] [--json]
    kvctl top [--interval S] [--once] [--json]
    kvctl ls [--json]
    kvctl lookup NAMESPACE (TOKENS... | --file F | --text T | --text-file F)
                 [--model NAME_OR_PATH] [--chat] [--json]
    kvctl why NAMESPACE (TOKENS... | --file F | --text T | --text-file F)
              [--model NAME_OR_PATH] [--chat] [--json]
    kvctl clear [--ns NAMESPACE] --yes
    kvctl events [--count N [--follow]] [--from SEQ] [--duration S] [--ns NAMESPACE]
                 [--kind K] [--json]
    kvctl bench [--quick] [--report FILE.md] [--json FILE] ...

``--addr ADDR``, ``--timeout S`` and ``--token-file F`` go before or after the
command; without ``--token-file`` the token is ``$KVSTORE_TOKEN`` or the file
``$KVSTORE_TOKEN_FILE`` (a daemon with tenants: the admin token sees everything, and
``status --tenants`` needs it; TLS from ``$KVSTORE_TLS_CA`` and friends). A NAMESPACE is
what ``kvctl ls`` shows: its id, its bound name, or its model when only one namespace
has that model or served model (a unique prefix of an id works too); anything else is
one line listing the namespaces there are. ``lookup`` and ``why`` take the prompt as
token ids or as text, tokenized with the model's tokenizer (:mod:`kvctl.prompts`).
``events --count N`` is a tail: the last N buffered events, then exit (``--follow``:
keep printing new ones).

Each command is two steps kept apart: *collect* asks the daemon and returns plain
JSON-ready dicts (exactly what ``--json`` prints), *render* turns those dicts into
text, every string in them escaped first (:func:`kvctl.views.shown`: a client chooses
its model id, and a terminal must not take it for commands). ``top`` is the status
view redrawn in place on a TTY (alternate screen, cursor hidden, both restored on exit
or Ctrl-C by :class:`LiveScreen`); when stdout is not a
TTY, or with ``--once``, it prints one frame. ``bench`` (:mod:`kvbench`, the harness
beside the benchmark programs) measures the data path against ``--addr``, or against
a daemon it starts itself when no ``--addr`` is given.

Exit codes: 0 ok, 1 the daemon is unreachable or a request failed (one line on
stderr), 2 usage, 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from kvclient.address import ADDR_ENV, resolve_address
from kvclient.errors import InvalidArgumentError, KVStoreError
from kvclient.security import read_token_file
from kvclient.sync_client import KVClient
from kvctl.prompts import add_arguments as add_prompt_arguments
from kvctl.prompts import prompt_tokens, wants_text
from kvctl.views import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    PROG,
    JSONDict,
    LiveScreen,
    UsageError,
    collect_lookup,
    collect_namespaces,
    collect_status,
    event_dict,
    one_line,
    render_event,
    render_lookup,
    render_namespaces,
    render_status,
    render_tenants,
    render_top,
    resolve_namespace,
    shown,
)
from kvctl.why import collect_why, render_why

Handler = Callable[[KVClient, argparse.Namespace], int]  # a command: exit code


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
        print(render_tenants(shown(data["tenants"])))
    else:
        print(render_status(shown(data)))
    return EXIT_OK


def cmd_top(client: KVClient, args: argparse.Namespace) -> int:
    if args.interval <= 0:
        raise UsageError("--interval must be > 0")
    data = collect_status(client)  # fail with one line before touching the terminal
    if args.once or not sys.stdout.isatty():
        if args.json:
            print(json.dumps(data))
        else:
            print(render_top(shown(data), None, shutil.get_terminal_size().lines))
        return EXIT_OK
    before: JSONDict | None = None
    try:
        with LiveScreen(sys.stdout) as screen:
            frame = render_top(shown(data), None, shutil.get_terminal_size().lines)
            while True:
                screen.draw(frame)
                time.sleep(args.interval)
                try:
                    before, data = data, collect_status(client)
                except KVStoreError as exc:  # keep watching: the daemon may come back
                    frame = f"{one_line(str(exc))}\nretrying every {args.interval:g} s ..."
                    continue
                frame = render_top(shown(data), before, shutil.get_terminal_size().lines)
    except KeyboardInterrupt:
        return EXIT_OK


def cmd_ls(client: KVClient, args: argparse.Namespace) -> int:
    namespaces = collect_namespaces(client)
    if args.json:
        _print_json({"namespaces": namespaces})
    else:
        print(render_namespaces(shown(namespaces)))
    return EXIT_OK


def cmd_lookup(client: KVClient, args: argparse.Namespace) -> int:
    collect, render = (collect_why, render_why) if args.why else (collect_lookup, render_lookup)
    wants_text(args)  # options that do not go together: said before the daemon is asked
    ns = client.open_namespace(resolve_namespace(client, args.ns_id))
    data = collect(ns, prompt_tokens(args, ns.info))
    if args.json:
        _print_json(data)
    else:
        print(render(shown(data)))
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
    print(json.dumps(data) if as_json else render_event(shown(data)), flush=True)


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

    def command(
        name: str, handler: Handler | None, help: str, description: str | None = None
    ) -> argparse.ArgumentParser:
        """A subcommand that takes the connection options and runs ``handler``."""
        p = sub.add_parser(name, parents=[common], help=help, description=description)
        p.set_defaults(handler=handler)
        return p

    p = command("status", cmd_status, "tier occupancy, hit rates, platform")
    p.add_argument(
        "--tenants", action="store_true", help="usage per tenant against its quotas (admin token)"
    )
    p.add_argument("--json", action="store_true", help="print JSON")

    p = command("top", cmd_top, "live status view")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.add_argument("--json", action="store_true", help="print the status snapshot as JSON")

    p = command("ls", cmd_ls, "namespaces with blocks and bytes")
    p.add_argument("--json", action="store_true", help="print JSON")

    for name, why, what in (("lookup", False, "how much of a token sequence is cached"),
                            ("why", True, "why a token sequence is not served whole")):
        p = command(name, cmd_lookup, what)
        p.set_defaults(why=why)
        p.add_argument("ns_id", metavar="NAMESPACE",
                       help="what kvctl ls shows: namespace id, bound name, or model (when unique)")
        add_prompt_arguments(p)
        p.add_argument("--json", action="store_true", help="print JSON")

    p = command("clear", cmd_clear, "remove every block (of one namespace)")
    p.add_argument("--ns", metavar="NAMESPACE", help="only this namespace (as kvctl ls shows)")
    p.add_argument("--yes", action="store_true", help="confirm")

    p = command(
        "events",
        cmd_events,
        "follow the event stream, or tail it (--count)",
        "Without --count: every buffered event (after --from), then new ones "
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

    from kvbench.cli import add_arguments as add_bench_arguments  # its options only

    p = command(
        "bench",
        None,  # main() runs kvbench itself
        "data-path speed beside memcpy, raw gRPC and Redis",
        "Measure put/get/lookup against --addr, or against a daemon started "
        "in a temp dir when no --addr is given.",
    )
    add_bench_arguments(p)
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
    handler: Handler = args.handler
    addr = resolve_address(args.addr)
    try:
        token = token_of(args.token_file) if args.token_file else None
        with KVClient(addr, timeout=args.timeout, use_arena=False, token=token) as client:
            return handler(client, args)
    except UsageError as exc:
        print(f"{PROG}: error: {one_line(str(exc))}", file=sys.stderr)
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
