"""Values of the daemon's configuration keys: one parser per kind of value (a raw
value from TOML, the environment or a flag in, a typed value out, ValueError with the
reason otherwise) and the error that names the key (:mod:`kvstored.config` applies
them, key by key)."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kvstore.store_config import codec_tiers_problem
from kvstored import paths

UNIX_PATH_MAX = 107  # sun_path is 108 bytes including the terminating NUL
METRICS_OFF = "off"

_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the key and its source."""

    def __init__(self, key: str, message: str, source: str = "") -> None:
        self.key = key
        self.source = source
        where = f" (from {source})" if source else ""
        super().__init__(f"{key}: {message}{where}")


# --- value parsers: raw (str from env/flags, or a TOML value) -> typed value ------------


def parse_size(raw: object) -> int:
    """``1073741824``, ``"1GiB"``, ``"1.5 GiB"``, ``"512 MiB"`` -> bytes."""
    if isinstance(raw, bool):
        raise ValueError(f"expected a size, got {raw!r}")
    if isinstance(raw, int):
        value = raw
    else:
        m = _SIZE_RE.match(str(raw))
        unit = m.group(2).lower() if m else ""
        if not m or unit not in _UNITS:
            raise ValueError(
                f"invalid size {raw!r}: use bytes or a number with KiB, MiB, GiB or TiB"
            )
        number = float(m.group(1)) * _UNITS[unit]
        if not math.isfinite(number):  # (past the largest double: int() would raise)
            raise ValueError(f"invalid size {raw[:24] if isinstance(raw, str) else raw!r}...: "
                             "too large")
        if number != int(number):
            raise ValueError(f"invalid size {raw!r}: not a whole number of bytes")
        value = int(number)
    if value < 0:
        raise ValueError(f"size must be >= 0, got {raw!r}")
    return value


def format_size(n: int) -> str:
    """Bytes -> the largest binary unit that divides them exactly (``64 MiB``)."""
    for unit, mult in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= mult and n % mult == 0:
            return f"{n // mult} {unit}"
    return f"{n} B"


def human_size(n: int) -> str:
    """Bytes -> ``12.3 GiB`` (rounded, for log lines)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def parse_int(raw: object) -> int:
    if isinstance(raw, bool):
        raise ValueError(f"expected an integer, got {raw!r}")
    if isinstance(raw, int):
        return raw
    try:
        return int(str(raw).strip())
    except ValueError:
        raise ValueError(f"expected an integer, got {raw!r}") from None


def parse_float(raw: object) -> float:
    if isinstance(raw, bool):
        raise ValueError(f"expected a number, got {raw!r}")
    try:
        value = float(raw) if isinstance(raw, int | float) else float(str(raw).strip())
    except ValueError:
        raise ValueError(f"expected a number, got {raw!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {raw!r}")
    return value


def parse_bool(raw: object) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {raw!r}")


def parse_path(raw: object) -> str:
    """A filesystem path (``~`` expanded, made absolute); empty means "not set"."""
    if not isinstance(raw, str):
        raise ValueError(f"expected a path string, got {raw!r}")
    if not raw.strip():
        return ""
    return str(Path(raw.strip()).expanduser().absolute())


def parse_address(raw: object) -> str:
    """``unix:///abs/path`` (also ``unix:/abs/path``) or ``host:port`` for TCP."""
    if not isinstance(raw, str) or not raw.strip():
        raise ValueError(f"expected unix:///path or host:port, got {raw!r}")
    text = raw.strip()
    sock = paths.socket_path_of(text)
    if sock is not None:
        if not sock.is_absolute():
            raise ValueError(f"unix socket path must be absolute, got {raw!r}")
        if len(os.fsencode(str(sock))) > UNIX_PATH_MAX:
            raise ValueError(
                f"unix socket path is {len(os.fsencode(str(sock)))} bytes, "
                f"longer than the {UNIX_PATH_MAX}-byte limit: {str(sock)!r}"
            )
        return paths.UNIX_PREFIX + str(sock)
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"expected unix:///path or host:port, got {raw!r}")
    return text


