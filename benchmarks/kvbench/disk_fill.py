"""A disk tier filled straight through LMDB, for programs that time or torture a start
on many records (``benchmarks/restart_scale.py``, ``benchmarks/torture.py``): records
in the disk tier's format, under the keys a client's tokens give, written in large
transactions (far faster than puts through a daemon)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

TXN_RECORDS = 100_000  # records per write transaction


def chain_tokens(chain: int, blocks: int, block_tokens: int) -> list[int]:
    """The tokens of filled chain ``chain`` (distinct per chain)."""
    per = blocks * block_tokens
    return [chain * per + t for t in range(per)]


def fill_disk(
    directory: Path,
    chains: int,
    blocks: int,
    spec_fields: dict[str, object],
    payload: Callable[[int, int], bytes],
    progress: Callable[[int], None] | None = None,
) -> None:
    """Write ``chains`` chains of ``blocks`` blocks (``payload(chain, block)`` each) of
    the namespace ``NamespaceSpec(**spec_fields)`` into the disk tier at ``directory``
    (created; no daemon may hold it). Chain ``c`` is ``chain_tokens(c, ...)``'s; a
    chain's blocks share one time of last use, later chains are newer."""
    import lmdb
    import xxhash

    from kvstore.disk import DiskTier
    from kvstore.disk.format import DiskRecord, pack_record
    from kvstore.keys import NamespaceSpec, chain_keys

    spec = NamespaceSpec(**spec_fields)  # type: ignore[arg-type]
    records = chains * blocks
    capacity = records * 3 * (spec.block_bytes + 4096) + (1 << 30)
    tier = DiskTier(str(directory), capacity_bytes=capacity)
    tier.save_namespace(spec.digest, spec.to_dict())
    tier.flush()
    tier.close()
    env = lmdb.open(str(directory), map_size=2 * capacity, max_dbs=8, sync=False)
    meta, values = env.open_db(b"meta"), env.open_db(b"payload")
    now = time.time()
    chain = 0
    while chain < chains:
        with env.begin(write=True) as txn:
            for _ in range(max(1, TXN_RECORDS // blocks)):
                if chain == chains:
                    break
                keys = chain_keys(spec, chain_tokens(chain, blocks, spec.block_tokens))
                used = now - (chains - chain) * 1e-3
                parent = b""
                for i, key in enumerate(keys):
                    value = payload(chain, i)
                    rec = DiskRecord(
                        key, spec.digest, parent, len(value), xxhash.xxh3_64_intdigest(value),
                        35, used,
                    )  # fmt: skip
                    txn.put(key, value, db=values)
                    txn.put(key, pack_record(rec), db=meta)
                    parent = key
                chain += 1
        if progress is not None:
            progress(chain)
    env.sync(True)
    env.close()
