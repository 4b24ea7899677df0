"""Start-up checks: every path and port the configuration names, before anything is
allocated.

``check(config)`` runs after the configuration is parsed and before the arena is
created, the disk tier opened or a server bound, so that a value this machine cannot
use stops the daemon in well under a second with one line naming the key (exit 2),
instead of a traceback, a gRPC error dump, or a tier that silently switches itself off
after gigabytes were prefaulted. Each check raises :class:`ConfigError`:

- ``listen``: a unix socket's directory can be made (0700), belongs to the daemon's
  user and is not writable by others (else another user could put a server of their
  own in the socket's place), and holds no other daemon's live socket nor a file that
  is not a socket (a stale socket is removed); a TCP port (other than 0) is free.
- tokens and TLS: every token file reads and holds a usable token, no two alike; the
  TLS files read and hold PEM.
- ``metrics_listen``: when set by the operator, the port is free (the built-in default
  may be taken by another daemon; that is one warning at start-up, not an error).
- ``arena_dir`` / ``host_bytes``: the directory exists and is writable, and its file
  system has room for the whole arena (writing past a full tmpfs is a SIGBUS).
- ``disk_dir`` / ``disk_bytes``: the directory can be made and written (a probe file
  catches a read-only file system, also for root); an automatic size too small to be
  a tier is an error, never a silent "disk off"; the automatic size is kept in the
  directory at the first start (see ``config.DISK_SIZE_FILE``).

The checks have no side effects beyond creating the two directories, removing a stale
socket and writing the kept disk size; they are repeated by nothing later, so a race
(a port taken in between) still fails at bind time with the server's own error.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat
import tempfile
from pathlib import Path

from kvproto.v1.tls import read_file
from kvstored import hostinfo, paths
from kvstored.auth import MIN_SECRET_CHARS, Tokens, read_secret
from kvstored.config import DISK_SIZE_FILE, MIN_AUTO_DISK_BYTES, DaemonConfig, keep_disk_bytes
from kvstored.config_values import ConfigError, human_size

log = logging.getLogger("kvstored")


def check(config: DaemonConfig) -> None:
    """Raise ConfigError for the first configured path or port this machine cannot use."""
    check_listen(config)
    check_security(config)
    check_metrics(config)
    check_arena(config)
    check_disk(config)


def _fail(config: DaemonConfig, key: str, message: str) -> ConfigError:
    return ConfigError(key, message, config.sources.get(key, ""))


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc)


def prepare_unix_socket(sock_path: Path) -> str | None:
    """Make the socket's directory (0700) and clear a stale socket; -> a problem or None.

    A socket that still answers belongs to a running daemon: never steal it. A path
    that is not a socket is never removed.
    """
    parent = sock_path.parent
    try:
        if not parent.exists():
            parent.mkdir(mode=0o700, parents=True)
        elif sock_path == paths.default_socket_path() and parent.stat().st_uid == os.getuid():
            parent.chmod(0o700)
    except OSError as exc:
        return f"cannot create the socket directory {parent}: {_reason(exc)}"
    if problem := socket_dir_problem(parent):
        return problem
    if not sock_path.exists() and not sock_path.is_symlink():
        return None
    if not stat.S_ISSOCK(sock_path.lstat().st_mode):
        return f"{sock_path} exists and is not a socket; not removing it"
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(sock_path))
    except OSError as exc:
        if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT):
            return f"cannot probe {sock_path}: {_reason(exc)}"
        log.info("removing stale socket %s", sock_path, extra={"event": "stale_socket"})
        sock_path.unlink(missing_ok=True)
        return None
    finally:
        probe.close()
    return f"another daemon is listening on {sock_path}"


def socket_dir_problem(directory: Path) -> str | None:
    """Whether another user could replace a socket in ``directory``; -> a problem."""
    info = directory.stat()
    if info.st_uid != os.getuid():
        return (
            f"the socket directory {directory} belongs to uid {info.st_uid}, not to this "
            f"daemon's user (uid {os.getuid()}): that user could put a server of their own "
            "in the socket's place; use a directory of your own"
        )
    if info.st_mode & 0o022:
        return (
            f"the socket directory {directory} is writable by other users (mode "
            f"{stat.S_IMODE(info.st_mode):04o}): they could replace the socket; "
            f"chmod go-w {directory}"
        )
    return None


def check_security(config: DaemonConfig) -> None:
    """Token files and TLS files, read as the daemon will read them."""
    try:
        Tokens(config.tenants, config.admin_token_file)
    except ValueError as exc:
        raise _fail(config, "admin_token_file" if "the admin" in str(exc) else "tenants",
                    str(exc)) from None
    for key in ("tls_cert", "tls_key", "tls_client_ca"):
        path = getattr(config, key)
        if not path:
            continue
        try:
            data = read_file(path, "a PEM file")  # a regular file, at most 1 MiB
        except ValueError as exc:
            raise _fail(config, key, str(exc)) from None
        if b"-----BEGIN " not in data:
            raise _fail(config, key, f"{path} holds no PEM block")
    secrets = (
        ("shared_key_file", "the shared tier's key", MIN_SECRET_CHARS),
        ("shared_password_file", "the shared tier's password", 1),
    )
    for key, what, min_chars in secrets:
        path = getattr(config, key)
        if path:
            try:
                read_secret(path, what, min_chars)
            except ValueError as exc:
                raise _fail(config, key, str(exc)) from None


def tcp_port_problem(address: str) -> str | None:
    """Bind ``host:port`` once to see whether it is free; -> a problem or None."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    if int(port) == 0:
        return None
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except OSError as exc:
        return f"cannot resolve {host!r}: {_reason(exc)}"
    family, kind, proto, _, sockaddr = infos[0]
    probe = socket.socket(family, kind, proto)
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(sockaddr)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            return f"{address} is in use by another process"
        return f"cannot listen on {address}: {_reason(exc)}"
    finally:
        probe.close()
    return None


