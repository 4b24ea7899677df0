"""kvstored configuration: the key table, the four layers, and one-line errors (exit 2).

Most checks run ``python -m kvstored --print-config`` (no store, no socket), parse its
TOML output and read each line's source comment.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from conftest import write_secret

from kvstored import config
from kvstored.main import main


def run_kvstored(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORED_")}
    return subprocess.run(
        [sys.executable, "-m", "kvstored", *args],
        capture_output=True,
        text=True,
        env={**clean, **(env or {})},
        cwd=cwd,
        timeout=60,
    )


def run_main(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    *args: str,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``kvstored.main.main(args)`` in this process (fast), as a CompletedProcess."""
    for name in list(os.environ):
        if name.startswith("KVSTORED_"):
            monkeypatch.delenv(name)
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), code, out, err)


def printed(proc: subprocess.CompletedProcess[str]) -> tuple[dict[str, object], dict[str, str]]:
    """--print-config output -> (values, source of each key)."""
    assert proc.returncode == 0, proc.stderr
    values = tomllib.loads(proc.stdout)
    sources = {}
    for line in proc.stdout.splitlines():
        if line and not line.startswith("#"):
            key, _, rest = line.partition(" = ")
            sources[key] = rest.split("# ", 1)[1].split("  (")[0]
    return values, sources


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("4096", 4096),
        ("64MiB", 64 << 20),
        ("64 MiB", 64 << 20),
        ("1.5GiB", 3 << 29),
        ("2 tib", 2 << 40),
        ("512KiB", 512 << 10),
        (123, 123),
    ],
)
def test_sizes_parse(text: object, expected: int) -> None:
    assert config.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "12XB", "1 MB", "-5", "1.3 B", "MiB", True, "1e9"])
def test_bad_sizes_are_refused(text: object) -> None:
    with pytest.raises(ValueError):
        config.parse_size(text)


def test_every_key_is_a_toml_key_an_env_var_and_a_flag() -> None:
    parser = config.build_arg_parser()
    flags = {opt for action in parser._actions for opt in action.option_strings}
    for key in config.KEYS:
        assert key.env == "KVSTORED_" + key.name.upper()
        assert key.flag in flags and f"--{key.name}" in flags
        assert key.help
    required = {
        "listen", "host_bytes", "disk_dir", "disk_bytes", "admission", "lease_ttl_s",
        "max_message_bytes", "log_level", "arena_dir",
    }
    assert required <= set(config.KEYS_BY_NAME)


def test_print_config_precedence_file_then_env_then_flag(tmp_path: Path) -> None:
    # a real process: the layers as an operator meets them
    toml = tmp_path / "kvstored.toml"
    toml.write_text(
        'host_bytes = "128MiB"\n'
        'disk_bytes = "1GiB"\n'
        'admission = "write-through"\n'
        "lease_ttl_s = 5\n"
        f'disk_dir = "{tmp_path / "disk"}"\n'
    )
    proc = run_kvstored(
        "--config", str(toml), "--print-config", "--lease-ttl-s", "7", "--admission", "selective",
        env={"KVSTORED_DISK_BYTES": "2GiB", "KVSTORED_LEASE_TTL_S": "6"},
    )
    values, sources = printed(proc)
    # file only
    assert values["host_bytes"] == 128 << 20 and sources["host_bytes"] == f"file {toml}"
    # file < env
    assert values["disk_bytes"] == 2 << 30 and sources["disk_bytes"] == "env KVSTORED_DISK_BYTES"
    # file < env < flag
    assert values["lease_ttl_s"] == 7.0 and sources["lease_ttl_s"] == "flag --lease-ttl-s"
    assert values["admission"] == "selective" and sources["admission"] == "flag --admission"
    # untouched
    assert values["log_level"] == "info" and sources["log_level"] == "default"


