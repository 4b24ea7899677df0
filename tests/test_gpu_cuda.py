"""The GPU data paths on CUDA: the same round trips as test_mover / test_gpu_roundtrip,
with CUDA tensors, pinned memory, streams and events, and CUDA IPC across two processes.

Marked ``gpu``; every test skips cleanly where torch has no CUDA device. Run on a GPU
host with ``pytest -m gpu``.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
from conftest import Daemon

from kvbench.models import random_llama
from kvclient import KVClient, Namespace
from kvclient.hf import HFPrefixCache
from kvclient.integrations.gpu import GpuClient
from kvclient.integrations.vllm.blocks import PagedLayers
from kvstore import block_kernel
from kvstore.host import pinning
from kvstore.host.arena import HostArena
from kvstore.host.pinning import cuda_pin_hook
from kvstore.kv_caches import HFKV, KVCache, PagedKV
from kvstore.mover import Mover, device_alias
from kvstore.platform import Profile, detect

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

L, H, D, T = 4, 2, 64, 16
NB = 32
B, S = 2, 8 * T
SENTINEL = 0x5A


def random_(kv: KVCache, seed: int) -> None:
    gen = torch.Generator(device=kv.device).manual_seed(seed)
    for t in kv.tensors:
        raw = t.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, device=kv.device,
                                generator=gen))


def poison(kv: KVCache) -> None:
    for t in kv.tensors:
        t.view(torch.uint8).fill_(SENTINEL)


def make(layout: str, device: str = "cuda") -> KVCache:
    if layout == "paged":
        return PagedKV([torch.empty(2, NB, T, H, D, dtype=torch.bfloat16, device=device)
                        for _ in range(L)])
    return HFKV([(torch.empty(B, H, S, D, dtype=torch.bfloat16, device=device),
                  torch.empty(B, H, S, D, dtype=torch.bfloat16, device=device))
                 for _ in range(L)], T)


def block_bytes(kv: KVCache, block: int) -> np.ndarray:
    if isinstance(kv, PagedKV):
        view = torch.stack([t[:, block].transpose(1, 2) for t in kv.tensors])
    else:
        assert isinstance(kv, HFKV)
        seq, j = divmod(block, kv.blocks_per_seq)
        pairs = [kv.tensors[i : i + 2] for i in range(0, len(kv.tensors), 2)]
        view = torch.stack([torch.stack([t[seq, :, j * T : (j + 1) * T] for t in pair])
                            for pair in pairs])
    return view.contiguous().view(torch.uint8).cpu().numpy().reshape(-1)


def shm_folder() -> tempfile.TemporaryDirectory[str]:
    """A folder on tmpfs: Linux lets CUDA pin shared file pages only there (or hugetlbfs),
    which is why kvstored's arena_dir defaults to /dev/shm."""
    return tempfile.TemporaryDirectory(dir="/dev/shm", prefix="kvstore-gpu-test-")


@pytest.fixture
def pinned_arena() -> Iterator[HostArena]:
    with shm_folder() as folder:
        arena = HostArena(64 << 20, directory=folder, pin=cuda_pin_hook(strict=True))
        yield arena
        arena.close()


def test_a_refused_pin_leaves_cuda_usable(tmp_path) -> None:
    # an arena file on a disk file system: the registration may be refused; either way
    # the next CUDA call of this thread must not inherit an error from it
    hook = cuda_pin_hook()
    arena = HostArena(8 << 20, directory=str(tmp_path), pin=hook)
    try:
        device = torch.arange(1024, device="cuda")
        assert int(device.sum()) == 1023 * 1024 // 2
    finally:
        arena.close()


def test_detect_finds_the_device() -> None:
    info = detect(env={})
    assert info.profile in (Profile.PCIE, Profile.C2C)
    assert info.devices and info.devices[0].name
    assert info.devices[0].compute_capability >= (7, 0)


