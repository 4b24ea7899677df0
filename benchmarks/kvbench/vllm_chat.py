"""A vLLM engine process that answers chats, driven by its parent one command at a
time: the multi-turn benchmark's and the real-model tests' engine.

    engine = Engine(model_dir, log_path, addr=daemon_addr)   # kvstore's connector on
    answers = engine.reply([messages_1, messages_2])          # one greedy reply each
    engine.close()

Protocol: the child (``python -m kvbench.vllm_chat --model DIR ...``) prints one JSON
line ``{"ready": true}`` once started, then answers each stdin line ``{"chats":
[messages, ...]}`` with one JSON line: per chat, in order, the prompt's tokens, the
tokens vLLM reported cached (its prefix cache plus the connector's), vLLM's own time to
first token (``RequestOutput.metrics.first_token_latency``), the seconds ``generate``
took, and the reply's tokens and text. ``{"quit": true}`` or the end of stdin stops it.
vLLM logs to stdout: the child moves its stdout to stderr and answers on a duplicate.

Settings that make runs comparable on a small CPU machine (also used by
``benchmarks/vllm_engine.py``): vLLM in the child's own process, eager mode, one
reserved core whatever the connector (vLLM reserves one more whenever a connector is
set, which would change the prefill's thread count between the runs compared).
The chat engine runs in float32 with 32-token blocks (the CPU backend takes multiples
of 32): CPUs without bf16 instructions (AVX2 only) prefill several times faster in
float32 than in bfloat16 in vLLM's CPU backend.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvbench.chats import prompt_tokens

ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
BLOCK_TOKENS = 32
REPO = Path(__file__).resolve().parents[2]


def transfer_config(connector: str, extra: dict[str, object]) -> dict[str, object] | None:
    """vLLM's ``kv_transfer_config`` for ``connector`` (None: no connector)."""
    if connector == "none":
        return None
    if connector == "kvstore":
        return {
            "kv_connector": "KVStoreConnector",
            "kv_connector_module_path": "kvclient.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
    if connector == "lmcache":  # (its server: kvbench.lmcache_peer)
        return {
            "kv_connector": "LMCacheMPConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
    if connector == "example":
        return {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
    raise ValueError(f"unknown connector {connector!r}")


def engine(args: argparse.Namespace) -> int:
    """One engine, driven by its parent: a JSON command per stdin line (``{"chats":
    [messages, ...]}``: one greedy reply to each, one after another; ``{"quit": true}``),
    a JSON answer per stdout line (per chat: prompt tokens, cached tokens, vLLM's TTFT,
    seconds, reply tokens and text)."""
    answers = os.fdopen(os.dup(1), "w")  # the protocol's; vLLM logs to stdout: to stderr
    os.dup2(2, 1)
    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=str(args.model),
        enforce_eager=True,
        dtype="float32",
        block_size=BLOCK_TOKENS,
        max_model_len=args.max_model_len,
        num_gpu_blocks_override=args.blocks or None,
        enable_prefix_caching=not args.no_prefix_caching,
        disable_log_stats=False,  # RequestOutput.metrics: vLLM's own TTFT
        seed=0,
        kv_transfer_config=transfer_config(args.connector, json.loads(args.extra)),
    )
    tokenizer = llm.get_tokenizer()
    # greedy replies of at most reply_tokens: a reply that ends (<|im_end|>) ends early
    params = SamplingParams(max_tokens=args.reply_tokens, temperature=0.0)
    if args.warmup:  # first-call costs, on a prompt no chat shares
        warm = [7 + (i * 7919) % 40000 for i in range(args.warmup)]
        llm.generate([TokensPrompt(prompt_token_ids=warm)], params, use_tqdm=False)
    print(json.dumps({"ready": True}), file=answers, flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("quit"):
            break
        results = []
        for messages in command["chats"]:
            tokens = prompt_tokens(tokenizer, messages)
            started = time.perf_counter()
            (output,) = llm.generate(
                [TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False
            )
            seconds = time.perf_counter() - started
            completion = output.outputs[0]
            results.append(
                {
                    "prompt": len(tokens),
                    "cached": int(output.num_cached_tokens or 0),
                    "ttft": float(getattr(output.metrics, "first_token_latency", seconds)),
                    "seconds": seconds,
                    "reply": list(completion.token_ids),
                    "text": completion.text,
                }
            )
        print(json.dumps(results), file=answers, flush=True)
    return 0


class Engine:
    """An engine process of :func:`engine` (see there for its protocol)."""

    def __init__(
        self,
        model: Path,
        log: Path,
        *,
        addr: str | None = None,
        extra: dict[str, Any] | None = None,
        lmcache: dict[str, Any] | None = None,
        blocks: int = 0,
        max_model_len: int = 2048,
        reply_tokens: int = 32,
        warmup: int = 0,
        prefix_caching: bool = True,
        timeout_s: float = 600,
    ) -> None:
        """``addr``: kvstore's connector on that daemon (None: no connector);
        ``lmcache``: LMCache's connector with these settings instead
        (:meth:`kvbench.lmcache_peer.LMCacheServer.connector_settings`); ``blocks``:
        vLLM's KV cache in blocks (0: its default size)."""
        command = [
            sys.executable, "-m", "kvbench.vllm_chat", "--model", str(model),
            "--blocks", str(blocks), "--max-model-len", str(max_model_len),
            "--reply-tokens", str(reply_tokens), "--warmup", str(warmup),
        ]  # fmt: skip
        if addr is not None:
            settings = {"addr": addr, **(extra or {})}
            command += ["--connector", "kvstore", "--extra", json.dumps(settings)]
        if lmcache is not None:
            command += ["--connector", "lmcache", "--extra", json.dumps(lmcache)]
        if not prefix_caching:
            command.append("--no-prefix-caching")
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE")}
        if lmcache is not None:
            from kvbench.lmcache_peer import path_env

            env = path_env(env)
        self.timeout_s = timeout_s
        self.log_path = log
        self.log = open(log, "a")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
            text=True, env=env, cwd=REPO,
        )  # fmt: skip
        self._read()  # ready

    def _read(self) -> Any:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.proc.kill()
            tail = self.log_path.read_text()[-3000:]
            raise RuntimeError(f"the engine gave no answer ({self.proc.wait()}):\n{tail}")
        return json.loads(line)

    def reply(self, chats: list[list[dict[str, str]]]) -> list[dict[str, Any]]:
        """One greedy reply to each chat's messages, in order."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"chats": chats}) + "\n")
        self.proc.stdin.flush()
        result: list[dict[str, Any]] = self._read()
        return result

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
                self.proc.stdin.close()
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--blocks", type=int, default=0, help="vLLM's KV cache (0: default)")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--reply-tokens", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=0, help="tokens of a first prompt")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--connector", choices=("none", "kvstore", "lmcache"), default="none")
    parser.add_argument("--extra", default="{}", help="kv_connector_extra_config, as JSON")
    return engine(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
