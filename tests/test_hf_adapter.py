"""kvclient.hf against a real kvstored: a transformers Llama reuses prefixes through it.

Every model is a tiny random-weight Llama (3 layers, GQA, fp32, seeded: the same
weights in every process). Bit-identity is judged fairly: logits computed on a prefix
loaded from kvstore must equal (torch.equal) logits computed on the same K/V kept in
memory -- the reference replays in one process the forwards that produced the stored
blocks (a 100-token prefill, cut to its first 96 tokens, say), then runs the suffix.
A single full prefill of the whole prompt uses other matmul and attention shapes, so it
may differ in the last bits; it is only required to be within 1e-4. "Computed" tokens
are counted by a hook on the embedding layer, which sees every token the model runs on.

The second process is a real one (``python -c`` importing this module and calling
:func:`worker_main`): it shares nothing with the test but the daemon's socket and arena.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from conftest import Daemon  # noqa: E402

from kvbench.models import random_llama  # noqa: E402
from kvclient import KVClient  # noqa: E402
from kvclient.hf import HFPrefixCache  # noqa: E402
from kvclient.integrations.gpu import LayerOnboarding  # noqa: E402
from kvclient.integrations.hf import cache as hf_cache  # noqa: E402

BLOCK_TOKENS = 8
MODEL_ID = "tiny-llama-seed0"
TESTS_DIR = str(Path(__file__).parent)


def make_prompt(seed: int, n: int, vocab: int = 512) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def count_model_tokens(model) -> list[int]:
    """A list that receives the number of tokens of every forward through ``model``."""
    seen: list[int] = []
    model.get_input_embeddings().register_forward_hook(
        lambda module, args, output: seen.append(args[0].numel())
    )
    return seen


def forward(model, tokens: list[int], cache=None, start: int = 0):
    """In memory: run tokens[start:] on ``cache`` (holding tokens[:start]) -> (logits, cache)."""
    ids = torch.tensor([tokens[start:]])
    positions = torch.arange(start, len(tokens)).unsqueeze(0)
    with torch.no_grad():
        out = model(ids, past_key_values=cache, position_ids=positions, use_cache=True)
    return out.logits, out.past_key_values


def truncated(model, cache, n_tokens: int):
    """A copy of ``cache`` holding only its first ``n_tokens`` tokens."""
    layers = [
        tuple(t[:, :, :n_tokens].clone() for t in hf_cache.layer_kv(cache, i))
        for i in range(model.config.num_hidden_layers)
    ]
    return hf_cache.cache_from_layers(model.config, layers)


def full_prefill_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits


# -- the second process ----------------------------------------------------------------


def worker_main() -> None:
    """argv[1]: JSON {addr, tokens, out}. Prefill with reuse; save logits, stats, token count."""
    job = json.loads(sys.argv[1])
    model = random_llama("tiny", seed=0)
    seen = count_model_tokens(model)
    with KVClient(job["addr"]) as client:
        kv = HFPrefixCache(client, model, MODEL_ID, block_tokens=BLOCK_TOKENS)
        out = kv.prefill(job["tokens"], logits_to_keep=0)
    stats = {name: getattr(out.stats, name) for name in out.stats.__dataclass_fields__}
    torch.save({"logits": out.logits, "stats": stats, "model_tokens": sum(seen)}, job["out"])


def run_worker(addr: str, tokens: list[int], out: Path) -> dict:
    job = json.dumps({"addr": addr, "tokens": tokens, "out": str(out)})
    code = (
        f"import sys; sys.path.insert(0, {TESTS_DIR!r}); import test_hf_adapter as t; "
        "t.worker_main()"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, job], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return torch.load(out)


# -- tests -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def daemon(kvstored_module: Daemon) -> Daemon:
    """One daemon for the tests that neither stop nor restart it (each its own prompts or
    tenant salt, so they do not see each other's blocks)."""
    return kvstored_module


def test_second_process_reuses_prefix_bit_identically_from_host_then_disk(
    kvstored_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    daemon = kvstored_factory()
    model = random_llama("tiny", seed=0)
    first = make_prompt(1, 100)  # 12 full blocks of 8, and 4 tokens
    with KVClient(daemon.addr) as client:
        kv = HFPrefixCache(client, model, MODEL_ID, block_tokens=BLOCK_TOKENS)
        out = kv.prefill(first)
        assert (out.stats.reused_tokens, out.stats.stored_blocks) == (0, 12)

    # another process, a longer prompt: 12 blocks (96 tokens) from the host tier, 24 computed
    second = first + make_prompt(2, 20)  # 120 tokens: at most (120 - 1) // 8 = 14 reusable
    got = run_worker(daemon.addr, second, tmp_path / "host.pt")
    stats = got["stats"]
    assert (stats["reused_tokens"], stats["computed_tokens"]) == (96, 24)
    assert (stats["host_blocks"], stats["disk_blocks"]) == (12, 0)
    assert got["model_tokens"] == 24  # the model saw only the non-cached tokens
    assert stats["stored_blocks"] == 3  # blocks 12..14 of the 120-token prompt
    # reference: first's 100-token prefill, cut to 96 tokens, then second's 24 new tokens
    _, first_cache = forward(model, first)
    ref, second_cache = forward(model, second, truncated(model, first_cache, 96), 96)
    assert torch.equal(got["logits"], ref)
    drift = (got["logits"] - full_prefill_logits(model, second)[:, 96:]).abs().max().item()
    print(f"host reuse: max |logit - full prefill| = {drift:.2e}")
    assert drift < 1e-4

    # the daemon restarts: host blocks were persisted, now everything comes from disk
    daemon.restart()
    got = run_worker(daemon.addr, second, tmp_path / "disk.pt")
    stats = got["stats"]
    assert (stats["reused_tokens"], stats["computed_tokens"]) == (112, 8)
    assert (stats["host_blocks"], stats["disk_blocks"]) == (0, 14)
    assert got["model_tokens"] == 8
    # reference: the worker's blocks 12..13 came from that suffix forward
    ref, _ = forward(model, second, truncated(model, second_cache, 112), 112)
    assert torch.equal(got["logits"], ref)
    drift = (got["logits"] - full_prefill_logits(model, second)[:, 112:]).abs().max().item()
    print(f"disk reuse: max |logit - full prefill| = {drift:.2e}")
    assert drift < 1e-4


def test_other_config_other_model_id_or_other_tenant_never_reuses(daemon: Daemon) -> None:
    tokens = make_prompt(3, 64)
    model = random_llama("tiny", seed=0)
    with KVClient(daemon.addr) as client:
        HFPrefixCache(client, model, MODEL_ID, block_tokens=BLOCK_TOKENS).prefill(tokens)
        others = {
            # same KV layout, different model: the config fingerprint keeps them apart
            "other config": (random_llama("tiny", intermediate_size=256), MODEL_ID, ""),
            "other layout": (random_llama("tiny", num_hidden_layers=2), MODEL_ID, ""),
            "other dtype": (random_llama("tiny", dtype=torch.bfloat16), MODEL_ID, ""),
            "other tenant": (model, MODEL_ID, "tenant-b"),
            "other model id": (model, "tiny-llama-seed1", ""),
        }
        for case, (other, model_id, salt) in others.items():
            kv = HFPrefixCache(client, other, model_id, block_tokens=BLOCK_TOKENS, tenant_salt=salt)
            out = kv.prefill(tokens, store=False)
            assert out.stats.reused_tokens == 0, case
        # other tokens per block: another namespace too
        kv = HFPrefixCache(client, model, MODEL_ID, block_tokens=4)
        assert kv.prefill(tokens, store=False).stats.reused_tokens == 0
        # control: the same model, id and salt reuses all it may (63 // 8 = 7 blocks)
        kv = HFPrefixCache(client, model, MODEL_ID, block_tokens=BLOCK_TOKENS)
        assert kv.prefill(tokens, store=False).stats.reused_tokens == 56


def test_short_prompts_and_the_last_token_is_always_computed(daemon: Daemon) -> None:
    model = random_llama("tiny", seed=0)
    seen = count_model_tokens(model)
    with KVClient(daemon.addr) as client:
        kv = HFPrefixCache(client, model, MODEL_ID, block_tokens=BLOCK_TOKENS, tenant_salt="short")
        # shorter than one block: nothing to reuse, nothing to store, logits as usual
        short = make_prompt(4, 5)
        out = kv.prefill(short, logits_to_keep=0)
        stats = out.stats
        assert (stats.reused_tokens, stats.computed_tokens, stats.stored_blocks) == (0, 5, 0)
        assert torch.equal(out.logits, full_prefill_logits(model, short))
        # exactly one block: stored, but never reused for the same prompt (its last token
        # must be computed to get logits)
        one = make_prompt(5, BLOCK_TOKENS)
        assert kv.prefill(one).stats.stored_blocks == 1
        seen.clear()
        again = kv.prefill(one)
        assert (again.stats.reused_tokens, again.stats.computed_tokens) == (0, BLOCK_TOKENS)
        assert sum(seen) == BLOCK_TOKENS
        # one token more: the block is reused, one token computed
        seen.clear()
        longer = one + [7]
        out = kv.prefill(longer, logits_to_keep=0)
        assert (out.stats.reused_tokens, out.stats.computed_tokens) == (BLOCK_TOKENS, 1)
        assert sum(seen) == 1
        ref, _ = forward(model, longer, forward(model, one)[1], BLOCK_TOKENS)
        assert torch.equal(out.logits, ref)


def test_prompt_diverging_mid_block_reuses_exactly_the_full_blocks_before_it(
    daemon: Daemon,
) -> None:
    model = random_llama("tiny", seed=0)
    seen = count_model_tokens(model)
    stored = make_prompt(6, 6 * BLOCK_TOKENS)
    with KVClient(daemon.addr) as client:
        kv = HFPrefixCache(client, model, MODEL_ID, block_tokens=BLOCK_TOKENS, tenant_salt="div")
        assert kv.prefill(stored).stats.stored_blocks == 6
        # same first 3.5 blocks, then other tokens: block 3 differs -> blocks 0..2 reused
        diverged = stored[: 3 * BLOCK_TOKENS + 4] + [(t + 1) % 512 for t in stored[28:40]]
        seen.clear()
        out = kv.prefill(diverged, logits_to_keep=0)
        assert out.stats.reused_tokens == 3 * BLOCK_TOKENS
        assert out.stats.computed_tokens == len(diverged) - 3 * BLOCK_TOKENS == sum(seen)
        # reference: the stored prompt's prefill, cut to 3 blocks, then the new tokens
        _, cache = forward(model, stored)
        ref, _ = forward(
            model, diverged, truncated(model, cache, 3 * BLOCK_TOKENS), 3 * BLOCK_TOKENS
        )
        assert torch.equal(out.logits, ref)
        drift = (out.logits - full_prefill_logits(model, diverged)[:, 24:]).abs().max().item()
        assert drift < 1e-4
        # its own new full blocks (3..4) were stored after the shared ones
        assert out.stats.stored_blocks == len(diverged) // BLOCK_TOKENS - 3


def test_generate_matches_transformers_greedy_and_stores_the_reply(daemon: Daemon) -> None:
    model = random_llama("tiny", seed=0)
    prompt = make_prompt(7, 45)
    with torch.no_grad():
        ids = torch.tensor([prompt])  # (an explicit mask: token 0 is not padding here)
        expected = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=12,
            do_sample=False,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
    with KVClient(daemon.addr) as client:
        kv = HFPrefixCache(client, model, MODEL_ID, block_tokens=BLOCK_TOKENS, tenant_salt="gen")
        cold = kv.generate(prompt, max_new_tokens=12)
        assert cold.tokens == expected
        assert cold.stats.reused_tokens == 0
        # prompt (45) + reply (12) - last token = 56 tokens of K/V: blocks 5 and 6 added
        assert (cold.stats.stored_blocks, cold.stored_blocks) == (5, 2)
        warm = kv.generate(prompt, max_new_tokens=12)
        assert warm.tokens == expected
        assert (warm.stats.reused_tokens, warm.stats.computed_tokens) == (40, 5)
        # the next turn contains the reply: its blocks are reused too
        turn2 = cold.sequence + make_prompt(8, 10)
        out = kv.prefill(turn2)
        assert out.stats.reused_tokens == 56


def test_daemon_down_means_recompute_not_failure(kvstored: Daemon) -> None:
    model = random_llama("tiny", seed=0)
    prompt = make_prompt(9, 40)
    with KVClient(kvstored.addr, timeout=5) as client:
        kv = HFPrefixCache(client, model, MODEL_ID, block_tokens=BLOCK_TOKENS, tenant_salt="down")
        kv.prefill(prompt)
        assert kvstored.stop() == 0
        out = kv.prefill(prompt, logits_to_keep=0)  # lookup and put fail: warnings only
        assert (out.stats.reused_tokens, out.stats.stored_blocks) == (0, 0)
        assert torch.equal(out.logits, full_prefill_logits(model, prompt))


def test_loaded_prefix_plugs_into_transformers_generate(daemon: Daemon) -> None:
    model = random_llama("tiny", seed=0)
    ids = torch.tensor([make_prompt(10, 50)])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        expected = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    with KVClient(daemon.addr) as client:
        kv = HFPrefixCache(client, model, MODEL_ID, block_tokens=BLOCK_TOKENS, tenant_salt="hf")
        kv.prefill(ids)
        loaded = kv.load(ids)
        assert (loaded.tokens, loaded.host_blocks, loaded.disk_blocks) == (48, 6, 0)
        seen = count_model_tokens(model)
        with torch.no_grad():
            got = model.generate(
                ids,
                attention_mask=mask,
                past_key_values=loaded.cache,
                max_new_tokens=6,
                do_sample=False,
            )
        assert torch.equal(got, expected)
        assert seen[0] == 2  # transformers ran only the two uncached prompt tokens


def test_layer_wise_load_gives_todays_logits_and_appends_in_place(daemon: Daemon) -> None:
    model = random_llama("tiny", seed=0)
    prompt = make_prompt(11, 70)  # 8 full blocks reusable, 6 tokens computed
    with KVClient(daemon.addr) as client:
        today = HFPrefixCache(
            client, model, MODEL_ID, block_tokens=BLOCK_TOKENS, tenant_salt="layers"
        )
        layered = HFPrefixCache(
            client, model, MODEL_ID, block_tokens=BLOCK_TOKENS, tenant_salt="layers",
            stream_layers=True,
        )
        today.prefill(prompt)
        before = today.prefill(prompt, logits_to_keep=0, store=False)
        waited: list[int] = []
        original_wait = LayerOnboarding.wait

        def spy(self, layer: int) -> None:  # type: ignore[no-untyped-def]
            waited.append(layer)
            original_wait(self, layer)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("kvclient.integrations.gpu.LayerOnboarding.wait", spy)
            after = layered.prefill(prompt, logits_to_keep=0, store=False, reserve_tokens=5)
        assert after.stats.reused_tokens == before.stats.reused_tokens == 64
        assert torch.equal(after.logits, before.logits)
        assert waited == [0, 1, 2]  # each layer waited for just before it ran
        # the computed tokens went into the room after the prefix: no copy of it
        layer = after.cache.layers[0]
        assert isinstance(layer, hf_cache.ReservedLayer)
        keys, _ = hf_cache.layer_kv(after.cache, 0)
        assert keys.shape[-2] == 70 and keys.data_ptr() == layer._room[0].data_ptr()
        assert layer._room[0].shape[-2] == 75
        # decoding past the room grows it once and gives today's tokens
        want = today.generate(prompt, max_new_tokens=9, store=False).tokens
        assert layered.generate(prompt, max_new_tokens=9, store=False).tokens == want
        layered.close()


def test_a_negative_reserve_is_refused_before_anything_runs(daemon: Daemon) -> None:
    model = random_llama("tiny", seed=0)
    prompt = make_prompt(12, 40)
    with KVClient(daemon.addr) as client:
        kv = HFPrefixCache(client, model, MODEL_ID, block_tokens=BLOCK_TOKENS, tenant_salt="neg")
        seen = count_model_tokens(model)
        with pytest.raises(ValueError, match="reserve_tokens must be >= 0, got -1"):
            kv.prefill(prompt, reserve_tokens=-1)
        assert seen == []  # the model never ran
        assert kv.namespace.lookup(prompt).blocks == 0  # and nothing was stored
        kv.close()