def test_pin_hook_pins_the_arena(pinned_arena: HostArena) -> None:
    assert torch.from_numpy(pinned_arena.array()).is_pinned()


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("scattered", [False, True])
@pytest.mark.parametrize("layout", ["paged", "hf"])
def test_mover_round_trip_on_a_side_stream(
    pinned_arena: HostArena, layout: str, scattered: bool, direct: bool
) -> None:
    info = detect(env={})
    if direct and not info.direct_host_access:
        pytest.skip("kernels cannot address registered host memory here (not c2c)")
    src, dst = make(layout), make(layout)
    random_(src, 1)
    poison(dst)
    host = torch.from_numpy(pinned_arena.array())
    aliases = {src.device: device_alias(host, src.device)} if direct else {}
    mover = Mover(host, device_arenas=aliases, max_run_copies=2)
    bb = src.shape.block_bytes
    n = 8
    offsets = [pinned_arena.alloc(bb) for _ in range(n)]
    assert all(o is not None for o in offsets)
    if scattered:
        offsets = offsets[::-1]
    ids = [(5 * i + 1) % src.num_blocks for i in range(n)]
    stream = torch.cuda.Stream()

    event = mover.offload(src, ids, offsets, stream=stream)
    assert isinstance(event, torch.cuda.Event)
    event.synchronize()
    region = pinned_arena.array()
    for block, off in zip(ids, offsets, strict=True):
        assert np.array_equal(region[off : off + bb], block_bytes(src, block))

    targets = [(3 * i + 2) % dst.num_blocks for i in range(n)]
    event = mover.onboard(dst, targets, offsets, stream=stream)
    torch.cuda.current_stream().wait_event(event)
    torch.cuda.current_stream().synchronize()
    for s, d in zip(ids, targets, strict=True):
        assert np.array_equal(block_bytes(dst, d), block_bytes(src, s))


# -- two processes: this one and kvstored ------------------------------------------------


@pytest.fixture(scope="module")
def gpu_daemon(kvstored_module_factory: Callable[..., Daemon]) -> Iterator[Daemon]:
    with shm_folder() as folder:
        daemon = kvstored_module_factory(arena_dir=folder)
        yield daemon
        daemon.stop()


@pytest.fixture(scope="module")
def gpu(gpu_daemon: Daemon) -> Iterator[GpuClient]:
    with KVClient(gpu_daemon.addr) as client, GpuClient(client) as g:
        yield g


def _ns(gpu: GpuClient, model: str) -> Namespace:
    return gpu.client.namespace(
        model, T, num_layers=L, num_kv_heads=H, head_dim=D, dtype="bfloat16"
    )


def test_daemon_reports_a_gpu_platform(gpu: GpuClient) -> None:
    info = gpu.info()
    assert info.platform in ("pcie", "c2c")
    assert info.devices and info.arena_pinned


@pytest.mark.parametrize("layout", ["paged", "hf"])
def test_client_driven_round_trip_on_cuda(gpu: GpuClient, layout: str) -> None:
    ns = _ns(gpu, f"cuda-client-{layout}")
    src, dst = make(layout), make(layout)
    random_(src, 2)
    poison(dst)
    tokens = list(range(100, 100 + 6 * T + 1))
    ids = [(5 * i + 1) % src.num_blocks for i in range(6)]
    stream = torch.cuda.Stream()
    put = gpu.offload(ns, tokens, src, ids, stream=stream)
    assert put.stored == 6
    targets = [(3 * i + 2) % dst.num_blocks for i in range(6)]
    got = gpu.onboard(ns, tokens, dst, targets, stream=stream, wait=False)
    assert got.onboarded == 6 and isinstance(got.event, torch.cuda.Event)
    torch.cuda.current_stream().wait_event(got.event)
    got.release()
    torch.cuda.synchronize()
    for s, d in zip(ids, targets, strict=True):
        assert np.array_equal(block_bytes(dst, d), block_bytes(src, s))


@pytest.mark.parametrize("ipc_event", [False, True])
@pytest.mark.parametrize("layout", ["paged", "hf"])
def test_daemon_driven_round_trip_over_cuda_ipc(
    gpu: GpuClient, layout: str, ipc_event: bool
) -> None:
    ns = _ns(gpu, f"cuda-daemon-{layout}-{ipc_event}")
    src, dst = make(layout), make(layout)
    random_(src, 3)
    poison(dst)
    tokens = list(range(200, 200 + 6 * T + 1))
    ids = [(5 * i + 1) % src.num_blocks for i in range(6)]
    targets = [(3 * i + 2) % dst.num_blocks for i in range(6)]
    with gpu.register(ns, src) as reg:
        out = reg.offload(tokens, ids, ipc_event=ipc_event)
        assert out.stored == 6
    with gpu.register(ns, dst) as reg:
        got = reg.onboard(tokens, targets)
        assert got.onboarded == 6
    torch.cuda.synchronize()
    for s, d in zip(ids, targets, strict=True):
        assert np.array_equal(block_bytes(dst, d), block_bytes(src, s))


