"""The processes a benchmark runs beside the client: its own kvstored, the raw gRPC
server (the transport baseline) and redis-server (the Redis baseline)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

if TYPE_CHECKING:
    from kvbench.run import Case

from kvbench.harness import RAW_CHUNK, RAW_OPTIONS, RAW_SERVICE, GiB, Layout, wait_for
from kvclient.sync_client import KVClient

# -- daemons ----------------------------------------------------------------------------


def write_secret(path: Path, text: str) -> Path:
    """Write a token or key file as kvstored accepts one: mode 0600 (kvstored.auth)."""
    path.write_text(text)
    path.chmod(0o600)
    return path


def terminate(proc: subprocess.Popen[Any], timeout_s: float) -> None:
    """SIGTERM a child still running and wait for it; SIGKILL it after ``timeout_s``."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class OwnDaemon:
    """A kvstored this program starts in a temp dir, restarts, and stops."""

    def __init__(
        self,
        workdir: Path,
        host_bytes: int,
        disk_bytes: int,
        listen: str = "",
        extra_args: Sequence[str] = (),
        credentials: grpc.ChannelCredentials | None = None,
        client_options: dict[str, Any] | None = None,
    ) -> None:
        """``listen``: a TCP address instead of a socket of its own; ``extra_args`` go
        on its command line; ``credentials`` (TLS) and ``client_options`` (a token, TLS:
        KVClient keywords) are how this program's own calls reach it."""
        self.workdir = workdir
        self.sock_dir = Path(tempfile.mkdtemp(prefix="kvb", dir="/tmp"))
        self.addr = listen or f"unix://{self.sock_dir}/kvstored.sock"
        self.credentials = credentials
        self.client_options = client_options or {}
        self.disk_dir = workdir / "disk"
        self.log_path = workdir / "kvstored.log"
        self.args = [
            sys.executable,
            "-m",
            "kvstored",
            "--listen",
            self.addr,
            "--host_bytes",
            str(host_bytes),
            "--disk_dir",
            str(self.disk_dir),
            "--disk_bytes",
            str(disk_bytes),
            "--max_transfer_bytes",
            str(GiB),
            "--log_level",
            "warning",
            *extra_args,
        ]
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORED_")}
        from kvstored.config import KEYS_BY_NAME

        if "metrics_listen" in KEYS_BY_NAME:  # no metrics endpoint (its port may be taken)
            self.args += ["--metrics_listen", "off"]
        self.proc: subprocess.Popen[bytes] | None = None
        self.cwd: Path | None = None  # where it runs (``-m`` puts it first on the path)

    def start(self) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child owns it
        self.proc = subprocess.Popen(
            self.args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            env=self.env, cwd=self.cwd,
        )  # fmt: skip
        log.close()
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        def serving() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvstored exited: {self.log_path.read_text()[-2000:]}")
            channel = (
                grpc.secure_channel(self.addr, self.credentials) if self.credentials
                else grpc.insecure_channel(self.addr)
            )
            with channel:
                try:
                    reply = health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(), timeout=0.5
                    )
                except grpc.RpcError:
                    return False
                return reply.status == health_pb2.HealthCheckResponse.SERVING

        wait_for(serving, 60, "kvstored")
        self.wait_prefaulted()

    def wait_prefaulted(self) -> None:
        """Let the daemon's background prefault of its arena finish (it would compete
        with the first cases for the CPU): tmpfs counts a file's blocks as its pages
        are faulted in. Gives up when the count stops growing (prefault off)."""
        with KVClient(self.addr, **self.client_options) as client:
            info = client.server_info()
        if not info.arena_path:
            return
        last, still_since = -1, time.monotonic()
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                populated = os.stat(info.arena_path).st_blocks * 512
            except OSError:
                return
            if populated >= info.arena_bytes:
                return
            if populated != last:
                last, still_since = populated, time.monotonic()
            elif time.monotonic() - still_since > 1.0:
                return
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None:
            terminate(self.proc, 300)
        self.proc = None

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.sock_dir, ignore_errors=True)