def test_printed_config_is_loadable_as_a_config_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    proc = run_main(monkeypatch, capsys, "--print-config", "--host-bytes", "96MiB")
    first, _ = printed(proc)
    saved = tmp_path / "saved.toml"
    saved.write_text(proc.stdout)
    proc = run_main(monkeypatch, capsys, "--config", str(saved), "--print-config")
    again, sources = printed(proc)
    assert again == first
    assert sources["host_bytes"] == f"file {saved}"


def test_defaults_follow_xdg_dirs_and_machine_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    env = {"XDG_RUNTIME_DIR": str(tmp_path), "XDG_DATA_HOME": str(tmp_path / "data")}
    values, sources = printed(run_main(monkeypatch, capsys, "--print-config", env=env))
    assert values["listen"] == f"unix://{tmp_path}/kvstore/kvstored.sock"
    assert values["disk_dir"] == str(tmp_path / "data" / "kvstore")
    assert 64 << 20 <= values["host_bytes"] <= 4 << 30  # type: ignore[operator]
    assert values["arena_dir"] == "/dev/shm"  # what the README says, not ""
    assert 0 <= values["disk_bytes"] <= 64 << 30  # type: ignore[operator]
    assert sources["host_bytes"] == "default (auto)"
    # without XDG_RUNTIME_DIR: /tmp/kvstore-<uid>
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    values, _ = printed(run_main(monkeypatch, capsys, "--print-config"))
    assert values["listen"] == f"unix:///tmp/kvstore-{os.getuid()}/kvstored.sock"


def test_default_socket_path_is_importable_without_grpc() -> None:
    code = (
        "import sys; from kvstored.paths import default_socket_path; "
        "print(default_socket_path()); "
        "assert 'grpc' not in sys.modules, sorted(m for m in sys.modules if 'grpc' in m)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "XDG_RUNTIME_DIR": "/run/user/4242"},
    )
    assert proc.returncode == 0, proc.stderr
    # /run/user/4242 does not exist here: falls back to /tmp
    assert proc.stdout.strip() == f"/tmp/kvstore-{os.getuid()}/kvstored.sock"


@pytest.mark.parametrize(
    ("args", "env", "key"),
    [
        (["--host-bytes", "12XB"], {}, "host_bytes"),
        (["--host-bytes", "512KiB"], {}, "host_bytes"),
        (["--admission", "sometimes"], {}, "admission"),
        (["--lease-ttl-s", "-1"], {}, "lease_ttl_s"),
        (["--lease-ttl-s", "nan"], {}, "lease_ttl_s"),
        (["--listen", "unix://relative.sock"], {}, "listen"),
        (["--listen", "localhost"], {}, "listen"),
        (["--listen", "unix:///" + "x" * 120], {}, "listen"),
        (["--max-message-bytes", "1MiB"], {}, "max_message_bytes"),
        (["--log-level", "loud"], {}, "log_level"),
        (["--shared-arena", "maybe"], {}, "shared_arena"),
        (["--local-calls", "maybe"], {}, "local_calls"),
        (["--max-connections-per-user", "0"], {}, "max_connections_per_user"),
        (["--max-connections-per-user", "many"], {}, "max_connections_per_user"),
        (["--socket-mode", "0644"], {}, "socket_mode"),
        (["--socket-mode", "0666"], {}, "socket_mode"),  # without tokens
        ([], {"KVSTORED_PREFAULT_ARENA": "sometimes"}, "prefault_arena"),
        ([], {"KVSTORED_DISK_BYTES": "lots"}, "disk_bytes"),
        ([], {"KVSTORED_HOSTBYTES": "1GiB"}, "KVSTORED_HOSTBYTES"),
        (["--lease-ttl-s", "900"], {}, "lease_ttl_s"),  # > max_lease_ttl_s
        (["--no-such-flag", "1"], {}, "arguments"),
        (["--shared-url", "http://127.0.0.1:7000"], {}, "shared_url"),
        (["--shared-url", "redis://u:secret@127.0.0.1:7000"], {}, "shared_url"),
        (["--shared-url", "redis://127.0.0.1:99999"], {}, "shared_url"),
        ([], {"KVSTORED_SHARED_TIMEOUT_MS": "0"}, "shared_timeout_ms"),
        (["--shared-password-file", "/nonexistent"], {}, "shared_password_file"),
        (["--shared-key-file", "/nonexistent"], {}, "shared_key_file"),  # no shared_url
        (["--tenant-max-namespaces", "-1"], {}, "tenant_max_namespaces"),
        (["--put-wait-ms", "-1"], {}, "put_wait_ms"),
        (["--overflow", "sometimes"], {}, "overflow"),
        (["--persist-timeout-s", "-1"], {}, "persist_timeout_s"),
        ([], {"KVSTORED_SYNC_INDEX_BYTES": "lots"}, "sync_index_bytes"),
        (["--shared-queue-bytes", "512KiB"], {}, "shared_queue_bytes"),
        (["--shared-overflow", "block"], {}, "shared_overflow"),
        (["--codec-tiers", "disk,host"], {}, "codec_tiers"),
        (["--codec-tiers", "disk,tape"], {}, "codec_tiers"),
        (["--kv-events-listen", "127.0.0.1:5557"], {}, "kv_events_listen"),
        ([], {"KVSTORED_KV_EVENTS_REPLAY_LISTEN": "tcp://nohost"}, "kv_events_replay_listen"),
        (["--kv-events-encoding", "json"], {}, "kv_events_encoding"),
        (["--kv-events-hashes", "hex"], {}, "kv_events_hashes"),
    ],
)
def test_bad_values_exit_2_with_one_line_naming_the_key(
    args: list[str],
    env: dict[str, str],
    key: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    proc = run_main(monkeypatch, capsys, *args, "--print-config", env=env)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"kvstored: error: {key}: "), lines[0]
    assert proc.stdout == ""


