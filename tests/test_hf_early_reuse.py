"""The transformers adapter with early reuse: waiting, claiming, chunked delivery."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from conftest import Daemon  # noqa: E402

from kvbench.models import random_llama  # noqa: E402
from kvclient import KVClient  # noqa: E402
from kvclient.hf import HFPrefixCache  # noqa: E402

BLOCK_TOKENS = 8


def prompt(n: int, seed: int = 3) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_chunked_owner_delivers_blocks_and_matches_plain_prefill(kvstored: Daemon) -> None:
    model = random_llama("tiny", seed=0)
    tokens = prompt(100)
    with KVClient(kvstored.addr) as client:
        kv = HFPrefixCache(client, model, "tiny-early", block_tokens=BLOCK_TOKENS)
        out = kv.prefill(tokens, early_reuse=True, chunk_tokens=32)
        # nothing cached: all computed; the 12 full blocks were claimed and delivered
        assert out.stats.computed_tokens == 100 and out.stats.stored_blocks == 12
        assert kv.namespace.lookup(tokens).blocks == 12
        # the chunked prefill's logits agree with a one-pass prefill of the same prompt
        with KVClient(kvstored.addr) as other:
            plain = HFPrefixCache(other, model, "tiny-plain", block_tokens=BLOCK_TOKENS)
            reference = plain.prefill(tokens).logits
        assert torch.allclose(out.logits, reference, atol=1e-4)
        # a later request reuses the delivered blocks
        again = kv.prefill(tokens + [7, 8, 9], early_reuse=True)
        assert again.stats.reused_tokens == 96 and again.stats.computed_tokens == 7


def test_concurrent_sessions_compute_the_shared_prompt_once(kvstored: Daemon) -> None:
    model = random_llama("tiny", seed=0)
    shared = prompt(160)
    results: list = []

    def session(i: int) -> None:
        with KVClient(kvstored.addr) as client:
            kv = HFPrefixCache(client, model, "tiny-burst", block_tokens=BLOCK_TOKENS)
            results.append(kv.prefill(shared + [100 + i] * 5, early_reuse=True, chunk_tokens=32))

    threads = [threading.Thread(target=session, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(results) == 4
    computed = sum(r.stats.computed_tokens for r in results)
    # the 160 shared tokens (20 blocks) are computed once; each session computes its own
    # 5-token suffix; races may cost a session one partial chunk of the shared prompt,
    # never the whole prompt again
    assert computed < 160 + 4 * 5 + 3 * 32
    assert sum(r.stats.reused_tokens for r in results) >= 3 * 128
