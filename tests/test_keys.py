"""Namespaces and block keys: deterministic, chained, validated."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from kvstore.errors import InvalidArgument
from kvstore.keys import (
    BLOCK_EXTRA_TAG,
    NamespaceSpec,
    block_extra_key,
    chain_keys,
    encode_extra,
)

LLAMA = dict(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16")


def test_block_bytes_derived_from_layout() -> None:
    # Llama-3-8B: 2 (K,V) x 32 layers x 8 heads x 128 dims x 2 bytes = 128 KiB per token
    spec = NamespaceSpec("llama3-8b", block_tokens=16, **LLAMA)
    assert spec.block_bytes == 16 * 128 * 1024


def test_layout_and_block_bytes_must_agree() -> None:
    with pytest.raises(InvalidArgument, match="does not match the layout"):
        NamespaceSpec("llama3-8b", block_tokens=16, block_bytes=1000, **LLAMA)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(block_tokens=1, block_bytes=64), "block_tokens"),
        (dict(block_tokens=257, block_bytes=64), "block_tokens"),
        (dict(block_bytes=0), "block_bytes is required"),
        (dict(block_bytes=64, dtype="float64"), "dtype"),
        (dict(block_bytes=64, hash_algorithm="md5"), "hash_algorithm"),
        (dict(block_bytes=64, rank=2, world_size=2), "rank"),
    ],
)
def test_bad_specs_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        NamespaceSpec("m", **kwargs)


def test_namespace_digest_covers_every_field() -> None:
    base = NamespaceSpec("m", block_tokens=16, block_bytes=1024)
    variants = [
        NamespaceSpec("m2", block_tokens=16, block_bytes=1024),
        NamespaceSpec("m", block_tokens=8, block_bytes=1024),
        NamespaceSpec("m", block_tokens=16, block_bytes=2048),
        NamespaceSpec("m", block_tokens=16, block_bytes=1024, tenant_salt="acme"),
        NamespaceSpec("m", block_tokens=16, block_bytes=1024, rank=1, world_size=2),
        NamespaceSpec("m", block_tokens=16, block_bytes=1024, hash_algorithm="xxh3-128"),
    ]
    digests = {base.digest} | {v.digest for v in variants}
    assert len(digests) == len(variants) + 1


@pytest.mark.parametrize("algorithm, width", [("sha256", 32), ("xxh3-128", 16)])
def test_chain_covers_full_blocks_only(algorithm: str, width: int) -> None:
    spec = NamespaceSpec("m", block_tokens=4, block_bytes=64, hash_algorithm=algorithm)
    keys = chain_keys(spec, list(range(11)))  # 2 full blocks + 3 spare tokens
    assert len(keys) == 2
    assert all(len(k) == width for k in keys)
    assert chain_keys(spec, list(range(3))) == []


def test_keys_are_chained_prefixes() -> None:
    spec = NamespaceSpec("m", block_tokens=4, block_bytes=64)
    a = chain_keys(spec, [1, 2, 3, 4, 5, 6, 7, 8])
    b = chain_keys(spec, [1, 2, 3, 4, 5, 6, 7, 9])  # diverges in block 1
    c = chain_keys(spec, [0, 2, 3, 4, 5, 6, 7, 8])  # diverges in block 0
    assert a[0] == b[0] and a[1] != b[1]
    assert c[0] != a[0] and c[1] != a[1]  # same tokens in block 1, different parent


def test_extra_keys_separate_chains() -> None:
    spec = NamespaceSpec("m", block_tokens=4, block_bytes=64)
    tokens = list(range(8))
    plain = chain_keys(spec, tokens)
    lora = chain_keys(spec, tokens, extra=["lora-7"])
    image = chain_keys(spec, tokens, block_extra={1: [b"\x01" * 16]})
    assert plain[0] != lora[0]
    assert image[0] == plain[0] and image[1] != plain[1]
    # the encoding is unambiguous: [ab] differs from [a, b]
    assert encode_extra(["ab"]) != encode_extra(["a", "b"])


def test_block_extra_keys_travel_in_the_one_wire_list() -> None:
    """A request carries one list of extra keys; a block's own travel in it as tagged
    entries, and key the chain exactly as ``block_extra`` does."""
    spec = NamespaceSpec("m", block_tokens=4, block_bytes=64)
    tokens = list(range(12))
    by_argument = chain_keys(spec, tokens, extra=["lora"], block_extra={1: [b"img", 4]})
    wired = [block_extra_key(1, [b"img", 4]), "lora"]  # any order
    assert chain_keys(spec, tokens, extra=wired) == by_argument
    assert chain_keys(spec, tokens, extra=["lora"])[0] == by_argument[0]
    assert chain_keys(spec, tokens, extra=["lora"])[1] != by_argument[1]
    # what a daemon without them did: the entry mixed into every block (no match)
    assert chain_keys(spec, tokens, extra=["lora", b"img"])[0] != by_argument[0]
    good = block_extra_key(2, ["x"])
    for bad, message in [
        (good[:-1], "cut short"),
        (good + b"!", "bytes after"),
        (BLOCK_EXTRA_TAG + b"\x01", "before its block number"),
    ]:
        with pytest.raises(InvalidArgument, match=message):
            chain_keys(spec, tokens, extra=[bad])
    with pytest.raises(InvalidArgument, match="two block extra keys for block 2"):
        chain_keys(spec, tokens, extra=[good, block_extra_key(2, ["y"])])


def test_tenant_salt_isolates() -> None:
    a = NamespaceSpec("m", block_tokens=4, block_bytes=64, tenant_salt="a")
    b = NamespaceSpec("m", block_tokens=4, block_bytes=64, tenant_salt="b")
    assert chain_keys(a, range(8)) != chain_keys(b, range(8))


@pytest.mark.parametrize(
    "tokens", [[-1, 2, 3, 4], [2**32, 1, 2, 3], [[1, 2], [3, 4]], [1.5, 2, 3, 4]]
)
def test_bad_token_ids_are_refused(tokens: list) -> None:
    spec = NamespaceSpec("m", block_tokens=2, block_bytes=64)
    with pytest.raises(InvalidArgument):
        chain_keys(spec, tokens)


def test_vocab_size_bounds_token_ids() -> None:
    spec = NamespaceSpec("m", block_tokens=2, block_bytes=64, vocab_size=100)
    with pytest.raises(InvalidArgument, match="< 100"):
        chain_keys(spec, [1, 100])


def test_numpy_and_list_tokens_agree() -> None:
    spec = NamespaceSpec("m", block_tokens=4, block_bytes=64)
    tokens = list(range(1000, 1064))
    assert chain_keys(spec, tokens) == chain_keys(spec, np.array(tokens, dtype=np.int64))


_CHILD = """
import sys
from kvstore.keys import NamespaceSpec, chain_keys
spec = NamespaceSpec("llama", block_tokens=16, block_bytes=4096, tenant_salt="t",
                     hash_algorithm=sys.argv[1])
