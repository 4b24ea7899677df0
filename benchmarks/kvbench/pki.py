"""A throw-away certificate authority: a CA, a server certificate for 127.0.0.1 /
localhost (and any names given) and a client certificate, as PEM files. For tests, the
benchmarks and a first try of TLS (``scripts/dev_pki.py`` is its command line): the keys
are unencrypted and the CA's key sits next to them. Needs the ``cryptography`` package
(in the ``test`` extra); nothing else in kvbench imports this module.
"""


from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _write_key_and_cert(
    folder: Path, name: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey
) -> tuple[Path, Path]:
    key_path, cert_path = folder / f"{name}.key", folder / f"{name}.pem"
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key_path, cert_path


def make_pki(folder: Path, names: tuple[str, ...] = ()) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1, localhost and ``names``, and a client
    certificate, written into ``folder`` -> their paths."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvstore test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    paths = {"ca": _write_key_and_cert(folder, "ca", ca, ca_key)[1]}
    for name, usage, san in (
        ("server", x509.ExtendedKeyUsageOID.SERVER_AUTH,
         [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
          *(x509.DNSName(n) for n in names)]),
        ("client", x509.ExtendedKeyUsageOID.CLIENT_AUTH, [x509.DNSName("engine-1")]),
    ):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(san), critical=False)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        paths[f"{name}_key"], paths[f"{name}_cert"] = _write_key_and_cert(folder, name, cert, key)
    return paths