def test_bad_config_file_exits_2_naming_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    toml = tmp_path / "bad.toml"
    toml.write_text('host_bytes = "64MiB"\nhost_byte = "1GiB"\n')
    # a real process: exit status and stderr as the shell sees them
    proc = run_kvstored("--config", str(toml))
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"kvstored: error: host_byte: unknown setting (from file {toml})"

    toml.write_text("disk_bytes = true\n")
    proc = run_main(monkeypatch, capsys, "--config", str(toml))
    assert proc.returncode == 2 and "disk_bytes:" in proc.stderr

    toml.write_text("disk_bytes = \n")
    proc = run_main(monkeypatch, capsys, "--config", str(toml))
    assert proc.returncode == 2 and "is not valid TOML" in proc.stderr

    proc = run_main(monkeypatch, capsys, "--config", str(tmp_path / "missing.toml"))
    assert proc.returncode == 2 and "config: cannot read" in proc.stderr


def test_main_in_process_prints_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--print-config", "--host-bytes", "1GiB", "--disk-bytes", "0"]) == 0
    out = capsys.readouterr().out
    assert "host_bytes = 1073741824  # flag --host-bytes  (1 GiB)" in out
    assert main(["--host-bytes", "?"]) == 2
    assert capsys.readouterr().err.startswith("kvstored: error: host_bytes: invalid size '?'")