def check_listen(config: DaemonConfig) -> None:
    sock_path = config.socket_path
    problem = (
        prepare_unix_socket(sock_path) if sock_path is not None
        else tcp_port_problem(config.listen)
    )
    if problem:
        raise _fail(config, "listen", problem)


def check_metrics(config: DaemonConfig) -> None:
    if not config.metrics_listen or config.sources["metrics_listen"] == "default":
        return
    if problem := tcp_port_problem(config.metrics_listen):
        raise _fail(config, "metrics_listen", problem)


def _writable_dir_problem(directory: Path, *, create: bool) -> str | None:
    """-> why ``directory`` cannot hold our files, or None (made 0700 when ``create``)."""
    try:
        if create:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        elif not directory.exists():
            return f"{directory} does not exist"
        if not directory.is_dir():
            return f"{directory} is not a directory"
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".kvstored-probe-"):
            pass  # a read-only file system refuses this even for root
    except FileExistsError:
        return f"{directory} is not a directory"
    except OSError as exc:
        action = "create" if create and not directory.is_dir() else "write to"
        return f"cannot {action} {directory}: {_reason(exc)}"
    return None


def check_arena(config: DaemonConfig) -> None:
    if not config.shared_arena:
        return
    arena_dir = Path(config.arena_dir)
    if problem := _writable_dir_problem(arena_dir, create=False):
        raise _fail(config, "arena_dir", problem)
    free = hostinfo.disk_free_bytes(arena_dir)
    if config.host_bytes > free:
        raise _fail(
            config, "host_bytes",
            f"{human_size(config.host_bytes)} does not fit in arena_dir {arena_dir} "
            f"({human_size(free)} free): lower host_bytes or set arena_dir to a larger tmpfs",
        )


def check_disk(config: DaemonConfig) -> None:
    auto = config.sources["disk_bytes"].startswith("default")
    if not config.disk_bytes and (not auto or not config.disk_dir):
        return  # the operator turned the disk tier off
    disk_dir = Path(config.disk_dir)
    if problem := _writable_dir_problem(disk_dir, create=True):
        raise _fail(
            config, "disk_dir", f"{problem} (set disk_dir, or disk_bytes = 0 for no disk tier)"
        )
    if config.sources["disk_bytes"] != "default (auto)":
        return  # configured, or kept from the first start
    if config.disk_bytes < MIN_AUTO_DISK_BYTES:
        raise _fail(
            config, "disk_bytes",
            f"25% of the free space at disk_dir {disk_dir} is only "
            f"{human_size(config.disk_bytes)}: set disk_bytes (0 for no disk tier) or "
            "a disk_dir with room",
        )
    try:
        keep_disk_bytes(str(disk_dir), config.disk_bytes)
    except OSError as exc:
        raise _fail(
            config, "disk_dir", f"cannot write {disk_dir / DISK_SIZE_FILE}: {_reason(exc)}"
        ) from None
