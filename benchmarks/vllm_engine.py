"""One vLLM engine run in this process, for the connector's tests and benchmark.

    python benchmarks/vllm_engine.py make-model DIR [--hybrid]  # a tiny random Llama, offline
    python benchmarks/vllm_engine.py make-lora DIR --base MODEL_DIR [--seed N]  # its adapter
    python benchmarks/vllm_engine.py run --model DIR --prompts P.json --out R.json \\
        [--connector none|kvstore|example] [--extra '{"addr": ...}'] [--warmup] ...

``P.json`` is a list of ``{"tokens": [...], "cache_salt": "...", "after": "PATH",
"lora": {"name": ..., "id": N, "path": DIR}}`` (all but tokens optional; a prompt with
``lora`` runs with that adapter, ``--lora-rank`` turning vLLM's LoRA on); the prompts
run one after another, each alone. A prompt with ``after`` waits until PATH exists,
having written ``PATH.waiting``: its parent changes the daemon (or what it holds)
between two prompts of one engine. ``R.json`` gets, per prompt, the tokens vLLM reported
cached (``cached``: its own prefix cache plus the connector's), the greedy output
tokens, the log-probability of each, and the seconds ``generate`` took (with
``--max-tokens 1``: the time to first token). ``--barrier FILE`` waits after start-up
until FILE exists (``--ready FILE`` says when it waits), so that engines started
together send their prompts together.

Settings that make runs comparable on a small CPU machine (``kvbench.vllm_chat``'s
``ENGINE_ENV``): vLLM in this process, a 1 GiB KV cache, eager mode, and one reserved
core whatever the connector.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from kvbench.vllm_chat import ENGINE_ENV, transfer_config

# best tokens recorded per step: two engines whose passes differ in shape (a chunk of
# 1024 tokens against a loaded prefix and one block) may break a near tie of a random
# tiny model's logits either way, so outputs are compared as distributions too
TOP_LOGPROBS = 5


def make_model(directory: Path, hybrid: bool = False) -> Path:
    """A tiny random Llama with a word-level tokenizer in ``directory`` (offline): 4
    layers, 2 KV heads of 64, bfloat16, so 2 KiB of KV a token (kvclient.hf);
    ``hybrid``: layers 0 and 2 attend to a sliding window of 256 tokens."""
    from kvbench.models import save_random_llama

    return save_random_llama(directory, "vllm-tiny-swa" if hybrid else "vllm-tiny")


def run(args: argparse.Namespace) -> int:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    prompts = json.loads(Path(args.prompts).read_text())
    llm = LLM(
        model=str(args.model),
        enforce_eager=True,
        dtype="bfloat16",
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
        seed=0,
        **({"enable_lora": True, "max_lora_rank": args.lora_rank} if args.lora_rank else {}),
        kv_transfer_config=transfer_config(args.connector, json.loads(args.extra)),
    )
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, logprobs=TOP_LOGPROBS)
    if args.warmup:  # the engine's first-call costs, for the longest prompt's shapes
        longest = max(len(p["tokens"]) for p in prompts)
        warm = TokensPrompt(prompt_token_ids=[31000 + i % 997 for i in range(longest)])
        llm.generate([warm], params, use_tqdm=False)  # the same sampling: logprobs too
    if args.ready:
        Path(args.ready).write_text("ready")
    if args.barrier:
        while not Path(args.barrier).exists():
            time.sleep(0.005)
    results = []
    for prompt in prompts:
        if prompt.get("after"):
            Path(prompt["after"] + ".waiting").write_text("waiting")
            while not Path(prompt["after"]).exists():
                time.sleep(0.005)
        request = TokensPrompt(prompt_token_ids=list(prompt["tokens"]))
        if prompt.get("cache_salt"):
            request["cache_salt"] = prompt["cache_salt"]
        lora = prompt.get("lora")
        adapter = LoRARequest(lora["name"], lora["id"], lora["path"]) if lora else None
        started = time.perf_counter()
        (output,) = llm.generate([request], params, use_tqdm=False, lora_request=adapter)
        seconds = time.perf_counter() - started
        completion = output.outputs[0]
        logprobs = [
            float(step[token].logprob)
            for step, token in zip(completion.logprobs or [], completion.token_ids, strict=True)
        ]
        results.append(
            {
                "cached": int(output.num_cached_tokens or 0),
                "tokens": list(completion.token_ids),
                "logprobs": logprobs,
                # each step's best tokens and their logprobs (JSON keys: token ids)
                "top": [
                    {str(token): float(entry.logprob) for token, entry in step.items()}
                    for step in completion.logprobs or []
                ],
                "seconds": seconds,
            }
        )
    text = json.dumps(results)
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("make-model", help="save a tiny random Llama to DIR")
    make.add_argument("directory", type=Path)
    make.add_argument("--hybrid", action="store_true", help="with sliding-window layers")
    lora = commands.add_parser("make-lora", help="save a random LoRA adapter of a model")
    lora.add_argument("directory", type=Path)
    lora.add_argument("--base", type=Path, required=True, help="the model's directory")
    lora.add_argument("--seed", type=int, default=0)
    go = commands.add_parser("run", help="run prompts through one engine")
    go.add_argument("--model", type=Path, required=True)
    go.add_argument("--prompts", type=Path, required=True)
    go.add_argument("--out", type=Path)
    go.add_argument("--connector", choices=("none", "kvstore", "example"), default="none")
    go.add_argument("--extra", default="{}", help="kv_connector_extra_config, as JSON")
    go.add_argument("--max-tokens", type=int, default=1)
    go.add_argument("--max-model-len", type=int, default=20000)
    go.add_argument("--max-num-batched-tokens", type=int, default=20000)
    go.add_argument("--no-prefix-caching", action="store_true")
    go.add_argument(
        "--warmup", action="store_true", help="first, one unrelated prompt as long as the longest"
    )
    go.add_argument("--lora-rank", type=int, default=0, help="vLLM's LoRA on, up to this rank")
    go.add_argument("--barrier", help="wait after start-up until this file exists")
    go.add_argument("--ready", help="write this file once started (before the barrier)")
    args = parser.parse_args(argv)
    if args.command == "make-model":
        print(make_model(args.directory, args.hybrid))
        return 0
    if args.command == "make-lora":
        from kvbench.models import save_random_lora

        print(save_random_lora(args.directory, args.base, seed=args.seed))
        return 0
    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
