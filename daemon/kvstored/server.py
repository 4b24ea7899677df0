"""The gRPC server around the store: bind, serve, and stop gracefully.

Life of a daemon::

    store = Store(...)                   # arena + LMDB opened, disk index rebuilt
    server: KVStore + grpc.health.v1 + reflection, message limits from config
    bind (unix socket 0600, in the directory preflight.check made ready)
    health "" and "kvstore.v1.KVStore" -> SERVING; one start-up log line
    ... SIGTERM / SIGINT ...
    health -> NOT_SERVING; WatchEvents streams end
    server.stop(grace): no new calls, in-flight calls get ``grace_s`` to finish
    store.close(): persists host-only blocks, flushes the disk writer
    socket removed; exit 0

Health turns SERVING only after the store is open and the socket bound, so a client
(or the test fixture) that waits for SERVING never sees a half-started daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import grpc
import zmq
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvproto.v1 import gpu_pb2, gpu_pb2_grpc
from kvproto.v1 import kvstore_pb2 as pb
from kvstore import platform as kv_platform
from kvstore.disk.files import DiskDirInUse
from kvstore.host import pinning
from kvstore.store import Store
from kvstored import paths
from kvstored.arena_handout import ArenaHandout, handout_socket_path
from kvstored.auth import Access, Tokens
from kvstored.config import AUTO_HOST_MAX, DISK_SIZE_FILE, DaemonConfig
from kvstored.config_values import UNIX_PATH_MAX, human_size
from kvstored.dispatch import Calls
from kvstored.gpu_service import KVGpuService
from kvstored.kv_events import Publisher
from kvstored.local_calls import LocalCallServer
from kvstored.log_limits import LIMITED
from kvstored.metrics import DaemonMetrics, MetricsBindError, StoreCollector
from kvstored.names import NamespaceNames
from kvstored.preflight import prepare_unix_socket
from kvstored.service import KVStoreService, add_to_server
from kvstored.token_gate import TokenGate

log = logging.getLogger("kvstored")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVStore"].full_name  # "kvstore.v1.KVStore"
GPU_SERVICE_NAME = gpu_pb2.DESCRIPTOR.services_by_name["KVGpu"].full_name  # "kvstore.v1.KVGpu"


class StartupError(RuntimeError):
    """The daemon cannot start (socket in use, store cannot open ...); ``exit_code``
    1, or 2 for a setting this machine cannot use (a disk_dir another daemon holds)."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


EXIT_UNPERSISTED = 3  # stopped, but blocks due on disk were never committed (disk fault)


DISTRIBUTION = "kvstore-offload"  # the name pip knows this project by


def daemon_version() -> str:
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        return "0+unknown"


def grpc_options(config: DaemonConfig) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        # Two daemons on one TCP port would split the traffic between two stores.
        ("grpc.so_reuseport", 0),
    ]


def describe(config: DaemonConfig, store: Store, listening: str) -> str:
    """The one start-up line: where, tiers with capacities, admission, platform."""
    host = f"host {human_size(store.arena_bytes)}"
    if store.arena_path:
        host += f" (arena {store.arena_path})"
    if config.disk_bytes:
        disk = f"disk {human_size(config.disk_bytes)} at {config.disk_dir} ({config.admission})"
    else:
        disk = "disk off"
    return (
        f"kvstored {daemon_version()} serving on {listening}; tiers: {host}, {disk}; "
        f"platform {store.platform}; pid {os.getpid()}"
    )


def chosen_defaults(config: DaemonConfig) -> str:
    """One line naming the sizes the daemon chose itself, and the keys that change them
    ("" when the operator set them all)."""
    parts = []
    if config.sources["host_bytes"].startswith("default"):
        parts.append(
            f"host_bytes {human_size(config.host_bytes)} (25% of the memory, at most "
            f"{human_size(AUTO_HOST_MAX)} and half of what is available)"
        )
    if config.disk_bytes and config.sources["disk_bytes"].startswith("default"):
        parts.append(
            f"disk_bytes {human_size(config.disk_bytes)} (25% of free disk at the first "
            f"start, kept in {Path(config.disk_dir) / DISK_SIZE_FILE})"
        )
    if config.shared_arena and config.prefault_arena and config.sources[
        "prefault_arena"
    ].startswith("default"):
        parts.append("the arena's memory is committed at start-up (prefault_arena)")
    if not parts:
        return ""
    return (
        "defaults in use: " + "; ".join(parts) + ". Change any with --KEY, KVSTORED_KEY or "
        "the config file; kvstored --print-config shows every value"
    )


