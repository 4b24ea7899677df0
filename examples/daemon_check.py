"""The examples' first step: make sure there is a kvstored to talk to, before loading
any model, and say so in one line when there is not."""

from __future__ import annotations

import sys

from kvclient import KVClient, KVStoreError


def daemon_address(addr: str | None, program: str) -> str | None:
    """The address of the kvstored at ``addr`` (None: KVSTORE_ADDR or the default
    socket), or None after one line on stderr when none answers."""
    try:
        with KVClient(addr, timeout=2.0) as client:
            client.server_info()
            return client.addr
    except KVStoreError as exc:
        print(f"{program}: no kvstored to talk to ({exc}); start one with `kvstored`",
              file=sys.stderr)
        return None
