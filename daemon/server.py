"""The gRPC server around the store: bind, serve, and stop gracefully.

Life of a daemon::

    store = Store(...)                   # arena + LMDB opened, disk index rebuilt
    server: KVStore + grpc.health.v1 + reflection, message limits from config
    bind (unix socket: dir 0700, socket 0600; refuses a live socket, removes a stale one)
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
import errno
import logging
import os
import signal
import socket
import stat
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvproto.v1 import gpu_pb2, gpu_pb2_grpc
from kvproto.v1 import kvstore_pb2 as pb
from kvstore import pinning
from kvstore import platform as kv_platform
from kvstore.store import Store
from kvstored import paths
from kvstored.config import UNIX_PATH_MAX, DaemonConfig, human_size
from kvstored.gpu_service import KVGpuService
from kvstored.local_calls import LocalCallServer
from kvstored.metrics import DaemonMetrics, MetricsBindError
from kvstored.names import NamespaceNames
from kvstored.service import KVStoreService, add_to_server

log = logging.getLogger("kvstored")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVStore"].full_name  # "kvstore.v1.KVStore"
GPU_SERVICE_NAME = gpu_pb2.DESCRIPTOR.services_by_name["KVGpu"].full_name  # "kvstore.v1.KVGpu"


class StartupError(RuntimeError):
    """The daemon cannot start (socket in use, store cannot open ...); exit code 1."""


def daemon_version() -> str:
    try:
        return version("kvstore")
    except PackageNotFoundError:
        return "0+unknown"


def grpc_options(config: DaemonConfig) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        # Two daemons on one TCP port would split the traffic between two stores.
        ("grpc.so_reuseport", 0),
    ]


def prepare_socket(sock_path: Path) -> None:
    """Create the socket's directory (0700) and clear a stale socket file.

    A socket that still answers belongs to a running daemon: refuse to steal it. A
    path that is not a socket is never removed.
    """
    parent = sock_path.parent
    if not parent.exists():
        parent.mkdir(mode=0o700, parents=True)
    elif sock_path == paths.default_socket_path() and parent.stat().st_uid == os.getuid():
        parent.chmod(0o700)
    if not sock_path.exists() and not sock_path.is_symlink():
        return
    if not stat.S_ISSOCK(sock_path.lstat().st_mode):
        raise StartupError(f"{sock_path} exists and is not a socket; not removing it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(sock_path))
    except OSError as exc:
        if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT):
            raise StartupError(f"cannot probe {sock_path}: {exc.strerror}") from None
        log.info("removing stale socket %s", sock_path, extra={"event": "stale_socket"})
        sock_path.unlink(missing_ok=True)
    else:
        raise StartupError(f"another daemon is listening on {sock_path}")
    finally:
        probe.close()


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


async def serve(config: DaemonConfig, stop: asyncio.Event | None = None) -> int:
    """Run until SIGTERM/SIGINT (or ``stop`` is set); returns the exit code."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _on_signal, sig, stop)

    sock_path = config.socket_path
    if sock_path is not None:
        prepare_socket(sock_path)
    gpu = await asyncio.to_thread(kv_platform.detect)  # no torch/CUDA context on cpu-only
    pin = pinning.arena_pin_hook(gpu)  # cudaHostRegister of the arena when CUDA is there
    try:
        store = await asyncio.to_thread(Store, config.store_config(), pin=pin)
    except Exception as exc:
        raise StartupError(f"cannot open the store: {type(exc).__name__}: {exc}") from exc
    store.set_platform(gpu.profile.value)

    names = NamespaceNames(config.disk_dir if config.disk_bytes else None)
    service = KVStoreService(store, config, names, daemon_version())
    health_servicer = health.aio.HealthServicer()
    metrics = DaemonMetrics(store.stats, daemon_version(), lambda: store.platform)
    server = grpc.aio.server(options=grpc_options(config), interceptors=[metrics.interceptor])
    add_to_server(service, server)  # Get and Put on framed bytes: fewer copies per chunk
    gpu_service = KVGpuService(store, config, names, gpu, pin)
    gpu_pb2_grpc.add_KVGpuServicer_to_server(gpu_service, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, GPU_SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    try:
        old_umask = os.umask(0o177)  # the socket is born 0600: no window for other users
        try:
            port = server.add_insecure_port(config.listen)
            await server.start()
        finally:
            os.umask(old_umask)
        if sock_path is not None:
            sock_path.chmod(0o600)
        metrics_url = metrics.start_http(
            config.metrics_listen, required=config.sources["metrics_listen"] != "default"
        )
    except Exception as exc:
        await server.stop(None)
        gpu_service.close()
        await asyncio.to_thread(store.close)
        service.close()
        if isinstance(exc, MetricsBindError):
            raise StartupError(f"cannot listen on {exc}") from exc
        raise StartupError(f"cannot listen on {config.listen}: {exc}") from exc
    local = await start_local_calls(config, service, metrics, port)
    if metrics_url:  # logged before SERVING: whoever waits for health can read it
        log.info("metrics on %s", metrics_url, extra={"event": "metrics", "url": metrics_url})

    listening = config.listen
    if sock_path is None:  # TCP: show the port grpc bound (the one asked for, or a free one)
        listening = f"{config.listen.rpartition(':')[0]}:{port}"
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("platform %s", gpu.describe(), extra={"event": "platform"})
    log.info("%s", describe(config, store, listening), extra={"event": "serving"})

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
        await asyncio.to_thread(store.close)
        service.close()
        if local is not None:
            local.close()
        if sock_path is not None:
            with contextlib.suppress(OSError):
                sock_path.unlink()
        log.info("stopped", extra={"event": "stopped"})
    return 0


async def start_local_calls(
    config: DaemonConfig, service: KVStoreService, metrics: DaemonMetrics, port: int
) -> LocalCallServer | None:
    """Serve local calls beside the gRPC socket (see kvproto.v1.local_calls); None when
    turned off or when its socket cannot be made (logged: clients then use gRPC only)."""
    if not config.local_calls:
        return None
    path = paths.local_socket_path(config.socket_path, port)
    local = LocalCallServer(service, config.max_message_bytes, metrics.interceptor.observe)
    try:
        if len(str(path).encode()) > UNIX_PATH_MAX:
            raise StartupError(f"the path {path} is longer than a unix socket path may be")
        prepare_socket(path)
        await local.start(path)
    except (StartupError, OSError) as exc:
        log.warning(
            "local calls off (clients use gRPC only): %s", exc,
            extra={"event": "local_calls_off"},
        )
        return None
    service.local_socket = str(path)
    return local


def _on_signal(sig: signal.Signals, stop: asyncio.Event) -> None:
    if stop.is_set():
        log.warning(
            "%s again: already shutting down", sig.name, extra={"event": "signal"}
        )
        return
    log.info("%s received", sig.name, extra={"event": "signal"})
    stop.set()
