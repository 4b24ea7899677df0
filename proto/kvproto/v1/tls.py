"""TLS settings for a TCP daemon, as its clients and its health check see them.

The environment names them (``$KVSTORE_TLS_CA``, ``$KVSTORE_TLS_CERT``,
``$KVSTORE_TLS_KEY``, ``$KVSTORE_TLS_SERVER_NAME``) for every process that dials the
daemon: kvclient, kvctl and ``python -m kvstored.healthcheck``. A setting that cannot
be used raises ValueError with one line that names it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

TLS_CA_ENV = "KVSTORE_TLS_CA"
TLS_CERT_ENV = "KVSTORE_TLS_CERT"
TLS_KEY_ENV = "KVSTORE_TLS_KEY"
TLS_SERVER_NAME_ENV = "KVSTORE_TLS_SERVER_NAME"


@dataclass(frozen=True, slots=True)
class TLS:
    """TLS settings for a TCP daemon. ``ca_file``: PEM of the CA that signed the
    daemon's certificate ("" for the system's roots); ``cert_file``/``key_file``: this
    client's certificate (mutual TLS); ``server_name``: the name to check the daemon's
    certificate against when it differs from the address's host."""

    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    server_name: str = ""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> TLS | None:
        ca, cert, key = env.get(TLS_CA_ENV, ""), env.get(TLS_CERT_ENV, ""), env.get(TLS_KEY_ENV, "")
        if not (ca or cert or key):
            return None
        return cls(ca, cert, key, env.get(TLS_SERVER_NAME_ENV, ""))

    def channel_credentials(self) -> grpc.ChannelCredentials:
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("TLS: a client certificate needs its key, and the reverse")
        return grpc.ssl_channel_credentials(
            root_certificates=read_file(self.ca_file, "the TLS CA") if self.ca_file else None,
            private_key=read_file(self.key_file, "the TLS key") if self.key_file else None,
            certificate_chain=(
                read_file(self.cert_file, "the TLS cert") if self.cert_file else None
            ),
        )

    def channel_options(self) -> list[tuple[str, str]]:
        """The gRPC channel options these settings need."""
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def read_file(path: str, what: str) -> bytes:
    """A settings file's bytes; ValueError naming ``what`` and the path otherwise."""
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read {what} from {path}: {exc.strerror}") from None