def test_help_lists_every_key(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    for key in config.KEYS:
        assert key.flag in out


@pytest.mark.parametrize(
    ("table", "problem"),
    [
        ('[tenants.Team]\ntoken_file = "/t"\n', "'Team' is not a tenant name"),
        ('[tenants.a]\ntoken_file = "/t"\nhost = 1\n', "tenants.a: unknown key 'host'"),
        ("[tenants.a]\nhost_bytes = 1\n", "tenants.a: token_file is required"),
        ('[tenants.a]\ntoken_file = "/t"\nhost_bytes = "lots"\n', "tenants.a: invalid size"),
        ('tenants = "a"\n', "expected a table of [tenants.<name>] tables"),
        ('[tenants.a]\ntoken_file = "/t"\nevents_topic = 5\n', "events_topic must be a string"),
    ],
)
def test_bad_tenant_tables_exit_2_with_one_line(
    table: str, problem: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    toml = tmp_path / "tenants.toml"
    toml.write_text(table)
    proc = run_main(monkeypatch, capsys, "--config", str(toml), "--print-config")
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvstored: error: tenants: "), proc.stderr
    assert problem in lines[0]


def test_host_quotas_beyond_the_arena_exit_2_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A host quota is the tenant's own arena region: they must fit host_bytes."""
    toml = tmp_path / "tenants.toml"
    toml.write_text(
        'host_bytes = "64 MiB"\n[tenants.a]\ntoken_file = "/t"\nhost_bytes = "64 MiB"\n'
    )
    proc = run_main(monkeypatch, capsys, "--config", str(toml), "--print-config")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().startswith("kvstored: error: host_bytes: 64.0 MiB cannot hold")


@pytest.mark.parametrize(
    ("tokens", "problem"),
    [
        ({"a": None}, "cannot read the token of tenant a from"),
        ({"a": "world-readable-token"}, "is open to other users (mode 0644"),
        ({"a": "short"}, "must be at least 16 characters"),
        ({"a": "x" * 20, "b": "x" * 20}, "tenant b and tenant a have the same token"),
    ],
)
def test_unusable_token_files_stop_start_up_with_one_line(
    tokens: dict[str, str | None], problem: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """Checked before anything is allocated: exit 2, nothing made but the socket dir."""
    lines = []
    for name, token in tokens.items():
        path = tmp_path / f"{name}.token"
        if token is not None:
            write_secret(path, token)
            if token.startswith("world-readable"):
                path.chmod(0o644)
        lines.append(f'[tenants.{name}]\ntoken_file = "{path}"\n')
    toml = tmp_path / "kvstored.toml"
    toml.write_text("".join(lines))
    sock = tmp_path / "run" / "kvstored.sock"
    proc = run_main(
        monkeypatch, capsys, "--config", str(toml), "--listen", f"unix://{sock}",
        "--disk-bytes", "0", "--host-bytes", "64MiB", "--metrics-listen", "off",
    )
    assert proc.returncode == 2
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvstored: error: tenants: "), proc.stderr
    assert problem in err[0]
    assert not sock.exists()


def test_the_default_host_bytes_does_not_move_with_free_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """25% of the machine's memory: restarts get one size whatever is free at the time;
    only memory too short for it (less than twice the size available) lowers it."""
    from kvstored import config as kvconfig
    from kvstored import hostinfo

    def auto(total_gib: float, available_gib: float) -> int:
        monkeypatch.setattr(hostinfo, "mem_total_bytes", lambda: int(total_gib * (1 << 30)))
        monkeypatch.setattr(hostinfo, "mem_available_bytes", lambda: int(available_gib * (1 << 30)))
        return kvconfig._auto_host_bytes({})

    assert {auto(23, free) for free in (19, 12.4, 11.2)} == {4 << 30}  # the starts
    assert {auto(8, free) for free in (7, 5, 4)} == {2 << 30}
    assert auto(8, 1) == 512 << 20  # memory that short: half of what is available
    assert auto(0.1, 0.1) == 64 << 20  # never below 64 MiB


HUGE = str(1 << 63)  # 8 EiB, 2^63


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("host_bytes", "9" * 400),
        ("host_bytes", "9" * 400 + ".5 TiB"),  # a float past the largest double
        ("disk_bytes", HUGE),
        ("max_staged_bytes", HUGE),
        ("disk_queue_bytes", HUGE),
        ("window_bytes", HUGE),
        ("max_transfer_bytes", HUGE),
        ("sync_index_bytes", HUGE),
        ("shared_queue_bytes", HUGE),
        ("selective_hits", HUGE),
        ("put_wait_ms", "100000000000000000000"),  # 1e20
        ("event_buffer", HUGE),
        ("tenant_max_namespaces", HUGE),
        ("shared_ttl_s", HUGE),
        ("max_lease_ttl_s", "1e300"),
        ("write_through_wait_s", "1e300"),
        ("persist_timeout_s", "1e300"),
        ("grace_s", "1e300"),
    ],
)
def test_absurd_values_exit_2_with_one_line_naming_the_key(
    key: str, value: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every number has an upper bound in its row of the key table, however it is given."""
    flag = config.KEYS_BY_NAME[key].flag
    proc = run_main(monkeypatch, capsys, flag, value, "--print-config")
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvstored: error: {key}: "), proc.stderr
    assert "must be" in lines[0] or "invalid size" in lines[0], lines[0]


def test_every_number_has_an_upper_bound() -> None:
    """A value past each key's bound is refused by the row's own check."""
    numeric = [k for k in config.KEYS if k.type in ("size", "int", "float")]
    assert {k.name for k in numeric} >= {"host_bytes", "grace_s", "put_wait_ms"}
    for key in numeric:
        assert key.check is not None and key.check(1 << 63), key.name


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("host_bytes = " + "9" * 400 + "\n", "host_bytes: "),
        ("a = " + "[" * 5000 + "]" * 5000 + "\n", "is nested too deeply"),
        ("host_bytes = " + "9" * 5000 + "\n", "is not valid TOML"),
        (b'host_bytes = "64 MiB"\n# caf\xe9\n', "is not UTF-8 text"),
    ],
)
def test_unparsable_config_files_exit_2_with_one_line(
    text: str | bytes, problem: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    toml = tmp_path / "kvstored.toml"
    toml.write_bytes(text if isinstance(text, bytes) else text.encode())
    proc = run_main(monkeypatch, capsys, "--config", str(toml), "--print-config")
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and problem in lines[0], proc.stderr


@pytest.mark.parametrize(
    ("table", "problem"),
    [
        ('disk_bytes = "1 GiB"\n[tenants.a]\ndisk_bytes = "2 GiB"\n',
         "tenants.a: disk_bytes 2.0 GiB is more than the disk tier holds"),
        ("disk_bytes = 0\n[tenants.a]\ndisk_bytes = " + "9" * 400 + "\n",
         "tenants.a: disk_bytes must be in [0, 1024 TiB], got 999999999999... (400 digits)"),
        ("[tenants.a]\nhost_bytes = " + "9" * 400 + "\n",
         "tenants.a: host_bytes must be in [0, 1024 TiB]"),
    ],
)  # fmt: skip
def test_tenant_quotas_past_the_disk_or_absurd_exit_2(
    table: str, problem: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    toml = tmp_path / "tenants.toml"
    toml.write_text(table.replace("[tenants.a]\n", '[tenants.a]\ntoken_file = "/t"\n'))
    proc = run_main(monkeypatch, capsys, "--config", str(toml), "--print-config")
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"kvstored: error: tenants: {problem}"), lines


@pytest.mark.parametrize("kind", ["device", "fifo", "large", "directory"])
def test_token_and_config_files_are_read_only_when_regular_and_small(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An admin token file that is /dev/zero (read without end), a FIFO (a read that
    blocks), a file of megabytes or a directory: one line, exit 2, at once."""
    path = tmp_path / "admin.token"
    if kind == "device":
        path = Path("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(path, 0o600)
    elif kind == "large":
        write_secret(path, "x" * (2 << 20))
    else:
        path.mkdir(mode=0o700)
    sock = tmp_path / "run" / "kvstored.sock"
    proc = run_main(
        monkeypatch, capsys, "--admin-token-file", str(path), "--listen", f"unix://{sock}",
        "--disk-bytes", "0", "--host-bytes", "64MiB", "--metrics-listen", "off",
    )  # fmt: skip
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvstored: error: admin_token_file: "), lines
    assert "not a regular file" in lines[0] or "more than 4096 bytes" in lines[0], lines[0]
    if kind in ("device", "large"):  # a config file is bounded too
        proc = run_main(monkeypatch, capsys, "--config", str(path), "--print-config")
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
        assert "config: " in proc.stderr and "more than" in proc.stderr, proc.stderr
