"""Start-up checks (kvstored.preflight): a path or port this machine cannot use stops the
daemon with exit 2 and one line naming the key, before the arena or the disk tier is
allocated; the automatic disk size is kept from the first start; the sizes the daemon
chose itself are stated at start-up with the keys that change them."""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Daemon

from kvstored import config as kvconfig
from kvstored import hostinfo, preflight


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kvpf", dir="/tmp"))  # AF_UNIX path limit
    yield path
    for child in path.iterdir():
        child.unlink()
    path.rmdir()


def start_args(tmp_path: Path, sock_dir: Path, **settings: str) -> list[str]:
    arena = tmp_path / "arena"
    arena.mkdir(exist_ok=True)
    values = {
        "listen": f"unix://{sock_dir}/kvstored.sock",
        "host_bytes": "64MiB",
        "disk_dir": str(tmp_path / "disk"),
        "disk_bytes": "256MiB",
        "arena_dir": str(arena),
        "metrics_listen": "off",
        **settings,
    }
    return [a for k, v in values.items() for a in (f"--{k}", v)]


def run_kvstored(args: list[str]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORED_")}
    return subprocess.run(
        [sys.executable, "-m", "kvstored", *args],
        capture_output=True, text=True, env=env, timeout=60,
    )


def assert_refused(proc: subprocess.CompletedProcess[str], key: str, *words: str) -> str:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"kvstored: error: {key}: "), lines[0]
    assert "Error" not in lines[0] and "Traceback" not in lines[0]  # no exception names
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def busy_port() -> socket.socket:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    return listener


@pytest.mark.parametrize("kind", ["missing parent", "a file", "read-only"])
def test_an_unusable_disk_dir_is_refused_naming_it_before_the_arena_exists(
    tmp_path: Path, sock_dir: Path, kind: str
) -> None:
    if kind == "missing parent":
        disk_dir = "/proc/kvstore-no-such-dir"  # /proc refuses new directories
    elif kind == "a file":
        (tmp_path / "plain").write_text("x")
        disk_dir = str(tmp_path / "plain")
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes into a 0500 directory")
        (tmp_path / "ro").mkdir(mode=0o500)
        disk_dir = str(tmp_path / "ro" / "kv")
    for disk_bytes in ("256MiB", None):  # configured, and the automatic default
        args = start_args(tmp_path, sock_dir, disk_dir=disk_dir)
        if disk_bytes is None:
            i = args.index("--disk_bytes")
            del args[i : i + 2]
        line = assert_refused(run_kvstored(args), "disk_dir", disk_dir)
        assert "disk_bytes = 0" in line  # says how to run without a disk tier
        assert list((tmp_path / "arena").iterdir()) == []  # nothing was allocated
        assert list(sock_dir.iterdir()) == []


def test_a_missing_arena_dir_and_an_arena_larger_than_its_file_system_are_refused(
    tmp_path: Path, sock_dir: Path
) -> None:
    missing = tmp_path / "no-such-dir"
    assert_refused(
        run_kvstored(start_args(tmp_path, sock_dir, arena_dir=str(missing))),
        "arena_dir", str(missing), "does not exist",
    )
    free = hostinfo.disk_free_bytes(tmp_path / "arena")
    too_big = f"{(free >> 30) + 64}GiB"
    assert_refused(
        run_kvstored(start_args(tmp_path, sock_dir, host_bytes=too_big)),
        "host_bytes", "does not fit in arena_dir", "free",
    )
    assert list((tmp_path / "arena").iterdir()) == []
    assert not (tmp_path / "disk" / "data.mdb").exists()  # the disk tier was not opened


def test_ports_in_use_are_refused_before_anything_is_allocated(
    tmp_path: Path, sock_dir: Path
) -> None:
    with busy_port() as taken:
        port = taken.getsockname()[1]
        line = assert_refused(
            run_kvstored(start_args(tmp_path, sock_dir, listen=f"127.0.0.1:{port}")),
            "listen", f"127.0.0.1:{port} is in use",
        )
        assert "grpc" not in line.lower()
        assert_refused(
            run_kvstored(start_args(tmp_path, sock_dir, metrics_listen=f"127.0.0.1:{port}")),
            "metrics_listen", f"127.0.0.1:{port} is in use",
        )
    assert list((tmp_path / "arena").iterdir()) == []
    assert not (tmp_path / "disk" / "data.mdb").exists()


def test_an_unreadable_shared_password_file_is_refused(tmp_path: Path, sock_dir: Path) -> None:
    missing = tmp_path / "no-such.password"
    args = start_args(
        tmp_path, sock_dir, shared_url="redis://kvstore@127.0.0.1:7000",
        shared_password_file=str(missing),
    )  # fmt: skip
    assert_refused(
        run_kvstored(args), "shared_password_file",
        f"cannot read the shared tier's password from {missing}",
    )  # fmt: skip


