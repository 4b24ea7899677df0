"""TLS and mutual TLS on a TCP daemon, the refusal of an open port without them, and
whose sockets the daemon and the client trust.

Certificates come from a test CA made with the ``cryptography`` package by
kvbench.pki, what scripts/dev_pki.py (the docs' first try of TLS) runs.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import pytest
from conftest import Daemon, write_secret

from kvbench.harness import free_tcp_port
from kvbench.pki import make_pki
from kvclient import TLS, AsyncKVClient, DaemonUnavailableError, KVClient, UntrustedSocketError
from kvclient.errors import InvalidArgumentError
from kvstored.config import ConfigError, load_config

IS_ROOT = os.geteuid() == 0
NOBODY = 65534


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def admin_token(tmp_path: Path) -> tuple[str, Path]:
    token = os.urandom(16).hex()
    path = tmp_path / "admin.token"
    write_secret(path, token)
    return token, path


def tls_daemon(
    factory: Callable[..., Daemon],
    pki: dict[str, Path],
    token_file: Path,
    mutual: bool,
) -> Daemon:
    settings: dict[str, object] = {
        "listen": f"127.0.0.1:{free_tcp_port()}",
        "tls_cert": pki["server_cert"],
        "tls_key": pki["server_key"],
        "admin_token_file": token_file,
    }
    if mutual:
        settings["tls_client_ca"] = pki["ca"]
    daemon = factory(start=False, **settings)
    ca = pki["ca"].read_bytes()
    daemon.credentials = grpc.ssl_channel_credentials(
        ca,
        pki["client_key"].read_bytes() if mutual else None,
        pki["client_cert"].read_bytes() if mutual else None,
    )
    return daemon.start()


def round_trip(client: KVClient) -> int:
    ns = client.namespace("tls-model", block_tokens=4, block_bytes=4096)
    tokens = list(range(12))
    ns.put(tokens, np.full((3, 4096), 5, dtype=np.uint8))
    got = ns.get(tokens)
    assert np.all(got.blocks == 5)
    return got.n_blocks


def test_tls_with_a_token_serves_and_plain_tcp_is_turned_away(
    kvstored_factory: Callable[..., Daemon], pki: dict[str, Path], admin_token: tuple[str, Path]
) -> None:
    token, token_file = admin_token
    daemon = tls_daemon(kvstored_factory, pki, token_file, mutual=False)
    tls = TLS(ca_file=str(pki["ca"]))
    with KVClient(daemon.addr, token=token, tls=tls, use_arena=False, timeout=5) as client:
        assert round_trip(client) == 3
    with KVClient(daemon.addr, token=token, use_arena=False, timeout=2) as plain, pytest.raises(
        DaemonUnavailableError
    ):
        plain.server_info()
    with KVClient(
        daemon.addr, token=token, tls=TLS(ca_file=str(pki["client_cert"])), use_arena=False,
        timeout=2,
    ) as wrong_ca, pytest.raises(DaemonUnavailableError):
        wrong_ca.server_info()  # a server certificate this CA did not sign is refused

    async def async_round_trip() -> int:
        async with AsyncKVClient(daemon.addr, token=token, tls=tls, use_arena=False) as client:
            ns = await client.namespace("tls-model", block_tokens=4, block_bytes=4096)
            return (await ns.get(list(range(12)))).n_blocks

    assert asyncio.run(async_round_trip()) == 3  # the aio channel: TLS and the token
    probe = [sys.executable, "-m", "kvstored.healthcheck", "--addr", daemon.addr, "--timeout", "3"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE")}
    with_ca = subprocess.run(probe, capture_output=True, text=True, timeout=60,
                             env={**env, "KVSTORE_TLS_CA": str(pki["ca"])})
    assert with_ca.returncode == 0 and with_ca.stdout.strip().endswith("SERVING")
    assert subprocess.run(probe, capture_output=True, timeout=60, env=env).returncode == 1


def test_mutual_tls_refuses_a_client_without_a_certificate(
    kvstored_factory: Callable[..., Daemon], pki: dict[str, Path], admin_token: tuple[str, Path]
) -> None:
    token, token_file = admin_token
    daemon = tls_daemon(kvstored_factory, pki, token_file, mutual=True)
    without = TLS(ca_file=str(pki["ca"]))
    with KVClient(
        daemon.addr, token=token, tls=without, use_arena=False, timeout=2
    ) as client, pytest.raises(DaemonUnavailableError):
        client.server_info()
    with_cert = TLS(str(pki["ca"]), str(pki["client_cert"]), str(pki["client_key"]))
    with KVClient(daemon.addr, token=token, tls=with_cert, use_arena=False, timeout=5) as client:
        assert round_trip(client) == 3


def test_an_open_tcp_port_needs_tls_and_tokens_or_insecure(tmp_path: Path) -> None:
    base = ["--disk-bytes", "0", "--host-bytes", "64MiB", "--metrics-listen", "off"]
    wide = ["--listen", f"0.0.0.0:{free_tcp_port()}"]
    refused = subprocess.run(
        [sys.executable, "-m", "kvstored", *wide, *base],
        capture_output=True, text=True, timeout=60,
    )
    assert refused.returncode == 2
    assert refused.stderr.count("\n") == 1
    for key in ("tls_cert", "tls_key", "insecure", "admin_token_file"):
        assert key in refused.stderr
    # the flag lets it through (loaded only: tests never bind beyond loopback)
    config, _ = load_config([*wide, *base, "--insecure"], env={})
    assert config.insecure
    token = tmp_path / "t"
    token.write_text("a" * 32)
    with pytest.raises(ConfigError, match="tls_cert"):  # tokens alone are not enough
        load_config([*wide, *base, "--admin-token-file", str(token)], env={})
    with pytest.raises(ConfigError, match="TLS is for a TCP listen"):
        load_config(["--listen", "unix:///tmp/x.sock", "--tls-cert", "/c", "--tls-key", "/k"],
                    env={})


def test_a_token_is_never_sent_in_clear_text_off_the_host() -> None:
    with pytest.raises(InvalidArgumentError, match="clear text"):
        KVClient("10.11.12.13:5000", token="t" * 32)


def _start_in(kvstored_factory: Callable[..., Daemon], folder: Path) -> Daemon:
    daemon = kvstored_factory(start=False, listen=f"unix://{folder}/kvstored.sock")
    return daemon


def test_the_daemon_refuses_a_socket_directory_others_may_write(
    kvstored_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    folder = Path(os.path.realpath(tmp_path)) / "shared"
    folder.mkdir()
    folder.chmod(0o770)
    daemon = _start_in(kvstored_factory, folder)
    with pytest.raises(Exception, match="exited with 2"):
        daemon.start()
    assert f"the socket directory {folder} is writable by other users" in daemon.output()


@pytest.mark.skipif(not IS_ROOT, reason="giving a directory to another user needs root")
def test_the_daemon_refuses_a_socket_directory_of_another_user(
    kvstored_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    folder = Path(os.path.realpath(tmp_path)) / "theirs"
    folder.mkdir(mode=0o700)
    os.chown(folder, NOBODY, NOBODY)
    daemon = _start_in(kvstored_factory, folder)
    with pytest.raises(Exception, match="exited with 2"):
        daemon.start()
    assert f"belongs to uid {NOBODY}, not to this daemon's user" in daemon.output()


@pytest.mark.skipif(not IS_ROOT, reason="giving a socket to another user needs root")
def test_the_client_refuses_a_socket_of_another_user(kvstored: Daemon) -> None:
    sock = Path(kvstored.socket_path)
    os.chown(sock.parent, NOBODY, NOBODY)
    os.chown(sock, NOBODY, NOBODY)
    try:
        with pytest.raises(UntrustedSocketError, match=f"belongs to uid {NOBODY}"):
            KVClient(kvstored.addr)
        with KVClient(kvstored.addr, socket_owner=NOBODY) as trusting:
            assert trusting.server_info().pid == kvstored.pid
    finally:
        os.chown(sock.parent, 0, 0)
        os.chown(sock, 0, 0)


def test_bad_client_security_settings_are_one_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVSTORE_TOKEN_FILE", str(tmp_path / "missing.token"))
    monkeypatch.delenv("KVSTORE_TOKEN", raising=False)
    with pytest.raises(InvalidArgumentError, match=r"cannot read the token \(\$KVSTORE_TOKEN"):
        KVClient(f"unix://{tmp_path}/kvstored.sock")
    monkeypatch.delenv("KVSTORE_TOKEN_FILE")
    with pytest.raises(InvalidArgumentError, match="'no-such-user-kv' is not a user"):
        KVClient(f"unix://{tmp_path}/kvstored.sock", socket_owner="no-such-user-kv")
    half = TLS(cert_file=str(tmp_path / "client.pem"))
    with pytest.raises(InvalidArgumentError, match="needs its key"):
        KVClient("127.0.0.1:7070", tls=half)
    kvctl = subprocess.run(
        [sys.executable, "-m", "kvctl", "--token-file", str(tmp_path / "nope"), "status"],
        capture_output=True, text=True, timeout=60,
    )
    assert kvctl.returncode == 2 and kvctl.stderr.count("\n") == 1
    assert "cannot read the token file from" in kvctl.stderr


@pytest.mark.parametrize("key", ["kv_events_listen", "kv_events_replay_listen"])
def test_kv_events_beyond_loopback_need_insecure(key: str) -> None:
    """KV events carry prompt token ids: an address other hosts reach is refused
    with one line unless the operator says insecure (#56 item 10)."""
    base = ["--disk-bytes", "0", "--host-bytes", "64MiB", "--metrics-listen", "off"]
    flag = "--" + key.replace("_", "-")
    for wide in ("tcp://0.0.0.0:5557", "tcp://*:5557", "tcp://10.1.2.3:5557"):
        refused = subprocess.run(
            [sys.executable, "-m", "kvstored", *base, flag, wide],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert refused.returncode == 2, refused.stderr
        assert refused.stderr.count("\n") == 1 and key in refused.stderr
        assert "insecure" in refused.stderr
        config, _ = load_config([*base, flag, wide, "--insecure"], env={})
        assert getattr(config, key) == wide
    for near in ("tcp://127.0.0.1:5557", "tcp://localhost:5557", "ipc:///tmp/kv-events"):
        config, _ = load_config([*base, flag, near], env={})
        assert getattr(config, key) == near
