"""``python -m kvstored.healthcheck``: exit 0 when the daemon's gRPC health says SERVING.

For probes that run a command: Docker's HEALTHCHECK and Kubernetes exec probes. The
daemon listens on a unix socket and TCP only when asked (its API has no
authentication), while Kubernetes' built-in gRPC and HTTP probes dial the pod's IP
from the node; a command inside the container reaches the socket instead.

Which daemon: ``--addr``, else ``$KVSTORE_ADDR`` (as for kvclient), else the
daemon's own ``listen`` setting read the way the daemon reads it, from
``$KVSTORED_LISTEN`` or the ``$KVSTORED_CONFIG`` file, else the default socket. So in
the daemon's own container, with its own environment, no argument is needed.

A daemon serving TLS on TCP: the probe speaks TLS when ``$KVSTORE_TLS_CA`` names the
CA that signed the daemon's certificate (with ``$KVSTORE_TLS_CERT`` / ``_KEY`` when it
asks for client certificates, ``$KVSTORE_TLS_SERVER_NAME`` when the certificate does
not name ``localhost``), as for kvclient. The health service needs no token.

Exit status: 0 SERVING; 1 anything else (NOT_SERVING while draining, unreachable,
timed out), with one line on stderr saying which; 2 a bad argument.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvproto.v1.tls import TLS
from kvstored import config, paths


def daemon_address(env: Mapping[str, str]) -> str:
    """The gRPC target of the daemon this environment configures."""
    if env.get("KVSTORE_ADDR"):
        target = env["KVSTORE_ADDR"]
        return "unix://" + target if target.startswith("/") else target
    listen: object = env.get(config.KEYS_BY_NAME["listen"].env, "")
    config_file = env.get(config.CONFIG_ENV, "")
    if not listen and config_file:
        listen = config._read_toml(config_file).get("listen", "")
    if not listen:
        return paths.default_address()
    address = config.parse_address(listen)
    host, sep, port = address.rpartition(":")
    if paths.socket_path_of(address) is None and host in ("0.0.0.0", "[::]"):
        return f"localhost{sep}{port}"  # a wildcard TCP listen is reached on loopback
    return address


def check(addr: str, service: str, timeout: float) -> tuple[bool, str]:
    """-> (serving, what to print)."""
    tls = TLS.from_env(os.environ) if paths.socket_path_of(addr) is None else None
    if tls is not None:
        channel = grpc.secure_channel(addr, tls.channel_credentials(), tls.channel_options())
    else:
        channel = grpc.insecure_channel(addr)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            code = exc.code()  # type: ignore[attr-defined]
            return False, f"{addr}: {code.name if code else 'error'}: {exc.details()}"  # type: ignore[attr-defined]
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, f"{addr}: {status}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvstored.healthcheck",
        description="Exit 0 when kvstored's gRPC health check answers SERVING.",
    )
    parser.add_argument("--addr", help="unix:///path or host:port (default: see module doc)")
    parser.add_argument(
        "--service", default="", help='health service name ("" = the whole daemon)'
    )
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds (default 3)")
    parser.add_argument("--quiet", "-q", action="store_true", help="print nothing on success")
    args = parser.parse_args(argv)
    try:
        addr = args.addr or daemon_address(os.environ)
    except (ValueError, config.ConfigError) as exc:
        print(f"healthcheck: {exc}", file=sys.stderr)
        return 2
    serving, line = check(addr, args.service, args.timeout)
    if not serving:
        print(f"healthcheck: {line}", file=sys.stderr)
        return 1
    if not args.quiet:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
