"""The parts of ``benchmarks/torture.py`` that its tests use too: a kvstored child it
kills and restarts, deterministic chains, the disk-file damage it does, the fuzzed
requests it sends and the floods of sockets it tries (a module of the harness
package, so tests import it by name)."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from kvclient import KVClient
from kvclient.errors import KVStoreError
from kvproto.v1 import kvstore_pb2 as pb
from kvproto.v1 import local_calls as frames
from kvstore.disk.files import read_meta
from kvstore.disk.pages import P_INVALID, P_LEAF, P_OVERFLOW

TOKENS = 4  # tokens per block of the torture namespaces


# --- a daemon -----------------------------------------------------------------------------


class Kvstored:
    """One kvstored child: socket, arena and disk dir under ``work``; log in work/log."""

    def __init__(
        self,
        work: Path,
        preexec: Callable[[], None] | None = None,
        token: str | None = None,  # for its start-up probe, on a daemon with tokens
        **settings: Any,
    ):
        self.work = work
        self.token = token
        work.mkdir(parents=True, exist_ok=True)
        self.sock_dir = Path(tempfile.mkdtemp(prefix="kvt", dir="/tmp"))  # short path
        self.addr = f"unix://{self.sock_dir}/kvstored.sock"
        self.disk_dir = str(settings.pop("disk_dir", work / "disk"))
        self.log = work / "kvstored.log"
        self.settings = {
            "listen": self.addr,
            "disk_dir": self.disk_dir,
            "arena_dir": str(work),
            "host_bytes": "32MiB",
            "disk_bytes": "1GiB",
            "metrics_listen": "off",
            "grace_s": 2,
            "workers": 4,
            **settings,
        }
        self.preexec = preexec
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60) -> float:
        """Start and wait until it answers; the seconds that took."""
        started = time.monotonic()
        args = [a for k, v in self.settings.items() for a in (f"--{k}", str(v))]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvstored", *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=self.preexec,
            )
        with KVClient(self.addr, timeout=2, token=self.token) as client:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"kvstored exited {self.proc.returncode}: {self.tail()}")
                with contextlib.suppress(KVStoreError):
                    client.server_info()
                    return time.monotonic() - started
                if time.monotonic() - started > timeout:
                    raise RuntimeError(f"kvstored did not answer in {timeout} s: {self.tail()}")
                time.sleep(0.02)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return -1 if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.kill()
            return -9

    def tail(self, lines: int = 5) -> str:
        try:
            return " | ".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def rss_bytes(self) -> int:
        try:
            status = Path(f"/proc/{self.proc.pid}/status").read_text()  # type: ignore[union-attr]
        except OSError:
            return 0
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.sock_dir, ignore_errors=True)


def tokens_of(seed: int, blocks: int) -> list[int]:
    return [seed * 1000 + i for i in range(blocks * TOKENS)]


def block_of(seed: int, index: int, size: int) -> bytes:
    rng = random.Random(seed * 7919 + index)
    return rng.randbytes(64) * (size // 64)


def chain_bytes(seed: int, blocks: int, size: int) -> bytes:
    return b"".join(block_of(seed, i, size) for i in range(blocks))


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class Section:
    title: str
    body: list[str]
    checks: list[tuple[str, str, bool]] = field(default_factory=list)  # (target, measured, ok)


# --- damage -------------------------------------------------------------------------------


def damage_btree(path: Path) -> int:
    """Fill every B-tree branch and leaf page of data.mdb (not the meta pages, not
    value pages) with noise; how many (tests/test_faults.py uses it too)."""
    raw = bytearray(path.read_bytes())
    hit = 0
    for number in range(2, len(raw) // 4096):
        at = number * 4096
        flags = int.from_bytes(raw[at + 10 : at + 12], "little")
        if flags & 0x03 and not flags & 0x04:  # P_BRANCH | P_LEAF, not P_OVERFLOW
            raw[at + 16 : at + 4096] = os.urandom(4096 - 16)
            hit += 1
    path.write_bytes(raw)
    return hit


def damage_free_list(path: Path) -> None:
    """Point the first page of data.mdb's free list at a live page (the main B-tree's
    root), as damage to a free-list page could: LMDB would hand that page to the next
    commit and overwrite it. Raises when the free list is empty or deeper than a leaf."""
    meta = read_meta(str(path))
    assert meta is not None and meta.free_root != P_INVALID, "the free list is empty"
    raw = bytearray(path.read_bytes())
    at = meta.free_root * meta.page_size
    flags, lower = struct.unpack_from("<HH", raw, at + 10)
    assert flags & P_LEAF and lower > 16, "the free list is not one leaf page"
    (node,) = struct.unpack_from("<H", raw, at + 16)
    ksize = struct.unpack_from("<H", raw, at + node + 6)[0]
    first_page = at + node + 8 + ksize + 8  # after the node header, its key, the count
    struct.pack_into("<Q", raw, first_page, meta.main_root)
    path.write_bytes(raw)


def damage_overflow(path: Path) -> None:
    """Overwrite the header of the first value's overflow run found (page number and
    page count): the run would reach past the file's end."""
    raw = bytearray(path.read_bytes())
    for number in range(2, len(raw) // 4096):
        at = number * 4096
        if int.from_bytes(raw[at + 10 : at + 12], "little") & P_OVERFLOW:
            struct.pack_into("<QHHI", raw, at, number, 0, P_OVERFLOW, 1 << 30)
            path.write_bytes(raw)
            return
    raise AssertionError("no overflow run in the file")


def damage_value(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    marker = block_of(1, 1, 64)[:64]
    at = raw.find(marker)
    raw[at + 100 : at + 164] = b"\xee" * 64
    path.write_bytes(raw)


# --- fuzz ---------------------------------------------------------------------------------


def valid_requests(ns_id: str) -> dict[str, Any]:
    tokens = list(range(32))
    return {
        "OpenNamespace": pb.OpenNamespaceRequest(
            spec=pb.NamespaceSpec(model="fuzz", block_tokens=4, block_bytes=4096)
        ),
        "Lookup": pb.LookupRequest(ns_id=ns_id, tokens=tokens),
        "LookupBatch": pb.LookupBatchRequest(ns_id=ns_id, chains=[
            pb.LookupBatchRequest.Chain(tokens=tokens),
            pb.LookupBatchRequest.Chain(tokens=tokens[:8], extra_keys=[b"x"]),
        ]),  # fmt: skip
        "Acquire": pb.AcquireRequest(ns_id=ns_id, tokens=tokens),
        "Release": pb.ReleaseRequest(lease_id=12345),
        "ReportReads": pb.ReportReadsRequest(
            prefixes=[pb.PrefixReads(ns_id=ns_id, tokens=tokens, n_blocks=2, reads=1)]
        ),
        "Reserve": pb.ReserveRequest(ns_id=ns_id, tokens=tokens, n_blocks=2),
        "Commit": pb.CommitRequest(lease_id=12345),
        "Abandon": pb.AbandonRequest(lease_id=12345),
        "Delete": pb.DeleteRequest(ns_id=ns_id, tokens=tokens),
        "SetPriority": pb.SetPriorityRequest(ns_id=ns_id, tokens=tokens, priority=50),
        "Stats": pb.StatsRequest(),
        "ServerInfo": pb.ServerInfoRequest(),
        "DescribeNamespace": pb.DescribeNamespaceRequest(ns_id=ns_id),
        "ListNamespaces": pb.ListNamespacesRequest(),
    }


def mutate(raw: bytes, rng: random.Random) -> bytes:
    kind = rng.randrange(4)
    if kind == 0 or not raw:
        return rng.randbytes(rng.randrange(0, 300))
    data = bytearray(raw)
    if kind == 1:
        for _ in range(rng.randrange(1, 6)):
            data[rng.randrange(len(data))] = rng.randrange(256)
    elif kind == 2:
        data = data[: rng.randrange(len(data))]
    else:
        at = rng.randrange(len(data))
        data[at:at] = rng.randbytes(rng.randrange(1, 40))
    return bytes(data)


def local_call(path: str, frame: bytes, noise: bool, timeout: float = 10) -> str:
    """Send one frame; the status name answered, or what happened to the connection.
    After ``noise`` (which may announce more bytes than it has) the sending side is
    shut, as a client that went away would leave it."""
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(path)
        sock.sendall(frame)
        if noise:
            sock.shutdown(socket.SHUT_WR)
        head = b""
        while len(head) < frames.HEADER.size:
            more = sock.recv(frames.HEADER.size - len(head))
            if not more:
                return "closed"
            head += more
        _, status = frames.HEADER.unpack(head)
    return (
        grpc.StatusCode.OK.name
        if status == 0
        else next((c.name for c in grpc.StatusCode if c.value[0] == status), f"status {status}")
    )


def closed_by_peer(sock: socket.socket, within: float) -> bool:
    """Whether the other end closes ``sock`` within ``within`` seconds (nothing sent)."""
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def send_oversized_subscription(pub: str, nbytes: int, timeout: float = 60) -> None:
    """Send one subscription message of ``nbytes`` to the ZMQ PUB socket at ``pub``,
    from a process of its own: libzmq crashes the sender's context as it ends after
    the receiver dropped the connection for it (ZMQ_MAXMSGSIZE)."""
    code = (
        "import os, sys, time, zmq\n"
        "sock = zmq.Context().socket(zmq.XSUB)\n"
        "sock.connect(sys.argv[1])\n"
        "sock.send(b'\\x01' + bytes(int(sys.argv[2])))\n"
        "time.sleep(1)\n"
        "os._exit(0)\n"
    )
    subprocess.run([sys.executable, "-c", code, pub, str(nbytes)], check=True, timeout=timeout)
