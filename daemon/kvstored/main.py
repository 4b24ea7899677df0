"""``kvstored``: the command line of the daemon.

``kvstored`` with no arguments serves on ``unix://$XDG_RUNTIME_DIR/kvstore/kvstored.sock``
with a host arena and a disk tier sized from the machine (see ``config``). Exit codes:
0 after a clean SIGTERM/SIGINT shutdown (or --print-config / --version), 2 for a
configuration that is invalid or that this machine cannot use (a path that cannot be
written, a port or socket in use, an arena larger than its file system: one line
naming the key, found by ``preflight.check`` before anything is allocated, or a
disk_dir another daemon holds), 1 when the daemon fails after that, 3 after a shutdown
that could not persist every block due on disk (the disk tier was failing, or
persist_timeout_s ran out: the log says how many).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence

from kvstored import paths, preflight
from kvstored.config import ConfigError, load_config
from kvstored.logs import setup_logging

log = logging.getLogger("kvstored")

DEFAULT_SOCKET = paths.default_socket_path  # kept callable: the value depends on the env


def _fail(message: str, code: int) -> int:
    print(f"kvstored: error: {message}", file=sys.stderr)
    return code


def _start_failed(log_format: str, message: str, code: int) -> int:
    if log_format == "json":  # keep stderr all JSON lines
        log.error("cannot start: %s", message, extra={"event": "start_failed"})
        return code
    return _fail(message, code)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config, args = load_config(argv)
    except ConfigError as exc:
        return _fail(str(exc), 2)
    except OSError as exc:  # e.g. statvfs of the disk dir for the automatic disk size
        return _fail(f"{exc}", 2)
    if args.print_config:
        sys.stdout.write(config.render())
        return 0
    from kvstored.server import StartupError, daemon_version, serve  # grpc only from here

    if args.version:
        print(f"kvstored {daemon_version()}")
        return 0
    setup_logging(config.log_level, config.log_format)
    try:
        preflight.check(config)
    except ConfigError as exc:
        return _start_failed(config.log_format, str(exc), 2)
    try:
        return asyncio.run(serve(config))
    except StartupError as exc:
        return _start_failed(config.log_format, str(exc), exc.exit_code)
    except KeyboardInterrupt:  # a signal before the handlers were installed
        return 130
    except Exception:
        log.critical("kvstored failed", exc_info=True, extra={"event": "crashed"})
        return 1


if __name__ == "__main__":
    sys.exit(main())