def parse_metrics_listen(raw: object) -> str:
    """``host:port`` of the metrics HTTP endpoint (port 0 picks a free one); ``off``/"" -> ""."""
    if not isinstance(raw, str):
        raise ValueError(f"expected host:port or off, got {raw!r}")
    text = raw.strip()
    if text.lower() in ("", METRICS_OFF):
        return ""
    host, sep, port = text.rpartition(":")
    if not sep or not host or "/" in host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"expected host:port or off, got {raw!r}")
    return text


def parse_zmq_endpoint(raw: object) -> str:
    """``tcp://host:port`` (``*`` for every address; port 0 picks a free one) or
    ``ipc:///path`` of a ZMQ socket the daemon binds; "" or ``off`` -> "" (none)."""
    if not isinstance(raw, str):
        raise ValueError(f"expected tcp://host:port, ipc:///path or off, got {raw!r}")
    text = raw.strip()
    if text.lower() in ("", "off"):
        return ""
    if text.startswith("ipc:///") and len(text) > len("ipc:///"):
        return text
    host, sep, port = text.removeprefix("tcp://").rpartition(":")
    if (
        not text.startswith("tcp://")
        or not sep
        or not host
        or "/" in host
        or not port.isdigit()
        or not 0 <= int(port) < 65536
    ):
        raise ValueError(f"expected tcp://host:port, ipc:///path or off, got {raw!r}")
    return text


def parse_shared_url(raw: object) -> str:
    """``redis://[user@]host:port`` or ``rediss://...`` of one cluster node; "" -> off.
    A password belongs in shared_password_file: a URL shows up in logs and status."""
    if not isinstance(raw, str):
        raise ValueError(f"expected redis://host:port or rediss://host:port, got {raw!r}")
    text = raw.strip()
    if not text:
        return ""
    parts = urlsplit(text)
    if parts.scheme not in ("redis", "rediss") or not parts.hostname:
        raise ValueError(f"expected redis://host:port or rediss://host:port, got {raw!r}")
    if parts.password:
        raise ValueError("put the password in shared_password_file, not in the URL")
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError as exc:
        raise ValueError(f"bad port in {raw!r}: {exc}") from None
    return text


# Every number has an upper bound in its row: a value past it is a typo or an attack
# on the daemon's arithmetic (a 400-digit size, a wait of 1e300 s), never a setting.
MAX_BYTES = 1 << 50  # 1 PiB: no tier, queue or window of one node is larger
MAX_WAIT_S = 3600.0  # the longest a call or a shutdown step may be told to wait
MAX_LEASE_S = 86400.0  # a lease of a day


def _number(v: float) -> str:
    """A value for an error line: a number of hundreds of digits shortened."""
    text = str(v)
    return text if len(text) <= 24 else f"{text[:12]}... ({len(text)} digits)"


def _between(low: float, high: float) -> Callable[[Any], str | None]:
    return lambda v: None if low <= v <= high else f"must be in [{low}, {high}], got {_number(v)}"


def _size_between(low: int, high: int) -> Callable[[Any], str | None]:
    span = f"[{format_size(low) if low else 0}, {format_size(high)}]"
    return lambda v: None if low <= v <= high else f"must be in {span}, got {_number(v)} bytes"


def _positive_up_to(high: float) -> Callable[[Any], str | None]:
    return lambda v: None if 0 < v <= high else f"must be in (0, {high}], got {_number(v)}"


SOCKET_MODES = ("0600", "0660", "0666")


def _choice(options: Sequence[str]) -> Callable[[object], str]:
    def parse(raw: object) -> str:
        text = str(raw).strip().lower()
        if text not in options:
            raise ValueError(f"must be one of {', '.join(options)}; got {raw!r}")
        return text

    return parse


def parse_codec_tiers(raw: object) -> str:
    """Some of ``host,disk,shared`` (``""``: no tier codes): the tiers where a namespace
    with a codec keeps its blocks encoded (kvstore.codecs); host needs the other two."""
    names = list(dict.fromkeys(p.strip().lower() for p in str(raw).split(",") if p.strip()))
    problem = codec_tiers_problem(names)
    if problem:
        raise ValueError(f"{problem}; got {raw!r}")
    return ",".join(names)