def _loop_exception(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The event loop's reports (a failed ``accept()`` out of descriptors, which it
    retries a second later; an exception no task awaited) through the rate-limited
    logger: a peer that keeps the daemon out of descriptors writes one line a kind."""
    message = str(context.get("message", "event loop error"))
    exc = context.get("exception")
    LIMITED.error(
        log, f"loop:{message}", "%s: %s", message, exc or "",
        exc_info=exc if isinstance(exc, BaseException) else None,
    )  # fmt: skip


async def serve(config: DaemonConfig, stop: asyncio.Event | None = None) -> int:
    """Run until SIGTERM/SIGINT (or ``stop`` is set); returns the exit code."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _on_signal, sig, stop)
    loop.set_exception_handler(_loop_exception)

    sock_path = config.socket_path  # made ready by preflight.check
    gpu = await asyncio.to_thread(kv_platform.detect)  # no torch/CUDA context on cpu-only
    pin = pinning.arena_pin_hook(gpu)  # cudaHostRegister of the arena when CUDA is there
    publisher = start_kv_events(config)  # before the store: it tells what the start finds
    feed = None if publisher is None else publisher.feed
    try:
        store = await asyncio.to_thread(Store, config.store_config(), pin=pin, feed=feed)
    except Exception as exc:
        if publisher is not None:
            publisher.close()
        if isinstance(exc, DiskDirInUse):
            raise StartupError(str(exc), exit_code=2) from exc
        raise StartupError(f"cannot open the store: {_reason(exc)}") from exc
    store.set_platform(gpu.profile.value)

    names = NamespaceNames(
        config.disk_dir if config.disk_bytes else None, config.tenant_max_namespaces
    )
    try:
        tokens = Tokens(config.tenants, config.admin_token_file)
    except ValueError as exc:  # preflight read them: changed since
        await asyncio.to_thread(store.close)
        close_kv_events(publisher)
        raise StartupError(str(exc), exit_code=2) from exc
    access = Access(store, names, tokens)
    service = KVStoreService(Calls(store, config, names, daemon_version(), access))
    health_servicer = health.aio.HealthServicer()
    metrics = DaemonMetrics(
        StoreCollector(
            store.stats, daemon_version(), lambda: store.platform, config.namespace_metrics
        )
    )
    server = grpc.aio.server(
        options=grpc_options(config), interceptors=[metrics.interceptor, TokenGate(tokens)]
    )
    add_to_server(service, server)  # Get and Put on framed bytes: fewer copies per chunk
    gpu_service = KVGpuService(store, config, names, gpu, pin, access)
    gpu_pb2_grpc.add_KVGpuServicer_to_server(gpu_service, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, GPU_SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    try:
        old_umask = os.umask(0o177)  # the socket is born 0600: no window for other users
        try:
            credentials = server_credentials(config)
            if credentials is None:
                port = server.add_insecure_port(config.listen)
            else:
                port = server.add_secure_port(config.listen, credentials)
            await server.start()
        finally:
            os.umask(old_umask)
        if sock_path is not None:
            sock_path.chmod(int(config.socket_mode, 8))
        metrics_url = metrics.start_http(
            config.metrics_listen, required=config.sources["metrics_listen"] != "default"
        )
    except Exception as exc:
        await server.stop(None)
        gpu_service.close()
        await asyncio.to_thread(store.close)
        close_kv_events(publisher)
        service.close()
        if isinstance(exc, MetricsBindError):
            raise StartupError(f"cannot listen on {exc}") from exc
        raise StartupError(f"cannot listen on {config.listen}: {exc}") from exc
    local = await start_local_calls(config, service, metrics, port)
    handout = await start_arena_handout(config, service, store, tokens, port)
    if metrics_url:  # logged before SERVING: whoever waits for health can read it
        log.info("metrics on %s", metrics_url, extra={"event": "metrics", "url": metrics_url})

    listening = config.listen
    if sock_path is None:  # TCP: show the port grpc bound (the one asked for, or a free one)
        listening = f"{config.listen.rpartition(':')[0]}:{port}"
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("platform %s", gpu.describe(), extra={"event": "platform"})
    log.info("%s", describe(config, store, listening), extra={"event": "serving"})
    if defaults := chosen_defaults(config):
        log.info("%s", defaults, extra={"event": "defaults"})
    if config.shared_url and not config.shared_key_file:
        log.warning(
            "the shared tier runs without shared_key_file: whoever can write to the "
            "cluster can plant blocks this daemon serves as hits; give every node the "
            "same secret in shared_key_file",
            extra={"event": "shared_unkeyed"},
        )

    try:
        await stop.wait()
    finally:
        log.info(
            "shutting down: draining calls for up to %.1f s", config.grace_s,
            extra={"event": "draining"},
        )
        await health_servicer.enter_graceful_shutdown()
        service.begin_shutdown()
        if local is not None:
            local.stop()
        await server.stop(config.grace_s)
        await asyncio.to_thread(gpu_service.close)  # running transfers end before the store
        await asyncio.to_thread(metrics.close)
        log.info(
            "closing the store (persisting and flushing the disk tier)",
            extra={"event": "closing"},
        )
        unpersisted = await asyncio.to_thread(store.close)
        await asyncio.to_thread(close_kv_events, publisher)  # after the close's last moves
        service.close()
        if local is not None:
            local.close()
        if handout is not None:
            handout.close()
        if sock_path is not None:
            with contextlib.suppress(OSError):
                sock_path.unlink()
        if unpersisted:
            log.error(
                "stopped uncleanly: %d blocks due on disk could not be persisted (the "
                "disk tier was failing, or persist_timeout_s=%g ran out; see the log "
                "lines above); exit %d",
                unpersisted, config.persist_timeout_s, EXIT_UNPERSISTED,
                extra={"event": "stopped_unclean", "unpersisted": unpersisted},
            )
        else:
            log.info("stopped", extra={"event": "stopped"})
    return EXIT_UNPERSISTED if unpersisted else 0


def start_kv_events(config: DaemonConfig) -> Publisher | None:
    """Bind and start the KV event publisher when ``kv_events_listen`` is set."""
    settings = config.event_settings()
    if settings is None:
        return None
    try:
        publisher = Publisher(settings)
    except zmq.ZMQError as exc:
        raise StartupError(f"cannot listen for KV events on {settings.listen}: {exc}") from exc
    publisher.start()
    log.info(
        "KV events on %s (replay %s; %s encoding, %s hashes)",
        publisher.endpoint, publisher.replay_endpoint or "off", settings.encoding,
        settings.hashes,
        extra={"event": "kv_events", "url": publisher.endpoint,
               "replay": publisher.replay_endpoint},
    )  # fmt: skip
    return publisher


def close_kv_events(publisher: Publisher | None) -> None:
    if publisher is not None:
        publisher.close()


async def start_local_calls(
    config: DaemonConfig, service: KVStoreService, metrics: DaemonMetrics, port: int
) -> LocalCallServer | None:
    """Serve local calls beside the gRPC socket (see kvproto.v1.local_calls); None when
    turned off or when its socket cannot be made (logged: clients then use gRPC only)."""
    if not config.local_calls:
        return None
    path = paths.local_socket_path(config.socket_path, port)
    local = LocalCallServer(
        service, config.max_message_bytes, metrics.interceptor.observe,
        config.max_connections_per_user,
    )  # fmt: skip
    off = ("local calls off (clients use gRPC only)", "local_calls_off")
    if not await serve_beside(path, local.start, config.socket_mode, *off):
        return None
    service.calls.local_socket = str(path)
    return local


async def start_arena_handout(
    config: DaemonConfig, service: KVStoreService, store: Store, tokens: Tokens, port: int
) -> ArenaHandout | None:
    """Hand tenants their arena regions by fd (kvstored.arena_handout), when the arena
    has any; None otherwise, or when its socket cannot be made (logged: those tenants'
    clients then move inline bytes)."""
    if not store.arena.fds:
        return None
    path = handout_socket_path(paths.local_socket_path(config.socket_path, port))
    handout = ArenaHandout(store.arena, tokens, config.max_connections_per_user)
    off = ("arena hand-out off (tenants with their own region use inline bytes)",
           "arena_handout_off")  # fmt: skip
    if not await serve_beside(path, handout.start, config.socket_mode, *off):
        return None
    service.calls.arena_socket = str(path)
    return handout


async def serve_beside(
    path: Path, start: Callable[[Path], Awaitable[None]], mode: str, off: str, event: str
) -> bool:
    """Start a server on a unix socket beside the gRPC one: ``start(path)`` binds it
    (born 0600 under a umask: no window for other users), then it gets ``mode``
    (socket_mode). False, with one warning line (``off``, ``event``), when the socket
    cannot be made: the daemon runs without it."""
    try:
        if len(str(path).encode()) > UNIX_PATH_MAX:
            raise StartupError(f"the path {path} is longer than a unix socket path may be")
        if problem := prepare_unix_socket(path):
            raise StartupError(problem)
        old_umask = os.umask(0o177)
        try:
            await start(path)
        finally:
            os.umask(old_umask)
        os.chmod(path, int(mode, 8))
    except (StartupError, OSError) as exc:
        log.warning("%s: %s", off, exc, extra={"event": event})
        return False
    return True


def server_credentials(config: DaemonConfig) -> grpc.ServerCredentials | None:
    """TLS for a TCP listen with tls_cert (clients must show a certificate that
    tls_client_ca signed, when set); None for plain (a unix socket, or loopback)."""
    if not config.tls_cert:
        return None
    key_pair = (Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes())
    client_ca = Path(config.tls_client_ca).read_bytes() if config.tls_client_ca else None
    return grpc.ssl_server_credentials(
        [key_pair], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


def _reason(exc: BaseException) -> str:
    """An exception as a reader wants it: the OS's words and the path, no class names."""
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.filename}: {exc.strerror}" if exc.filename else exc.strerror
    return str(exc) or type(exc).__name__


def _on_signal(sig: signal.Signals, stop: asyncio.Event) -> None:
    if stop.is_set():
        log.warning(
            "%s again: already shutting down", sig.name, extra={"event": "signal"}
        )
        return
    log.info("%s received", sig.name, extra={"event": "signal"})
    stop.set()
