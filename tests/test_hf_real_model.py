"""The transformers adapter on the real chat model (SmolLM2-135M-Instruct, float32):
a chat's second turn loads the first turn's prompt and reply from a real kvstored and
predicts what a full prefill predicts."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from conftest import Daemon  # noqa: E402

from kvbench.chats import QUESTIONS, make_chats, prompt_tokens  # noqa: E402
from kvclient import KVClient  # noqa: E402
from kvclient.hf import HFPrefixCache  # noqa: E402
from kvclient.smollm2 import MODEL_ID  # noqa: E402

BLOCK = 16


def test_turn_two_reuses_turn_one_and_its_reply(kvstored: Daemon, smollm2_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    chat = make_chats(tokenizer, 1, 120)[0]
    with KVClient(kvstored.addr) as client:
        kv = HFPrefixCache(client, model, MODEL_ID, block_tokens=BLOCK)
        assert kv.namespace.info.tokenizer == str(smollm2_dir)  # kvctl why --text finds it
        first_prompt = prompt_tokens(tokenizer, chat.ask(QUESTIONS[0]))
        first = kv.generate(first_prompt, 24, eos_token_id=tokenizer.eos_token_id)
        assert first.stats.reused_tokens == 0
        reply = tokenizer.decode(first.tokens, skip_special_tokens=True)
        assert reply.strip(), "the real model gave an empty reply"
        chat.answer(reply)
        second_prompt = prompt_tokens(tokenizer, chat.ask(QUESTIONS[1]))
        # the template gives back the reply's tokens as generated
        assert second_prompt[: len(first.sequence) - 1] == first.sequence[:-1]
        second = kv.prefill(second_prompt, store=False)
    # everything turn 1 computed (prompt and reply, up to the last full block) came
    # from kvstore; the model ran on the new question only
    held = (len(first.sequence) - 1) // BLOCK * BLOCK
    assert second.stats.reused_tokens == held > len(first_prompt)
    with torch.no_grad():
        full = model(input_ids=torch.tensor([second_prompt])).logits[0, -1]
    reused = second.logits[0, -1]
    assert int(reused.argmax()) == int(full.argmax())
    assert torch.allclose(reused, full, atol=1e-3, rtol=0), (reused - full).abs().max()
