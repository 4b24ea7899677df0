"""Daemon configuration: one table of keys, four layers, one error per bad value.

Every key in :data:`KEYS` is at once a TOML key (file given by ``--config`` or
``KVSTORED_CONFIG``), an environment variable ``KVSTORED_<KEY>`` and a flag
``--<key>`` (dashes or underscores). Layers apply in this order, later wins::

    embedded defaults < TOML file < environment < command-line flags

Defaults are chosen so that ``kvstored`` runs with no arguments and stays a modest
sidecar: a unix socket in the user's runtime dir, a host arena of 25% of the memory
(64 MiB .. 4 GiB) in ``/dev/shm``, an LMDB disk tier under the user's data dir of
min(25% of free disk, 64 GiB). The automatic disk size is computed once, at the first
start on a directory, and kept in that directory (``DISK_SIZE_FILE``), so the tier's
capacity does not move with the free space from one start to the next. On a file system
too full for one, the size is 25% of the file system's, for that start only: the tier
waits for room (kvstore.disk.tier) instead of the start failing.

Values are parsed and checked here, before anything is started: a bad value raises
:class:`ConfigError` naming the key and where the value came from, which ``main``
prints as one line and turns into exit code 2. Sizes are plain bytes or a number with
a binary unit (``KiB``, ``MiB``, ``GiB``, ``TiB``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, NoReturn

from kvproto.v1.addresses import is_loopback
from kvproto.v1.tls import MAX_SETTINGS_FILE_BYTES, read_file
from kvstore.host.arena import common_bytes
from kvstore.policy import OVERFLOW_POLICIES
from kvstore.shared.format import mac_key
from kvstore.shared.tier import SharedConfig
from kvstore.store import ADMISSION_POLICIES, DEFAULT_PRIORITY, StoreConfig
from kvstored import auto_sizes, paths
from kvstored.auth import TenantConfig, parse_tenants, read_secret
from kvstored.auto_sizes import DISK_SIZE_FILE, _auto_disk, _auto_disk_bytes, _auto_host_bytes
from kvstored.config_values import (
    MAX_BYTES,
    MAX_LEASE_S,
    MAX_WAIT_S,
    SOCKET_MODES,
    ConfigError,
    _between,
    _choice,
    _positive_up_to,
    _size_between,
    format_size,
    human_size,
    parse_address,
    parse_bool,
    parse_codec_tiers,
    parse_float,
    parse_int,
    parse_metrics_listen,
    parse_path,
    parse_shared_url,
    parse_size,
    parse_zmq_endpoint,
)
from kvstored.kv_events import ENCODINGS as EVENT_ENCODINGS
from kvstored.kv_events import HASH_FORMS as EVENT_HASH_FORMS
from kvstored.kv_events import EventSettings

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ENV_PREFIX = "KVSTORED_"
CONFIG_ENV = ENV_PREFIX + "CONFIG"
MAX_CHUNK_BYTES = 4 << 20  # largest Put data chunk; max_message_bytes must exceed it
# Get chunks stay under gRPC's default 4 MiB receive limit with room for framing, so a
# client with default channel options can read them.
GET_CHUNK_BYTES = (4 << 20) - (64 << 10)
MESSAGE_OVERHEAD = 64 << 10  # room for headers beside a full chunk
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")
METRICS_NAMESPACES = ("auto", "on", "off")
TENANTS_TABLE = "tenants"  # [tenants.<name>] tables: TOML only (see kvstored.auth)

# --- the table -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Key:
    """One configuration key: its TOML name, parser, default and help.

    ``default`` is a value, or a function of the values resolved so far (for defaults
    that depend on the machine or on another key, e.g. disk_bytes on disk_dir).
    """

    name: str
    type: str  # shown in --help and in the docs table
    parse: Callable[[object], Any]
    default: object
    help: str
    check: Callable[[Any], str | None] | None = None  # -> error message or None

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


# what other modules take from here (kvstored.auto_sizes holds them)
AUTO_HOST_MAX, MIN_AUTO_DISK_BYTES = auto_sizes.AUTO_HOST_MAX, auto_sizes.MIN_AUTO_DISK_BYTES
FULL_DISK_SOURCE = auto_sizes.FULL_DISK_SOURCE
keep_disk_bytes, kept_disk_bytes = auto_sizes.keep_disk_bytes, auto_sizes.kept_disk_bytes
MIN_COMMON_REGION_BYTES = 1 << 20  # what tenants' own arena regions leave for the rest


KEYS: tuple[Key, ...] = (
    Key("listen", "address", parse_address, lambda _: paths.default_address(),
        "unix:///path or host:port (TCP only when given; port 0 picks a free one); "
        "default $XDG_RUNTIME_DIR/kvstore/kvstored.sock"),
    Key("host_bytes", "size", parse_size, _auto_host_bytes,
        "host arena size; default 25% of the memory, 64 MiB .. 4 GiB (at most half of "
        "MemAvailable)",
        _size_between(1 << 20, MAX_BYTES)),
    Key("disk_dir", "path", parse_path, lambda _: str(paths.default_data_dir()),
        "LMDB directory of the disk tier; default $XDG_DATA_HOME/kvstore"),
    Key("disk_bytes", "size", parse_size, _auto_disk_bytes,
        "disk tier capacity, 0 disables it; default min(25% of free disk, 64 GiB), "
        f"chosen at the first start and kept in disk_dir/{DISK_SIZE_FILE} (a full file "
        "system: 25% of its size, not kept; the tier waits for room)",
        _size_between(0, MAX_BYTES)),
    Key("admission", "choice", _choice(ADMISSION_POLICIES), "write-back",
        "disk admission: " + " | ".join(ADMISSION_POLICIES)),
    Key("selective_hits", "int", parse_int, 2,
        "selective admission: hits before a block goes to disk", _between(1, 1_000_000)),
    Key("disk_min_priority", "int", parse_int, 0,
        "blocks below this priority are dropped, not demoted", _between(0, 100)),
    Key("default_priority", "int", parse_int, DEFAULT_PRIORITY,
        "priority (0..100) of blocks put without one", _between(0, 100)),
    Key("lease_ttl_s", "float", parse_float, 30.0, "default lease duration (seconds)",
        _positive_up_to(MAX_LEASE_S)),
    Key("max_lease_ttl_s", "float", parse_float, 600.0,
        "longest lease a client may ask for (seconds)", _positive_up_to(MAX_LEASE_S)),
    Key("max_blocks_per_request", "int", parse_int, 8192, "most blocks one request may name",
        _between(1, 1 << 20)),
    Key("max_staged_bytes", "size", parse_size, 0,
        "host arena bytes one writer may hold set aside (staged) for its next puts; "
        "0: a quarter of host_bytes", _size_between(0, MAX_BYTES)),
    Key("disk_queue_bytes", "size", parse_size, 256 << 20,
        "block bytes waiting for the disk writer, at most; when full, puts that need "
        "room wait for it (put_wait_ms, overflow); with write-back also the most a "
        "crash loses beyond the host tier", _size_between(1 << 20, MAX_BYTES)),
    Key("window_bytes", "size", parse_size, 64 << 20,
        "a prefix longer than the host tier passes through it in windows of at most "
        "this many bytes (and a quarter of the host tier): puts go to disk window by "
        "window, so a prefix of any length is stored whole", _size_between(1 << 20, MAX_BYTES)),
    Key("put_wait_ms", "int", parse_int, 5000,
        "a put whose room only the disk writer can make (every block it could evict is "
        "due on disk and disk_queue_bytes is full) waits this long for it, then "
        "overflow decides; 0: decide at once", _between(0, int(MAX_WAIT_S * 1000))),
    Key("overflow", "choice", _choice(OVERFLOW_POLICIES), "wait",
        "past put_wait_ms: wait (refuse the put's blocks that do not fit: nothing it "
        "was told is stored is lost) | drop (evict blocks due on disk unwritten)"),
    Key("write_through_wait_s", "float", parse_float, 30.0,
        "write-through: how long a commit waits for its disk commit before answering "
        "(the blocks it did not see committed are not counted durable)",
        _between(0, MAX_WAIT_S)),
    Key("max_message_bytes", "size", parse_size, 64 << 20,
        "largest gRPC message received or sent; bigger ones get RESOURCE_EXHAUSTED",
        _between(MAX_CHUNK_BYTES + MESSAGE_OVERHEAD, (1 << 31) - 1)),
    Key("max_transfer_bytes", "size", parse_size, 1 << 30,
        "most block bytes one Put or Get moves (bounds daemon memory per call)",
        _size_between(1 << 20, MAX_BYTES)),
    Key("get_buffer_bytes", "size", parse_size, 256 << 20,
        "block bytes Get streams hold copied out of the store at once, all callers "
        "together; each tenant (and the admin) at most its share (this / (tenants + 1)). "
        "A get the host tier cannot pin whole copies one window per call (at most "
        "window_bytes and an eighth of the share; the client calls again), counted "
        "twice (the copy, and its messages queued in gRPC) until the call is done; "
        "past the share it waits put_wait_ms for bytes to be freed, then "
        "RESOURCE_EXHAUSTED",
        _size_between(1 << 20, MAX_BYTES)),
    Key("arena_dir", "path", parse_path, "/dev/shm",
        "directory of the shared arena file (a tmpfs: its pages are the host tier)"),
    Key("shared_arena", "bool", parse_bool, True,
        "false: anonymous arena memory (no zero-copy clients)"),
    Key("prefault_arena", "bool", parse_bool, True,
        "fault the arena's pages in on a background thread after start-up, so first "
        "puts run at copy speed (commits the memory up front); false: on first use"),
    Key("persist_on_close", "bool", parse_bool, True,
        "on shutdown, write host-only blocks to disk"),
    Key("sync_index_bytes", "size", parse_size, 512 << 20,
        "a disk tier whose data file is at most this size is indexed before the daemon "
        "answers (with KV blocks of 64 KiB or more, a few thousand records); a larger "
        "one loads behind the first answers (hits for what is loaded); 0: always behind",
        _size_between(0, MAX_BYTES)),
    Key("persist_timeout_s", "float", parse_float, 90.0,
        "on shutdown, how long writing the host tier to disk may wait for the disk "
        "writer; blocks due on disk left unwritten then make the exit code 3",
        _between(0, MAX_WAIT_S)),
    Key("event_buffer", "int", parse_int, 65536,
        "events kept for WatchEvents (for the admin; as many again per tenant)",
        _between(16, 1 << 22)),
    Key("index_tokens_bytes", "size", parse_size, 64 << 20,
        "token ids the index keeps for blocks in the host tier (4 bytes a token: what "
        "KV events and disk records carry), at most; past it a block keeps none, and "
        "its events carry no token_ids (counted: tokens_not_kept)",
        _size_between(0, MAX_BYTES)),
    Key("tenant_max_namespaces", "int", parse_int, 1024,
        "most namespaces, and most namespace names, one tenant may open and bind "
        "(RESOURCE_EXHAUSTED past it); 0: no limit", _between(0, 1 << 20)),
    Key("workers", "int", parse_int, 8, "threads that run store calls (copies, disk reads)",
        _between(1, 256)),
    Key("grace_s", "float", parse_float, 10.0,
        "on SIGTERM, how long in-flight calls may finish",
        _between(0, MAX_WAIT_S)),
    Key("local_calls", "bool", parse_bool, True,
        "serve short calls to same-host clients on a plain unix socket beside the gRPC "
        "one (a round trip ~10x cheaper); false: gRPC only"),
    Key("max_connections_per_user", "int", parse_int, 1024,
        "most connections one user (uid) holds at once on each of the local-call and "
        "arena hand-out sockets; past it a new one is closed at once (one line in the "
        "log, rate-limited)", _between(1, 1 << 20)),
    Key("socket_mode", "choice", _choice(SOCKET_MODES), "0600",
        "file mode of the daemon's unix sockets: 0600 (its own user only); 0660 (its "
        "group too) or 0666 (every user) let tenants that run as other users connect, "
        "and need tokens: each tenant with a host quota then maps only its own arena "
        "region, handed over as a file descriptor"),
    Key("log_level", "choice", _choice(LOG_LEVELS), "info", " | ".join(LOG_LEVELS)),
    Key("log_format", "choice", _choice(LOG_FORMATS), "text",
        "text: one readable line per event; json: one JSON object per line"),
    Key("metrics_listen", "address", parse_metrics_listen, "127.0.0.1:9464",
        "host:port of the Prometheus /metrics endpoint (port 0 picks a free one); "
        "off or empty disables it"),
    Key("metrics_namespaces", "choice", _choice(METRICS_NAMESPACES), "auto",
        "series per namespace (labelled with its id and model) on /metrics: on | off | "
        "auto (on unless the daemon has tenants: such labels name what a tenant runs)"),
    Key("admin_token_file", "path", parse_path, "",
        "file holding the admin token (sees every tenant's namespaces; kvctl uses it); "
        "with it or with [tenants.*], every call needs a token"),
    Key("tls_cert", "path", parse_path, "",
        "PEM server certificate (chain) for a TCP listen; needs tls_key"),
    Key("tls_key", "path", parse_path, "", "PEM private key of tls_cert"),
    Key("tls_client_ca", "path", parse_path, "",
        "PEM CA bundle: clients must present a certificate it signed (mutual TLS)"),
    Key("insecure", "bool", parse_bool, False,
        "allow a TCP listen on a non-loopback address without TLS and tokens"),
    Key("shared_url", "url", parse_shared_url, "",
        "shared tier: redis://[user@]host:port (rediss:// for TLS) of any node of a "
        "Valkey / Redis Cluster, which every node's daemon reads and writes; empty: off"),
    Key("shared_password_file", "path", parse_path, "",
        "file holding the shared tier's password (ACL user in shared_url)"),
    Key("shared_key_file", "path", parse_path, "",
        "file holding the secret every node's values carry a keyed MAC with (the same "
        "on every node; mode 0600); empty: an unkeyed checksum, which anyone who may "
        "write the cluster can forge"),
    Key("shared_timeout_ms", "int", parse_int, 100,
        "shared tier: a read waits at most this long; what has not come is a miss",
        _between(1, 60_000)),
    Key("shared_ttl_s", "int", parse_int, 0,
        "shared tier: values expire after this long; 0: never (the cluster's "
        "maxmemory-policy evicts)", _between(0, 366 * 86400)),
    Key("shared_min_priority", "int", parse_int, 0,
        "shared tier: blocks below this priority are not written to the cluster",
        _between(0, 100)),
    Key("shared_queue_bytes", "size", parse_size, 256 << 20,
        "shared tier: block bytes stored and not yet sent to the cluster, at most",
        _size_between(1 << 20, MAX_BYTES)),
    Key("shared_overflow", "choice", _choice(OVERFLOW_POLICIES), "drop",
        "shared tier, past shared_queue_bytes: drop (new blocks are not sent, counted) "
        "| wait (puts wait for the writer, up to put_wait_ms, as for the disk's)"),
    Key("codec_tiers", "list", parse_codec_tiers, "disk,shared",
        "tiers where a namespace opened with a codec (fp8, int8, int4) keeps its blocks "
        "encoded: host, disk, shared (comma-separated; host needs the other two); "
        "empty: none"),
    Key("kv_events_listen", "address", parse_zmq_endpoint, "",
        "KV events for routers, in vLLM's format: the ZMQ PUB address "
        "(tcp://127.0.0.1:5557, ipc:///path); empty: off"),
    Key("kv_events_replay_listen", "address", parse_zmq_endpoint, "",
        "KV events: the ZMQ ROUTER address that replays kept batches from a "
        "sequence number; empty: no replay"),
    Key("kv_events_encoding", "choice", _choice(EVENT_ENCODINGS), "map",
        "KV events: map (vLLM's current encoding) | array (the older one)"),
    Key("kv_events_hashes", "choice", _choice(EVENT_HASH_FORMS), "bytes",
        "KV events: block hashes as bytes (kvstore's chain keys) | int (their low 64 "
        "bits, as vLLM's VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)"),
    Key("kv_events_buffer_bytes", "size", parse_size, 64 << 20,
        "KV events: the tier changes waiting for the publisher, at most this many bytes "
        "(token ids included); as much again of batches kept for replay (past it the "
        "oldest go), and of batches queued for each subscriber that reads slowly (ZMQ "
        "then drops its new ones)",
        _size_between(1 << 20, MAX_BYTES)),
)
KEYS_BY_NAME: dict[str, Key] = {k.name: k for k in KEYS}


@dataclass(frozen=True, slots=True)
class DaemonConfig:
    """The effective configuration; ``sources[key]`` says where each value came from."""

    listen: str
    host_bytes: int
    disk_dir: str
    disk_bytes: int
    admission: str
    selective_hits: int
    disk_min_priority: int
    default_priority: int
    lease_ttl_s: float
    max_lease_ttl_s: float
    max_blocks_per_request: int
    max_staged_bytes: int
    disk_queue_bytes: int
    window_bytes: int
    put_wait_ms: int
    overflow: str
    write_through_wait_s: float
    max_message_bytes: int
    max_transfer_bytes: int
    get_buffer_bytes: int
    arena_dir: str
    shared_arena: bool
    prefault_arena: bool
    persist_on_close: bool
    sync_index_bytes: int
    persist_timeout_s: float
    event_buffer: int
    index_tokens_bytes: int
    tenant_max_namespaces: int
    workers: int
    grace_s: float
    local_calls: bool
    max_connections_per_user: int
    socket_mode: str
    log_level: str
    log_format: str
    metrics_listen: str
    metrics_namespaces: str
    admin_token_file: str
    tls_cert: str
    tls_key: str
    tls_client_ca: str
    insecure: bool
    shared_url: str
    shared_password_file: str
    shared_key_file: str
    shared_timeout_ms: int
    shared_ttl_s: int
    shared_min_priority: int
    shared_queue_bytes: int
    shared_overflow: str
    codec_tiers: str
    kv_events_listen: str
    kv_events_replay_listen: str
    kv_events_encoding: str
    kv_events_hashes: str
    kv_events_buffer_bytes: int
    sources: Mapping[str, str]
    config_file: str = ""
    tenants: tuple[TenantConfig, ...] = ()  # the config file's [tenants.<name>] tables

    @property
    def socket_path(self) -> Path | None:
        return paths.socket_path_of(self.listen)

    def store_config(self) -> StoreConfig:
        return StoreConfig(
            host_bytes=self.host_bytes,
            disk_dir=self.disk_dir if self.disk_bytes else None,
            disk_bytes=self.disk_bytes,
            admission=self.admission,
            selective_hits=self.selective_hits,
            disk_min_priority=self.disk_min_priority,
            default_priority=self.default_priority,
            lease_ttl_s=self.lease_ttl_s,
            max_lease_ttl_s=self.max_lease_ttl_s,
            max_blocks_per_request=self.max_blocks_per_request,
            max_staged_bytes=self.max_staged_bytes,
            disk_queue_bytes=self.disk_queue_bytes,
            window_bytes=self.window_bytes,
            put_wait_ms=self.put_wait_ms,
            overflow=self.overflow,
            write_through_wait_s=self.write_through_wait_s,
            check_disk_in_child=True,  # a damaged file costs its blocks, never the start
            arena_dir=self.arena_dir or None,
            shared_arena=self.shared_arena,
            prefault_arena=self.prefault_arena,
            persist_on_close=self.persist_on_close,
            persist_timeout_s=self.persist_timeout_s,
            sync_index_bytes=self.sync_index_bytes,
            event_buffer=self.event_buffer,
            index_tokens_bytes=self.index_tokens_bytes,
            tenant_max_namespaces=self.tenant_max_namespaces,
            quotas={t.name: t.quota for t in self.tenants},
            shared=self.shared_config(),
            codec_tiers=tuple(filter(None, self.codec_tiers.split(","))),
        )

    def shared_config(self) -> SharedConfig | None:
        if not self.shared_url:
            return None
        password = ""
        if self.shared_password_file:
            password = read_secret(self.shared_password_file, "the shared tier's password", 1)
        key = b""
        if self.shared_key_file:
            key = mac_key(read_secret(self.shared_key_file, "the shared tier's key"))
        return SharedConfig(
            url=self.shared_url,
            timeout_ms=self.shared_timeout_ms,
            ttl_s=self.shared_ttl_s,
            min_priority=self.shared_min_priority,
            password=password,
            mac_key=key,
            queue_bytes=self.shared_queue_bytes,
            overflow=self.shared_overflow,
        )

    @property
    def needs_tokens(self) -> bool:
        """Whether every call must carry a token (tenants or an admin token)."""
        return bool(self.tenants or self.admin_token_file)

    def event_settings(self) -> EventSettings | None:
        """The KV event publisher's settings (kvstored.kv_events); None when off."""
        if not self.kv_events_listen:
            return None
        return EventSettings(
            self.kv_events_listen,
            self.kv_events_replay_listen,
            self.kv_events_encoding,
            self.kv_events_hashes,
            buffer_bytes=self.kv_events_buffer_bytes,
            feed_bytes=self.kv_events_buffer_bytes,
            tenant_topics={t.name: t.events_topic for t in self.tenants if t.events_topic},
        )

    @property
    def namespace_metrics(self) -> bool:
        if self.metrics_namespaces == "auto":
            return not self.tenants
        return self.metrics_namespaces == "on"
    def render(self) -> str:
        """The effective config as TOML (loadable with --config), each line with its source."""
        lines = ["# kvstored effective configuration (precedence: default < file < env < flag)"]
        for key in KEYS:
            value = getattr(self, key.name)
            if isinstance(value, bool):
                text = "true" if value else "false"
            elif isinstance(value, int | float):
                text = repr(value)
            else:
                text = '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'
            note = f"  ({format_size(value)})" if key.type == "size" else ""
            lines.append(f"{key.name} = {text}  # {self.sources[key.name]}{note}")
        for tenant in self.tenants:
            lines += [
                "",
                f"[{TENANTS_TABLE}.{tenant.name}]  # file {self.config_file}",
                f'token_file = "{tenant.token_file}"',
                f"host_bytes = {tenant.quota.host_bytes}",
                f"disk_bytes = {tenant.quota.disk_bytes}",
            ]
            if tenant.events_topic:
                lines.append(f'events_topic = "{tenant.events_topic}"')
        return "\n".join(lines) + "\n"