def test_connector_pages_go_out_through_pinned_rows_and_back() -> None:
    """The vLLM connector's worker path (it imports no vLLM): pages -> pinned rows -> pages."""
    source = make("paged")
    random_(source, 3)
    layers = PagedLayers(source.tensors, NB)
    rows = torch.empty((4, layers.block_bytes), dtype=torch.uint8).pin_memory()
    layers.gather([3, 8], rows)
    target = make("paged")
    poison(target)
    PagedLayers(target.tensors, NB).scatter([1, 2], rows[:2])
    torch.cuda.synchronize()
    for before, after in zip(source.tensors, target.tensors, strict=True):
        raw_before, raw_after = before.view(torch.uint8), after.view(torch.uint8)  # NaNs too
        assert torch.equal(raw_before[:, 3], raw_after[:, 1])
        assert torch.equal(raw_before[:, 8], raw_after[:, 2])
    assert (target.tensors[0][:, 0].view(torch.uint8) == SENTINEL).all()  # untouched


def test_hf_adapter_copies_between_the_gpu_cache_and_the_pinned_arena(gpu_daemon: Daemon) -> None:
    """transformers on CUDA: a hit is copied from the pinned arena slots into the cache's
    tensors (no host copy) and gives the logits of a full prefill; the blocks are the
    same bytes the host path reads."""
    model = random_llama("tiny", seed=0, dtype=torch.bfloat16, device="cuda")
    vocab, gen = model.config.vocab_size, torch.Generator().manual_seed(5)
    ids = torch.randint(0, vocab, (5 * T + 3,), generator=gen)
    with KVClient(gpu_daemon.addr) as client:
        with HFPrefixCache(client, model, "cuda-hf", block_tokens=T) as direct:
            miss = direct.prefill(ids)
            assert miss.stats.stored_blocks == 5
            assert isinstance(direct._gpu, GpuClient)  # the direct path was taken
            hit = direct.prefill(ids, store=False)
        host_path = HFPrefixCache(client, model, "cuda-hf", block_tokens=T, direct_copies=False)
        through_host = host_path.prefill(ids, store=False)
    for out in (hit, through_host):
        assert out.stats.reused_tokens == 5 * T
        assert torch.allclose(out.logits.float(), miss.logits.float(), atol=0.05, rtol=0.02)
    assert torch.equal(hit.logits, through_host.logits)


# -- round two (#59): one launch per batch, layer-wise loads, tenant regions, a real model


def kernel_or_skip() -> block_kernel.BlockKernel:
    pytest.importorskip("cupy", reason="the one-launch kernel is built with CuPy")
    kernel = block_kernel.load()
    assert kernel is not None, "CuPy is here but the kernel did not compile (see the log)"
    return kernel


@pytest.mark.parametrize("scattered", [False, True])
@pytest.mark.parametrize("layout", ["paged", "hf"])
def test_one_launch_round_trip_through_the_mapped_arena(
    pinned_arena: HostArena, layout: str, scattered: bool
) -> None:
    kernel_or_skip()
    src, dst, ref = make(layout), make(layout), make(layout)
    random_(src, 11)
    poison(dst)
    poison(ref)
    host = torch.from_numpy(pinned_arena.array())
    address = pinning.device_address(host.data_ptr())
    assert address is not None, "the registered arena has no device address"
    fused = Mover(host, device_address=address)
    bb = src.shape.block_bytes
    offsets = [pinned_arena.alloc(bb) for _ in range(8)]
    assert all(o is not None for o in offsets)
    if scattered:
        offsets = offsets[::-1]
    ids = [(5 * i + 1) % src.num_blocks for i in range(8)]
    stream = torch.cuda.Stream()
    fused.offload(src, ids, offsets, stream=stream).synchronize()
    region = pinned_arena.array()
    for block, off in zip(ids, offsets, strict=True):
        assert np.array_equal(region[off : off + bb], block_bytes(src, block))
    targets = [(3 * i + 2) % dst.num_blocks for i in range(8)]
    fused.onboard(dst, targets, offsets, stream=stream).synchronize()
    Mover(host).onboard(ref, targets, offsets, stream=stream).synchronize()
    for mine, theirs in zip(dst.tensors, ref.tensors, strict=True):  # untouched blocks too
        assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8))


