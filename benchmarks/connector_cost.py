"""What kvstore's vLLM connector itself costs a request when it cannot help: the time
spent in its calls on the request's path to the first token, per request, with every
conversation in vLLM's own prefix cache (the multi-turn benchmark's "everything fits"
case, whose TTFT differences are within the machine's noise).

It times, in one engine process (vLLM in this process), the scheduler side's lookup
(``SchedulerSide.matched``: one call to the daemon per new request) and the worker
side's saves of the step that produces the first token (``WorkerSide.save``: gather the
step's new full blocks and send them) by wrapping those two methods, and prints them
beside vLLM's own TTFT of the same request.

    .venv/bin/python benchmarks/connector_cost.py [--conversations 4] [--turns 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvbench.chats import QUESTIONS, make_chats, prompt_tokens
from kvbench.servers import OwnDaemon
from kvbench.vllm_chat import BLOCK_TOKENS, ENGINE_ENV, transfer_config

GiB = 1 << 30


def timed(owner: type, name: str, spent: list[float]) -> None:
    """Wrap ``owner.name`` so that each call adds its milliseconds to ``spent``."""
    method: Callable[..., Any] = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            spent.append((time.perf_counter() - started) * 1e3)

    setattr(owner, name, wrapper)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--doc-tokens", type=int, default=1400)
    args = parser.parse_args(argv)
    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvclient.integrations.vllm import scheduler as vllm_scheduler
    from kvclient.integrations.vllm import worker as vllm_worker
    from kvclient.smollm2 import model_dir

    lookups: list[float] = []
    saves: list[float] = []
    timed(vllm_scheduler.SchedulerSide, "matched", lookups)
    timed(vllm_worker.WorkerSide, "save", saves)
    with tempfile.TemporaryDirectory(prefix="kvstore-connector-cost-") as tmp:
        daemon = OwnDaemon(Path(tmp), GiB, 4 * GiB)
        daemon.start()
        try:
            llm = LLM(
                model=str(model_dir()), enforce_eager=True, dtype="float32",
                block_size=BLOCK_TOKENS, max_model_len=2048, enable_prefix_caching=True,
                num_gpu_blocks_override=args.conversations * 2048 // BLOCK_TOKENS + 1,
                disable_log_stats=False, seed=0,
                kv_transfer_config=transfer_config("kvstore", {"addr": daemon.addr}),
            )  # fmt: skip
            tokenizer = llm.get_tokenizer()
            chats = make_chats(tokenizer, args.conversations, args.doc_tokens)
            params = SamplingParams(max_tokens=1, temperature=0.0)  # the first token only
            rows = []
            for turn in range(args.turns):
                for chat in chats:
                    tokens = prompt_tokens(tokenizer, chat.ask(QUESTIONS[turn]))
                    lookups.clear()
                    saves.clear()
                    prompt = TokensPrompt(prompt_token_ids=tokens)
                    (output,) = llm.generate([prompt], params, use_tqdm=False)
                    chat.answer(output.outputs[0].text)
                    ttft = output.metrics.first_token_latency * 1e3
                    rows.append((turn, ttft, sum(lookups), sum(saves)))
        finally:
            daemon.cleanup()
    print("| turn | requests | TTFT ms (median) | lookup ms | saves ms | connector share |")
    print("|---|---|---|---|---|---|")
    for turn in range(args.turns):
        mine = [r for r in rows if r[0] == turn]
        ttft = statistics.median(r[1] for r in mine)
        lookup = statistics.median(r[2] for r in mine)
        save = statistics.median(r[3] for r in mine)
        print(
            f"| {turn + 1} | {len(mine)} | {ttft:.0f} | {lookup:.1f} | {save:.1f} | "
            f"{(lookup + save) / ttft:.1%} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
