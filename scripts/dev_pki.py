"""A throw-away certificate authority for trying TLS (:mod:`kvbench.pki`).

    .venv/bin/python scripts/dev_pki.py DIR [--name HOST ...]
    kvstored --listen 127.0.0.1:7070 --tls-cert DIR/server.pem --tls-key DIR/server.key \\
             [--tls-client-ca DIR/ca.pem]
    KVSTORE_TLS_CA=DIR/ca.pem [KVSTORE_TLS_CERT=DIR/client.pem KVSTORE_TLS_KEY=DIR/client.key]

For tests and a first try only: the keys are unencrypted and the CA's key sits next to
them. Production certificates come from your own CA (cert-manager, Vault, ...).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvbench.pki import make_pki


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="where the PEM files go (created)")
    parser.add_argument("--name", action="append", default=[], help="another server name")
    args = parser.parse_args()
    args.folder.mkdir(parents=True, exist_ok=True)
    for what, path in make_pki(args.folder, tuple(args.name)).items():
        print(f"{what:12} {path}")


if __name__ == "__main__":
    main()
