"""Multi-turn chat that reuses every earlier turn's KV through kvstore.

Each turn's prompt is the whole conversation so far: the previous prompt, the model's
reply and the new user message. After the first turn, everything up to the last full
block of the previous turn (prompt and reply) comes from kvstore, and only the new
tokens are prefilled. Each turn prints tokens reused vs computed and the TTFT.

The model is a Llama with seeded random weights (nothing is downloaded), so replies
are noise; text is tokenized as bytes. Start a daemon first (``kvstored``), then:

    python examples/chat_reuse.py                    # KVSTORE_ADDR or the default socket
    python examples/chat_reuse.py --addr unix:///tmp/kv.sock --small --turns 3
"""

from __future__ import annotations

import argparse
import sys

from daemon_check import daemon_address

from kvclient import KVClient
from kvclient.hf import HFPrefixCache, random_llama

SYSTEM = (
    "You are a helpful assistant for a storage team. Answer briefly and precisely. "
    "Explain trade-offs between memory tiers, and say when you are unsure. "
)
USER_TURNS = [
    "What is a KV cache and why does prefill cost grow with the prompt?",
    "How large is the KV of one token for Llama-3-8B in bf16?",
    "Why keep a popular system prompt in host memory instead of recomputing it?",
    "What happens to cached blocks when the daemon restarts?",
    "When is reading from disk still faster than recomputing?",
    "Summarise our conversation in one sentence.",
]


def encode(text: str) -> list[int]:
    """Byte-level tokens (ids 0..255): no tokenizer download needed."""
    return list(text.encode())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--addr", default=None, help="daemon address (default: KVSTORE_ADDR or the default socket)"
    )
    parser.add_argument("--small", action="store_true", help="tiny model, short replies (CI)")
    parser.add_argument("--turns", type=int, default=len(USER_TURNS))
    parser.add_argument("--reply-tokens", type=int, default=None)
    parser.add_argument("--block-tokens", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tenant", default="", help="tenant salt (tenants never share KV)")
    args = parser.parse_args(argv)

    if daemon_address(args.addr, "chat_reuse.py") is None:
        return 1
    preset = "tiny" if args.small else "small"
    reply_tokens = args.reply_tokens or (8 if args.small else 48)
    model = random_llama(preset, seed=0, device=args.device)
    # model id: names the weights (here: the preset and the seed)
    model_id = f"random-llama-{preset}-seed0"

    with KVClient(args.addr) as client:
        kv = HFPrefixCache(
            client, model, model_id, block_tokens=args.block_tokens, tenant_salt=args.tenant
        )
        print(
            f"namespace {kv.namespace.ns_id}: {kv.layout.block_bytes} bytes per block "
            f"of {kv.block_tokens} tokens"
        )
        conversation = encode(SYSTEM)
        for turn in range(min(args.turns, len(USER_TURNS))):
            conversation += encode(f"\nUser: {USER_TURNS[turn]}\nAssistant: ")
            out = kv.generate(conversation, max_new_tokens=reply_tokens)
            s = out.stats
            print(
                f"turn {turn + 1}: prompt {s.prompt_tokens} tokens, reused {s.reused_tokens}, "
                f"computed {s.computed_tokens}, TTFT {s.ttft_s * 1e3:.1f} ms "
                f"(load {s.load_s * 1e3:.1f} ms), reply {len(out.tokens)} tokens, "
                f"stored {s.stored_blocks + out.stored_blocks} blocks"
            )
            conversation = out.sequence  # the next prompt contains this reply
    return 0


if __name__ == "__main__":
    sys.exit(main())
