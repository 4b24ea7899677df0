"""Cache-augmented generation: store a long document's KV once, answer questions later.

``store`` prefills the document once and puts its KV blocks into kvstore with a high
priority (kept in the host tier ahead of ordinary prompts). ``ask`` runs in any later
process on the node -- after a restart of this program, or of the daemon (disk tier) --
and answers each question with only the question (and the document's last partial
block) prefilled: the prompt is document + question, and the document's blocks come
from kvstore. Each answer's time to first token is read against the prompt computed
whole, measured right before and right after it: where those two differ more than the
answer differs from them, the line says the machine is busy, not that kvstore is slow.
``demo`` (the default) stores, then asks from a second process.

The model is a Llama with seeded random weights (nothing is downloaded), so answers are
noise; text is tokenized as bytes. Start a daemon first (``kvstored``), then:

    python examples/cag.py                                  # demo
    python examples/cag.py store --doc docs/operations/configuration.md
    python examples/cag.py ask --doc docs/operations/configuration.md "What survives kill -9?"
    python examples/cag.py --addr unix:///tmp/kv.sock --small demo
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch
from daemon_check import daemon_address

from kvbench.models import random_llama
from kvbench.verdict import turn_verdict
from kvclient import KVClient
from kvclient.hf import HFPrefixCache

DOC_PRIORITY = 90  # 0..100; ordinary prompts get the daemon's default (35)
QUESTIONS = [
    "Which blocks are evicted first when the host tier is full?",
    "What does a lookup return?",
    "How does a restarted daemon find its blocks again?",
]
SECTIONS = [
    "Blocks are keyed by a chained hash of their namespace, their ancestors and tokens.",
    "Only leaves are evicted, lowest priority first, then least recently used.",
    "A lookup walks the chain from the first block and returns the longest ready prefix.",
    "The disk tier is rebuilt from LMDB at start-up, so committed blocks survive restarts.",
    "Pending blocks are visible to lookups, so a second session may wait instead of recomputing.",
]


def encode(text: str) -> list[int]:
    """Byte-level tokens (ids 0..255): no tokenizer download needed."""
    return list(text.encode())


def document(args: argparse.Namespace) -> list[int]:
    """The document: ``--doc FILE``, else a synthetic manual of about --doc-tokens bytes."""
    if args.doc:
        return encode(Path(args.doc).read_text())
    size = args.doc_tokens or (400 if args.small else 4000)
    text = "Operations manual.\n"
    chapter = 0
    while len(text) < size:
        chapter += 1
        text += (
            f"Section {chapter}. "
            + " ".join(SECTIONS[(chapter + i) % len(SECTIONS)] for i in range(3))
            + "\n"
        )
    return encode(text[:size])


def open_cache(args: argparse.Namespace, client: KVClient, priority: int | None) -> HFPrefixCache:
    preset = "tiny" if args.small else "small"
    model = random_llama(preset, seed=0, device=args.device)
    return HFPrefixCache(
        client,
        model,
        f"random-llama-{preset}-seed0",
        block_tokens=args.block_tokens,
        priority=priority,
    )


def store(args: argparse.Namespace) -> int:
    doc = document(args)
    with KVClient(args.addr) as client:
        kv = open_cache(args, client, DOC_PRIORITY)
        out = kv.prefill(doc)
        s = out.stats
        print(
            f"stored document: {s.prompt_tokens} tokens, {s.stored_blocks} new blocks "
            f"(already cached: {s.reused_tokens} tokens), prefill {s.ttft_s * 1e3:.1f} ms, "
            f"put {s.store_s * 1e3:.1f} ms"
        )
    return 0


def ask(args: argparse.Namespace) -> int:
    doc = document(args)
    questions = args.questions or QUESTIONS
    with KVClient(args.addr) as client:
        kv = open_cache(args, client, None)
        with torch.no_grad():  # warm-up, so the first timing is not the allocator's
            kv.model(torch.tensor([doc[:64]], device=kv.device))
        for question in questions:
            prompt = doc + encode(f"\nQuestion: {question}\nAnswer: ")
            before = full_prefill_s(kv, prompt)  # the prompt computed whole, around the turn
            out = kv.generate(prompt, max_new_tokens=args.answer_tokens, store=False)
            after = full_prefill_s(kv, prompt)
            s = out.stats
            print(
                f"question {question!r}: prompt {s.prompt_tokens} tokens, reused "
                f"{s.reused_tokens} (host {s.host_blocks} / disk {s.disk_blocks} blocks), "
                f"computed {s.computed_tokens}, TTFT {s.ttft_s * 1e3:.1f} ms "
                f"(load {s.load_s * 1e3:.1f} ms), answer {len(out.tokens)} tokens"
            )
            verdict = turn_verdict(s.ttft_s, s.load_s, (before, after))
            print(f"  vs the prompt computed whole: {verdict.text}")
    return 0


def full_prefill_s(kv: HFPrefixCache, prompt: list[int]) -> float:
    """Seconds of one forward pass over the whole prompt, without kvstore."""
    started = time.perf_counter()
    with torch.no_grad():
        kv.model(torch.tensor([prompt], device=kv.device), logits_to_keep=1)
    if str(kv.device).startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - started


def demo(args: argparse.Namespace) -> int:
    """Store in this process, then ask from a new one (it shares nothing but the daemon)."""
    store(args)
    child = [sys.executable, __file__, *common_flags(args), "ask"]
    return subprocess.call(child)


def common_flags(args: argparse.Namespace) -> list[str]:
    flags = [
        "--block-tokens",
        str(args.block_tokens),
        "--device",
        args.device,
        "--answer-tokens",
        str(args.answer_tokens),
    ]
    if args.addr:
        flags += ["--addr", args.addr]
    if args.small:
        flags.append("--small")
    if args.doc:
        flags += ["--doc", args.doc]
    if args.doc_tokens:
        flags += ["--doc-tokens", str(args.doc_tokens)]
    return flags


def add_options(parser: argparse.ArgumentParser, suppress: bool) -> None:
    """The options, accepted before and after the command (``store --doc FILE``)."""

    def default(value: object) -> object:
        return argparse.SUPPRESS if suppress else value

    parser.add_argument(
        "--addr", default=default(None),
        help="daemon address (default: KVSTORE_ADDR or the default socket)",
    )
    parser.add_argument(
        "--small", action="store_true", default=default(False),
        help="tiny model, short document (CI)",
    )
    parser.add_argument("--doc", default=default(None), help="document file (default: synthetic)")
    parser.add_argument("--doc-tokens", type=int, default=default(None))
    parser.add_argument("--answer-tokens", type=int, default=default(8))
    parser.add_argument("--block-tokens", type=int, default=default(16))
    parser.add_argument("--device", default=default("cpu"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_options(parser, suppress=False)
    after = argparse.ArgumentParser(add_help=False)
    add_options(after, suppress=True)
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("store", parents=[after], help="prefill the document once and store its KV")
    ask_parser = sub.add_parser(
        "ask", parents=[after], help="answer questions with the document from kvstore"
    )
    ask_parser.add_argument("questions", nargs="*")
    sub.add_parser("demo", parents=[after], help="store, then ask from a second process (default)")
    args = parser.parse_args(argv)
    if daemon_address(args.addr, "cag.py") is None:
        return 1
    command = args.command or "demo"
    return {"store": store, "ask": ask, "demo": demo}[command](args)


if __name__ == "__main__":
    sys.exit(main())