def test_onboard_layers_gives_each_layer_its_own_event(pinned_arena: HostArena) -> None:
    kernel_or_skip()
    src, dst = make("hf"), make("hf")
    random_(src, 12)
    poison(dst)
    host = torch.from_numpy(pinned_arena.array())
    mover = Mover(host, device_address=pinning.device_address(host.data_ptr()))
    bb = src.shape.block_bytes
    offsets = [pinned_arena.alloc(bb) for _ in range(5)]
    ids = [1, 2, 3, 9, 10]
    mover.offload(src, ids, offsets).synchronize()
    side = torch.cuda.Stream()
    events = mover.onboard_layers(dst, ids, offsets, stream=side)
    assert events is not None and len(events) == L
    for layer, event in enumerate(events):
        torch.cuda.current_stream().wait_event(event)
        for kv in range(2):
            a, b = src.tensors[2 * layer + kv], dst.tensors[2 * layer + kv]
            for block in ids:
                seq, j = divmod(block, src.blocks_per_seq)  # type: ignore[attr-defined]
                part = slice(j * T, (j + 1) * T)
                assert torch.equal(a[seq, :, part].view(torch.uint8),
                                   b[seq, :, part].view(torch.uint8))


def test_connector_pages_take_one_launch_when_the_rows_are_pinned() -> None:
    kernel_or_skip()
    source = make("paged")
    random_(source, 13)
    layers = PagedLayers(source.tensors, NB)
    rows = torch.empty((3, layers.block_bytes), dtype=torch.uint8).pin_memory()
    assert layers._one_launch([4, 0, 7], rows, to_rows=True)
    expected = torch.empty((3, layers.block_bytes), dtype=torch.uint8)
    PagedLayers([t.cpu() for t in source.tensors], NB).gather([4, 0, 7], expected)
    assert torch.equal(rows, expected)


def test_two_tenants_regions_are_pinned_and_round_trip(
    kvstored_factory: Callable[..., Daemon], tmp_path
) -> None:
    """A daemon with two tenants with host quotas registers its whole range; each
    tenant's client registers its own region (handed over by fd) and moves blocks
    between the GPU and its slots byte for byte."""
    import secrets

    from conftest import write_secret

    tokens = {who: secrets.token_hex(16) for who in ("a", "b")}
    lines = []
    for who, token in tokens.items():
        write_secret(tmp_path / f"{who}.token", token + "\n")
        lines += [f"[tenants.{who}]", f'token_file = "{tmp_path / f"{who}.token"}"',
                  'host_bytes = "16 MiB"']  # fmt: skip
    (tmp_path / "kvstored.toml").write_text("\n".join(lines) + "\n")
    with shm_folder() as folder:
        daemon = kvstored_factory(
            extra_args=("--config", str(tmp_path / "kvstored.toml")), arena_dir=folder
        )
        moved = {}
        for index, (who, token) in enumerate(tokens.items()):
            with KVClient(daemon.addr, token=token, use_arena=True) as client, GpuClient(
                client
            ) as gpu:
                assert gpu.info().arena_pinned
                ns = _ns(gpu, "tenant-region")
                src, dst = make("hf"), make("hf")
                random_(src, 20 + index)
                poison(dst)
                tokens_ = list(range(300, 300 + 6 * T + 1))
                ids = [(5 * i + 1) % src.num_blocks for i in range(6)]
                assert gpu.offload(ns, tokens_, src, ids).stored == 6
                mover = gpu._mover
                assert mover is not None and gpu._arena is not None
                mapping = gpu._arena.mapping
                region = torch.from_numpy(mapping.array()[mapping.start :])
                assert region.is_pinned(), f"tenant {who}'s region is not registered"
                targets = [(3 * i + 2) % dst.num_blocks for i in range(6)]
                assert gpu.onboard(ns, tokens_, dst, targets).onboarded == 6
                torch.cuda.synchronize()
                for s_, d in zip(ids, targets, strict=True):
                    assert np.array_equal(block_bytes(dst, d), block_bytes(src, s_))
                moved[who] = (mapping.start, mover.device_address is not None)
        assert moved["a"][0] != moved["b"][0]  # two regions
        daemon.stop()