def test_a_shared_key_file_others_may_read_or_too_short_is_refused(
    tmp_path: Path, sock_dir: Path
) -> None:
    key = tmp_path / "shared.key"
    key.write_text("0123456789abcdef" * 4 + "\n")
    key.chmod(0o604)
    args = start_args(
        tmp_path, sock_dir, shared_url="redis://127.0.0.1:7000", shared_key_file=str(key)
    )
    assert_refused(run_kvstored(args), "shared_key_file", "open to other users (mode 0604")
    key.chmod(0o600)
    key.write_text("short\n")
    assert_refused(run_kvstored(args), "shared_key_file", "at least 32 characters")


def test_a_path_in_place_of_the_socket_is_refused_and_kept(
    tmp_path: Path, sock_dir: Path
) -> None:
    (sock_dir / "kvstored.sock").write_text("not a socket")
    assert_refused(run_kvstored(start_args(tmp_path, sock_dir)), "listen", "is not a socket")
    assert (sock_dir / "kvstored.sock").read_text() == "not a socket"


def test_the_automatic_disk_size_is_kept_from_the_first_start(
    tmp_path: Path, kvstored_factory: object
) -> None:
    daemon: Daemon = kvstored_factory(  # type: ignore[operator]
        disk_bytes=None, host_bytes=None, prefault_arena=None
    )
    daemon.stop()
    kept_file = Path(daemon.disk_dir) / kvconfig.DISK_SIZE_FILE
    kept = kvconfig.kept_disk_bytes(daemon.disk_dir)
    assert kept is not None and kept >= preflight.MIN_AUTO_DISK_BYTES, kept_file.read_text()
    # the start-up log states the sizes chosen and the keys that change them
    defaults = [line for line in daemon.output().splitlines() if "defaults in use" in line]
    assert len(defaults) == 1, daemon.output()
    for words in ("host_bytes", "disk_bytes", str(kept_file), "prefault_arena", "--print-config"):
        assert words in defaults[0], defaults[0]

    # a later start keeps the size whatever the free space says now, and says so
    kept_file.write_text(kept_file.read_text().replace(str(kept), str(kept - (1 << 20))))
    cfg, _ = kvconfig.load_config(["--disk-dir", daemon.disk_dir], env={})
    assert cfg.disk_bytes == kept - (1 << 20)
    assert cfg.sources["disk_bytes"].startswith("default (auto, kept in disk_dir/")
    # a configured size wins over the kept one
    cfg, _ = kvconfig.load_config(["--disk-dir", daemon.disk_dir, "--disk-bytes", "1GiB"], env={})
    assert cfg.disk_bytes == 1 << 30


def test_an_automatic_disk_size_on_a_small_or_a_full_file_system(
    tmp_path: Path, sock_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hostinfo, "disk_free_bytes", lambda _path: 100 << 20)
    monkeypatch.setattr(hostinfo, "disk_size_bytes", lambda _path: 200 << 20)  # all too small
    (tmp_path / "arena").mkdir()
    args = ["--disk-dir", str(tmp_path / "disk"), "--arena-dir", str(tmp_path / "arena"),
            "--listen", f"unix://{sock_dir}/kvstored.sock", "--host-bytes", "64MiB"]
    cfg, _ = kvconfig.load_config(args, env={})
    assert cfg.sources["disk_bytes"] == "default (auto)" and cfg.disk_bytes == 25 << 20
    with pytest.raises(kvconfig.ConfigError, match=r"^disk_bytes: 25% of the free space"):
        preflight.check(cfg)
    assert not (tmp_path / "disk" / kvconfig.DISK_SIZE_FILE).exists()
    # turned off on purpose: no error, nothing created
    off = dataclasses.replace(
        cfg, disk_bytes=0, sources={**cfg.sources, "disk_bytes": "flag --disk-bytes"}
    )
    preflight.check(off)
    # a large file system that is full: 25% of its size for this start (the tier waits
    # for room), chosen again at the next start: nothing kept
    monkeypatch.setattr(hostinfo, "disk_size_bytes", lambda _path: 100 << 30)
    cfg, _ = kvconfig.load_config(args, env={})
    assert cfg.disk_bytes == 25 << 30
    assert cfg.sources["disk_bytes"] == f"default (auto: {kvconfig.FULL_DISK_SOURCE})"
    preflight.check(cfg)
    assert not (tmp_path / "disk" / kvconfig.DISK_SIZE_FILE).exists()