assert [f.name for f in fields(DaemonConfig)][: len(KEYS)] == [k.name for k in KEYS]


# --- layers ----------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing usage, so errors stay one line."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError("arguments", message)


def build_arg_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kvstored",
        description="Tiered KV-cache offload daemon (gRPC service kvstore.v1.KVStore).",
        epilog=f"Every setting is also a TOML key (--config) and an env var {ENV_PREFIX}<KEY>; "
        "precedence: default < file < env < flag. Sizes: bytes or KiB/MiB/GiB/TiB.",
    )
    parser.add_argument("--config", metavar="FILE", help=f"TOML config file (env {CONFIG_ENV})")
    parser.add_argument(
        "--print-config", action="store_true", help="print the effective config and its sources"
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    for key in KEYS:
        names = [key.flag] + ([f"--{key.name}"] if "_" in key.name else [])
        bare = {"nargs": "?", "const": "true"} if key.type == "bool" else {}  # --insecure
        parser.add_argument(
            *names,
            dest=key.name,
            metavar=key.type.upper(),
            default=None,
            help=key.help.replace("%", "%%"),  # argparse formats help with %
            **bare,  # type: ignore[arg-type]
        )
    return parser


def _read_toml(path: str) -> dict[str, Any]:
    """The config file's table; ConfigError in one line when it cannot be read (at
    most MAX_SETTINGS_FILE_BYTES, from a file or a pipe), is not UTF-8, is not TOML
    (an integer of thousands of digits included) or nests deeper than the parser's
    recursion can follow."""
    try:
        raw = read_file(path, "the config file", MAX_SETTINGS_FILE_BYTES, regular=False)
    except ValueError as exc:
        raise ConfigError("config", str(exc)) from None
    try:
        data = tomllib.loads(raw.decode())
    except UnicodeDecodeError as exc:
        raise ConfigError("config", f"{path} is not UTF-8 text (byte {exc.start})") from None
    except RecursionError:
        raise ConfigError("config", f"{path} is nested too deeply to be read") from None
    except ValueError as exc:  # TOMLDecodeError, or an integer too long to convert
        raise ConfigError("config", f"{path} is not valid TOML: {exc}") from None
    for name in data:
        if name not in KEYS_BY_NAME and name != TENANTS_TABLE:
            raise ConfigError(name, "unknown setting", f"file {path}")
    return data


def load_config(
    argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> tuple[DaemonConfig, argparse.Namespace]:
    """Resolve every key through the four layers; raises ConfigError on any bad value."""
    env = os.environ if env is None else env
    args = build_arg_parser().parse_args(list(sys.argv[1:] if argv is None else argv))

    layers: list[tuple[str, Callable[[Key], object]]] = []
    config_file = args.config or env.get(CONFIG_ENV, "")
    tenants: tuple[TenantConfig, ...] = ()
    if config_file:
        data = _read_toml(config_file)
        layers.append((f"file {config_file}", lambda k: data.get(k.name)))
        if TENANTS_TABLE in data:
            try:
                tenants = parse_tenants(data[TENANTS_TABLE], parse_size, f"file {config_file}")
            except ValueError as exc:
                raise ConfigError(TENANTS_TABLE, str(exc)) from None
    for name in env:
        if (
            name.startswith(ENV_PREFIX)
            and name != CONFIG_ENV
            and name[len(ENV_PREFIX) :].lower() not in KEYS_BY_NAME
        ):
            raise ConfigError(name, "unknown setting", "env")
    layers.append(("env {}", lambda k: env.get(k.env)))
    layers.append(("flag {}", lambda k: getattr(args, k.name)))

    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for key in KEYS:  # table order: a computed default sees the keys above it
        raw: object = None
        value: Any = None
        source = "default"
        for label, get in layers:
            found = get(key)
            if found is not None:
                raw = found
                source = label.format(key.env if label.startswith("env") else key.flag)
        if raw is None and key.name == "disk_bytes":
            value, source = _auto_disk(values["disk_dir"])
        elif raw is None:
            value = key.default(values) if callable(key.default) else key.default
            if callable(key.default):
                source = "default (auto)"
        else:
            try:
                value = key.parse(raw)
            except ValueError as exc:
                raise ConfigError(key.name, str(exc), source) from None
        if key.check is not None and (problem := key.check(value)):
            raise ConfigError(key.name, problem, source)
        values[key.name] = value
        sources[key.name] = source

    if values["lease_ttl_s"] > values["max_lease_ttl_s"]:
        raise ConfigError(
            "lease_ttl_s",
            f"{values['lease_ttl_s']} exceeds max_lease_ttl_s={values['max_lease_ttl_s']}",
            sources["lease_ttl_s"],
        )
    if values["disk_bytes"] and not values["disk_dir"]:
        raise ConfigError("disk_dir", "is empty but disk_bytes > 0", sources["disk_dir"])
    for name in ("shared_password_file", "shared_key_file"):
        if values[name] and not values["shared_url"]:
            raise ConfigError(name, "is set but shared_url is not", sources[name])
    for tenant in tenants:  # quotas: bounded, and a disk quota within the disk tier
        quota, file = tenant.quota, f"file {config_file}"
        for name, size in (("host_bytes", quota.host_bytes), ("disk_bytes", quota.disk_bytes)):
            if problem := _size_between(0, MAX_BYTES)(size):
                raise ConfigError(TENANTS_TABLE, f"tenants.{tenant.name}: {name} {problem}", file)
        if values["disk_bytes"] and quota.disk_bytes > values["disk_bytes"]:
            raise ConfigError(
                TENANTS_TABLE,
                f"tenants.{tenant.name}: disk_bytes {human_size(quota.disk_bytes)} is more "
                f"than the disk tier holds (disk_bytes = {human_size(values['disk_bytes'])})",
                file,
            )
    regions = [t.quota.host_bytes for t in tenants if t.quota.host_bytes]
    if regions and common_bytes(values["host_bytes"], regions) < MIN_COMMON_REGION_BYTES:
        raise ConfigError(
            "host_bytes",
            f"{human_size(values['host_bytes'])} cannot hold the tenants' host quotas "
            f"({human_size(sum(regions))}): each is the tenant's own arena region, and the "
            "rest needs at least 1 MiB",
            sources["host_bytes"],
        )
    config = DaemonConfig(**values, sources=sources, config_file=config_file, tenants=tenants)
    check_transport(config)
    return config, args


def check_transport(config: DaemonConfig) -> None:
    """TLS settings that fit together, and no open TCP port without TLS and tokens
    unless the operator said ``insecure``; ConfigError naming the keys otherwise."""
    src = config.sources
    if bool(config.tls_cert) != bool(config.tls_key):
        key = "tls_key" if config.tls_cert else "tls_cert"
        raise ConfigError(key, "tls_cert and tls_key go together: set both", src[key])
    if config.tls_client_ca and not config.tls_cert:
        raise ConfigError(
            "tls_client_ca", "mutual TLS needs tls_cert and tls_key too", src["tls_client_ca"]
        )
    for key in ("kv_events_listen", "kv_events_replay_listen"):
        endpoint = getattr(config, key)
        reachable = endpoint.startswith("tcp://") and not is_loopback(endpoint[len("tcp://") :])
        if reachable and not config.insecure:
            raise ConfigError(
                key, f"{endpoint} is reachable from other hosts, and KV events carry prompt "
                "token ids: bind a loopback or ipc:// address, or insecure = true "
                "(--insecure) to publish there all the same", src[key],
            )  # fmt: skip
    if config.socket_mode != "0600" and not config.needs_tokens:
        raise ConfigError(
            "socket_mode", f"{config.socket_mode} lets other users call the daemon: it needs "
            "tokens ([tenants.*] or admin_token_file)", src["socket_mode"],
        )
    if config.socket_path is not None:
        if config.tls_cert:
            raise ConfigError(
                "tls_cert", "TLS is for a TCP listen; a unix socket is guarded by its file "
                "mode (0600) and directory", src["tls_cert"],
            )
        return
    if is_loopback(config.listen) or config.insecure:
        return
    if not (config.tls_cert and config.needs_tokens):
        raise ConfigError(
            "listen",
            f"{config.listen} is reachable from other hosts: it needs tls_cert + tls_key and "
            "tokens ([tenants.*] or admin_token_file), or insecure = true (--insecure) to "
            "serve it without them",
            src["listen"],
        )