def test_hf_adapter_loads_layer_by_layer_with_the_whole_loads_logits(
    gpu_daemon: Daemon,
) -> None:
    model = random_llama("tiny", seed=0, dtype=torch.bfloat16, device="cuda")
    vocab, gen = model.config.vocab_size, torch.Generator().manual_seed(6)
    ids = torch.randint(0, vocab, (7 * T + 5,), generator=gen)
    with KVClient(gpu_daemon.addr) as client:
        with HFPrefixCache(client, model, "cuda-layers", block_tokens=T) as layered:
            layered.prefill(ids)
            hit = layered.prefill(ids, store=False)
            assert hit.stats.reused_tokens == 7 * T
        with HFPrefixCache(
            client, model, "cuda-layers", block_tokens=T, stream_layers=False
        ) as whole:
            before = whole.prefill(ids, store=False)
    assert torch.equal(hit.logits, before.logits)


def test_smollm2_bf16_turn_two_reuses_turn_one_on_cuda(gpu_daemon: Daemon) -> None:
    """The real chat model in bf16 on the GPU: turn 2 loads turn 1's prompt and reply
    (layer by layer) and predicts what a full prefill predicts, within bf16 noise."""
    pytest.importorskip("gguf", reason="the gguf package converts the model")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvbench.chats import QUESTIONS, make_chats, prompt_tokens
    from kvclient.smollm2 import MODEL_ID, ModelError, model_dir

    try:
        folder = model_dir()
    except ModelError as exc:
        pytest.skip(f"the real model is not on this machine: {exc}")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()
    chat = make_chats(tokenizer, 1, 120)[0]
    with KVClient(gpu_daemon.addr) as client, HFPrefixCache(
        client, model, MODEL_ID + " cuda", block_tokens=16
    ) as kv:
        first_prompt = prompt_tokens(tokenizer, chat.ask(QUESTIONS[0]))
        first = kv.generate(first_prompt, 24, eos_token_id=tokenizer.eos_token_id)
        reply = tokenizer.decode(first.tokens, skip_special_tokens=True)
        assert reply.strip(), "the real model gave an empty reply"
        chat.answer(reply)
        second_prompt = prompt_tokens(tokenizer, chat.ask(QUESTIONS[1]))
        second = kv.prefill(second_prompt, store=False)
    held = (len(first.sequence) - 1) // 16 * 16
    assert second.stats.reused_tokens == held > len(first_prompt)
    with torch.no_grad():
        full = model(input_ids=torch.tensor([second_prompt], device="cuda")).logits[0, -1]
    reused = second.logits[0, -1]
    drift = (reused.float() - full.float()).abs().max().item()
    print(f"smollm2 bf16 on cuda: reused {held} tokens, max |dlogit| {drift:.3f}")
    assert int(reused.argmax()) == int(full.argmax())
    assert drift < 0.5  # bf16: logits of tens, a few ulps apart


def test_a_prefix_5x_the_host_tier_goes_out_and_back_window_by_window(
    kvstored_factory: Callable[..., Daemon],
) -> None:
    """The client-driven GPU path with a prefix longer than the daemon's host tier
    (#55): one offload of 160 blocks into a 1 MiB host tier (32 blocks) is stored whole
    through windows onto disk; onboards from where the last ended (each pins one
    window) bring every block back into another cache, byte for byte."""
    nb = 160
    with shm_folder() as folder:
        daemon = kvstored_factory(arena_dir=folder, host_bytes="1MiB", disk_bytes="256MiB")
        src, dst = (
            PagedKV([torch.empty(2, nb, T, H, D, dtype=torch.bfloat16, device="cuda")
                     for _ in range(L)])
            for _ in range(2)
        )  # fmt: skip
        random_(src, 7)
        poison(dst)
        tokens = list(range(1000, 1000 + nb * T + 1))
        ids = list(range(nb))
        with KVClient(daemon.addr) as client, GpuClient(client) as gpu:
            ns = _ns(gpu, "cuda-long-prefix")
            assert gpu.offload(ns, tokens, src, ids).stored == nb
            got = windows = 0
            while got < nb:
                more = gpu.onboard(ns, tokens, dst, ids[got:], start=got).onboarded
                assert more > 0
                got, windows = got + more, windows + 1
        torch.cuda.synchronize()
        assert windows > 1
        for block in ids:
            assert np.array_equal(block_bytes(dst, block), block_bytes(src, block))
        daemon.stop()
