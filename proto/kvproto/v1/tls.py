"""TLS settings for a TCP daemon, as its clients and its health check see them.

The environment names them (``$KVSTORE_TLS_CA``, ``$KVSTORE_TLS_CERT``,
``$KVSTORE_TLS_KEY``, ``$KVSTORE_TLS_SERVER_NAME``) for every process that dials the
daemon: kvclient, kvctl and ``python -m kvstored.healthcheck``. A setting that cannot
be used raises ValueError with one line that names it.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass

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


MAX_SETTINGS_FILE_BYTES = 1 << 20  # a PEM bundle of a few hundred CAs, a config file
MAX_SECRET_FILE_BYTES = 4096  # a token, a password, a key


def read_file(
    path: str, what: str, max_bytes: int = MAX_SETTINGS_FILE_BYTES, regular: bool = True
) -> bytes:
    """A settings file's bytes (:func:`read_file_stat`)."""
    return read_file_stat(path, what, max_bytes, regular)[0]


def read_file_stat(
    path: str, what: str, max_bytes: int = MAX_SETTINGS_FILE_BYTES, regular: bool = True
) -> tuple[bytes, os.stat_result]:
    """A settings file's bytes and its fstat (its mode and owner as read); ValueError
    naming ``what`` and the path otherwise.

    Only a file of at most ``max_bytes`` is read, and with ``regular`` only a regular
    file: a device (``/dev/zero``) would be read without end and a FIFO would block,
    so the file is opened without blocking and checked with fstat before any byte is
    read; without ``regular`` (a config given as ``<(...)``) the read stops one byte
    past ``max_bytes``."""

    def fail(reason: str) -> ValueError:
        return ValueError(f"cannot read {what} from {path}: {reason}")

    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (os.O_NONBLOCK if regular else 0))
    except OSError as exc:
        raise fail(str(exc.strerror)) from None
    try:
        info = os.fstat(fd)
        if regular and not stat.S_ISREG(info.st_mode):
            raise fail("not a regular file")
        if stat.S_ISREG(info.st_mode) and info.st_size > max_bytes:
            raise fail(f"{info.st_size} bytes, more than {max_bytes} bytes")
        pieces: list[bytes] = []
        held = 0
        while held <= max_bytes:  # (to one byte past the bound: a file that grew since)
            piece = os.read(fd, max_bytes + 1 - held)
            if not piece:
                break
            pieces.append(piece)
            held += len(piece)
    except OSError as exc:
        raise fail(str(exc.strerror)) from None
    finally:
        os.close(fd)
    if held > max_bytes:
        raise fail(f"more than {max_bytes} bytes")
    return b"".join(pieces), info