class RawGrpcServer:
    """The transport baseline: ``python -m kvbench --serve-raw SOCK`` (grpc.aio,
    generic handlers, identity serializers), as kvstored serves its Get and Put."""

    def __init__(self) -> None:
        self.sock_dir = Path(tempfile.mkdtemp(prefix="kvr", dir="/tmp"))
        self.addr = f"unix://{self.sock_dir}/raw.sock"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvbench", "--serve-raw", self.addr],
            stdin=subprocess.DEVNULL,
        )
        self.channel = grpc.insecure_channel(self.addr, options=RAW_OPTIONS)
        grpc.channel_ready_future(self.channel).result(timeout=30)
        self.pull = self.channel.unary_stream(f"/{RAW_SERVICE}/Pull")
        self.push = self.channel.stream_unary(f"/{RAW_SERVICE}/Push")
        self.echo = self.channel.unary_unary(f"/{RAW_SERVICE}/Echo")

    def close(self) -> None:
        self.channel.close()
        self.proc.terminate()
        self.proc.wait(10)
        shutil.rmtree(self.sock_dir, ignore_errors=True)


def serve_raw(addr: str) -> None:
    """The raw gRPC baseline server (runs in its own process)."""
    cache: dict[int, bytes] = {}

    def chunk(n: int) -> bytes:
        if n not in cache:
            cache[n] = bytes(n)
        return cache[n]

    async def pull(request: bytes, context: Any) -> Any:
        remaining = int.from_bytes(request, "little")
        while remaining > 0:
            n = min(remaining, RAW_CHUNK)
            yield chunk(n)
            remaining -= n

    async def push(requests: Any, context: Any) -> bytes:
        total = 0
        async for msg in requests:
            total += len(msg)
        return total.to_bytes(8, "little")

    async def echo(request: bytes, context: Any) -> bytes:
        return request

    async def main() -> None:
        handlers = grpc.method_handlers_generic_handler(
            RAW_SERVICE,
            {
                "Pull": grpc.unary_stream_rpc_method_handler(pull),
                "Push": grpc.stream_unary_rpc_method_handler(push),
                "Echo": grpc.unary_unary_rpc_method_handler(echo),
            },
        )
        server = grpc.aio.server(options=RAW_OPTIONS)
        server.add_generic_rpc_handlers((handlers,))
        server.add_insecure_port(addr)
        await server.start()
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
        await server.stop(None)

    asyncio.run(main())


class RedisBaseline:
    """``redis-server`` on a unix socket (no persistence), and a redis-py client with
    the hiredis parser and the Python command packer."""

    def __init__(self, server: str) -> None:
        import redis
        from redis.connection import PythonRespSerializer, UnixDomainSocketConnection

        class PythonPackerConnection(UnixDomainSocketConnection):  # type: ignore[misc]
            def _construct_command_packer(self, packer: Any) -> Any:
                return PythonRespSerializer(self._buffer_cutoff, self.encoder.encode)

        self.dir = Path(tempfile.mkdtemp(prefix="kvredis", dir="/tmp"))
        self.sock = str(self.dir / "redis.sock")
        self.proc = subprocess.Popen(
            [
                server,
                "--port",
                "0",
                "--unixsocket",
                self.sock,
                "--unixsocketperm",
                "700",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.dir),
                "--proto-max-bulk-len",
                "1gb",
                "--client-query-buffer-limit",
                "1gb",
                "--loglevel",
                "warning",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
        pool = redis.ConnectionPool(
            connection_class=PythonPackerConnection, path=self.sock, socket_timeout=120
        )
        self.client = redis.Redis(connection_pool=pool)
        wait_for(lambda: os.path.exists(self.sock) and self._ping(), 30, "redis-server")
        self.version = self.client.info("server").get("redis_version", "?")
        from redis.utils import HIREDIS_AVAILABLE

        self.parser = "hiredis" if HIREDIS_AVAILABLE else "python"

    @staticmethod
    def keys(layout: Layout, call: int, batch: int) -> list[bytes]:
        """The Redis keys of the blocks of one call."""
        return [f"{layout.name}:{call}:{i}".encode() for i in range(batch)]

    def check(self, layout: Layout, case: Case) -> None:
        """The first block of the case's first call reads back as put."""
        first = self.client.get(self.keys(layout, 0, 1)[0])
        if first is None or first != case.source[0][0].tobytes():
            raise RuntimeError("redis returned other bytes")

    def _ping(self) -> bool:
        try:
            return bool(self.client.ping())
        except Exception:
            return False

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.close()
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def redis_unavailable() -> str:
    """Why the Redis baseline cannot run here ('' when it can)."""
    if shutil.which("redis-server") is None:
        return "redis-server is not on PATH"
    try:
        import redis  # noqa: F401
    except ImportError:
        return "redis-py is not installed (pip install redis hiredis)"
    return ""