print(",".join(k.hex() for k in chain_keys(spec, range(100, 164), extra=["lora"])))
"""


@pytest.mark.parametrize("algorithm", ["sha256", "xxh3-128"])
def test_keys_identical_across_processes_and_hash_seeds(algorithm: str) -> None:
    # the same tokens give the same keys in processes with different PYTHONHASHSEED
    outputs = set()
    for seed in ("0", "1", "12345", "random"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        run = subprocess.run(
            [sys.executable, "-c", _CHILD, algorithm],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        outputs.add(run.stdout.strip())
    assert len(outputs) == 1
    # ... and equal to this process's keys
    spec = NamespaceSpec(
        "llama", block_tokens=16, block_bytes=4096, tenant_salt="t", hash_algorithm=algorithm
    )
    here = ",".join(k.hex() for k in chain_keys(spec, range(100, 164), extra=["lora"]))
    assert outputs == {here}


def test_known_answer_vector() -> None:
    # pinned so that a change of the key format is a deliberate, visible decision
    spec = NamespaceSpec("m", block_tokens=2, block_bytes=64)
    assert spec.digest.hex()[:16] == KNOWN_DIGEST_PREFIX
    assert chain_keys(spec, [1, 2])[0].hex()[:16] == KNOWN_KEY_PREFIX


def test_the_served_model_and_tokenizer_are_labels_not_identity() -> None:
    # a namespace records what serves it and where its tokenizer is (kvctl --text),
    # but blocks stay shared across served names: its digest and ns_id are unchanged
    spec = NamespaceSpec("m", block_tokens=2, block_bytes=64, served_model="chat",
                         tokenizer="/models/m")  # fmt: skip
    assert spec.digest.hex()[:16] == KNOWN_DIGEST_PREFIX
    assert spec.ns_id == NamespaceSpec("m", block_tokens=2, block_bytes=64).ns_id
    assert spec.to_dict()["served_model"] == "chat"  # persisted and sent with the spec
    assert NamespaceSpec.from_dict(spec.to_dict()).tokenizer == "/models/m"
    with pytest.raises(InvalidArgument, match="served_model"):
        NamespaceSpec("m", block_bytes=64, served_model="x" * 257)


KNOWN_DIGEST_PREFIX = "818c9b28e1b92fca"
KNOWN_KEY_PREFIX = "2603d5a082800b61"
