"""vLLM reusing a long shared prefix through kvstore, across requests and engine runs.

One document (a few thousand tokens) is asked several questions. The first engine run
computes the document once and kvstore's connector stores its KV blocks; later
questions reuse it (from vLLM's own prefix cache within the run). Run the program a
second time: its first question loads the document from kvstore instead of computing
it, and the engine reports those tokens as cached.

Start a daemon first (``kvstored``), then:

    python examples/vllm_reuse.py                       # a tiny random Llama, offline
    python examples/vllm_reuse.py --model meta-llama/Llama-3.1-8B-Instruct
    python examples/vllm_reuse.py --addr unix:///tmp/kv.sock --doc-tokens 2048

Prompts are token ids (the document and questions are pseudo-random ids), so the
answers are noise; what to look at is the ``cached`` column. The engine is set up as
``vllm serve`` would be with ``--kv-transfer-config '{"kv_connector":
"KVStoreConnector", "kv_connector_module_path": "kvclient.vllm", "kv_role":
"kv_both"}'``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from daemon_check import daemon_address

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: quick start
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on a CPU


def prompt_ids(seed: int, n: int, vocab: int) -> list[int]:
    """``n`` pseudo-random token ids in [3, vocab), the same in every run."""
    return [3 + (seed * 7_368_787 + i * 104_729) % (vocab - 3) for i in range(n)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a model id or path (default: a tiny random Llama)")
    parser.add_argument("--addr", help="kvstored address (default: KVSTORE_ADDR or its socket)")
    parser.add_argument("--doc-tokens", type=int, default=4096)
    parser.add_argument("--questions", type=int, default=3)
    args = parser.parse_args(argv)

    addr = daemon_address(args.addr, "vllm_reuse.py")
    if addr is None:
        return 1

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model = args.model
    if model is None:
        from kvbench.models import save_random_llama

        model = str(save_random_llama(Path(tempfile.gettempdir()) / "kvstore-vllm-tiny"))
    llm = LLM(
        model=model,
        enforce_eager=True,
        max_model_len=args.doc_tokens + 512,
        kv_transfer_config={
            "kv_connector": "KVStoreConnector",
            "kv_connector_module_path": "kvclient.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"addr": addr},
        },
    )
    vocab = llm.get_tokenizer().vocab_size
    document = prompt_ids(1, args.doc_tokens, vocab)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    for q in range(args.questions):
        question = prompt_ids(100 + q, 32, vocab)
        request = TokensPrompt(prompt_token_ids=document + question)
        started = time.perf_counter()
        (output,) = llm.generate([request], params, use_tqdm=False)
        seconds = time.perf_counter() - started
        print(
            f"question {q + 1}: prompt {len(document) + len(question)} tokens, "
            f"cached {output.num_cached_tokens or 0}, {seconds * 1000:.0f} ms, "
            f"answer {list(output.outputs[0].token_ids)}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
