"""Throughput of the GPU data path (kvstore.mover, kvstore.host.pinning). A program, not a test.

Two measurements, on ``--device cuda`` (the real thing) or ``--device cpu`` (the same
code on CPU tensors, so the program is smoke-testable anywhere):

1. The link limit: one large copy of ``--link-mib`` between a pinned host buffer and
   the device (CUDA: one ``cudaMemcpyAsync`` H2D and one D2H, timed with events; the
   host side is once ``pin_memory()`` and once a ``cudaHostRegister``'ed arena, to show
   that registration gives the same speed). On CPU: one ``memcpy``-sized tensor copy,
   the ceiling any gather/scatter on CPU can reach.
2. Offload (KV cache -> arena slots) and onboard (slots -> KV cache) of batches of
   ``--batch`` blocks, through :class:`kvstore.mover.Mover` exactly as kvclient and the
   daemon call it, for the Llama-3-8B KV shape (32 layers, 8 KV heads, head dim 128,
   bf16: 128 KiB per token) at each ``--block-tokens``. Slots are one adjacent run
   (what a fresh Reserve gets) or scattered out of order. The vLLM paged layout and the
   HF contiguous layout are measured (``paged1``: the paged layers as views of one
   allocation, which the mover moves with one indexed copy for all layers); ``--naive``
   adds the per-layer-per-block copy loop the mover replaces, for comparison (CPU). On
   a c2c machine the "direct" rows are the same copies done by torch's kernels straight
   into the registered arena. The "kernel" rows (CUDA, where CuPy builds it) are the
   one-launch copy of :mod:`kvstore.block_kernel`: every layer of the batch in one
   launch, reading and writing the mapped slots itself; timed in the same run as the
   torch path they replace.
3. The vLLM connector's worker path (paged layout only): ``PagedLayers.gather`` of the
   batch's pages into host block rows (pinned where CUDA runs, as the worker allocates
   them) and ``scatter`` back, through one device staging buffer, and (CUDA) with the
   one-launch kernel straight between the pages and the pinned rows.

Reported: median GB/s over ``--iters`` runs after a warm-up (1 GB = 1e9 bytes), and the
ratio to the link limit. The paths of one shape run in turns, with the torch path twice
(the ``A/A`` rows: how far two runs of one path differ on this machine). ``--json``
writes every number.

    .venv/bin/python benchmarks/gpu_bench.py --device cpu --block-tokens 8,16,64 --batch 64
    python benchmarks/gpu_bench.py --device cuda --block-tokens 8,16,64 --batch 64,256
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvbench.cuda_copy import copy_gbs  # noqa: E402
from kvclient.integrations.vllm.blocks import PagedLayers  # noqa: E402
from kvstore import block_kernel  # noqa: E402
from kvstore.host.arena import HostArena  # noqa: E402
from kvstore.host.pinning import cuda_pin_hook, device_address  # noqa: E402
from kvstore.kv_caches import HFKV, KVCache, PagedKV, dtype_of  # noqa: E402
from kvstore.mover import MAX_RUN_COPIES, Mover, device_alias  # noqa: E402
from kvstore.platform import detect  # noqa: E402


@dataclass
class Row:
    what: str
    layout: str
    block_tokens: int
    batch: int
    slots: str
    block_bytes: int
    gbs: float
    vs_link: float
    vs_copy: float = float("nan")  # against one copy of the batch's bytes, timed alike


def gb_per_s(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    """Median seconds of ``fn`` (which returns an event or None) after one warm-up."""
    fn()
    sync(device)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        event = fn()
        if isinstance(event, torch.cuda.Event):
            event.synchronize()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def timed_in_turns(
    cases: list[tuple[str, Callable[[], object]]], device: torch.device, iters: int
) -> dict[str, float]:
    """Median seconds of each case, timed in turns (A B A B ...: a machine whose load
    swings hits every case alike) after one warm-up of each."""
    for _, fn in cases:
        fn()
    sync(device)
    times: dict[str, list[float]] = {what: [] for what, _ in cases}
    for _ in range(iters):
        for what, fn in cases:
            start = time.perf_counter()
            event = fn()
            if isinstance(event, torch.cuda.Event):
                event.synchronize()
            sync(device)
            times[what].append(time.perf_counter() - start)
    return {what: statistics.median(values) for what, values in times.items()}


# -- 1. the link ------------------------------------------------------------------------


def link_limit(device: torch.device, nbytes: int, iters: int, tmpdir: str) -> dict[str, float]:
    out: dict[str, float] = {}
    if device.type == "cpu":
        src = torch.ones(nbytes, dtype=torch.uint8)
        dst = torch.zeros(nbytes, dtype=torch.uint8)
        out["memcpy"] = gb_per_s(nbytes, timed(lambda: dst.copy_(src), device, iters))
        return out
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    hosts = {"pin_memory": torch.empty(nbytes, dtype=torch.uint8).pin_memory()}
    arena = HostArena(nbytes, directory=tmpdir, pin=cuda_pin_hook(strict=True))
    hosts["registered arena"] = torch.from_numpy(arena.array())[:nbytes]
    try:
        for name, host in hosts.items():
            host.fill_(1)
            out[f"H2D {name}"] = copy_gbs(dev, host, iters)
            out[f"D2H {name}"] = copy_gbs(host, dev, iters)
    finally:
        del hosts
        arena.close()
    return out


# -- 2. offload / onboard -------------------------------------------------------------------


def make_kv(
    layout: str, args: argparse.Namespace, T: int, pool: int, device: torch.device
) -> KVCache:
    dtype = dtype_of(args.dtype)
    L, H, D = args.layers, args.kv_heads, args.head_dim
    if layout == "paged":
        layers = [torch.empty(2, pool, T, H, D, dtype=dtype, device=device) for _ in range(L)]
        for t in layers:
            t.view(torch.uint8).random_(0, 256)
        return PagedKV(layers)
    if layout == "paged1":  # the layers are views of one allocation: one gather for all
        whole = torch.empty(L, 2, pool, T, H, D, dtype=dtype, device=device)
        whole.view(torch.uint8).random_(0, 256)
        return PagedKV(list(whole.unbind(0)))
    pairs = []
    for _ in range(L):
        k = torch.empty(1, H, pool * T, D, dtype=dtype, device=device)
        v = torch.empty_like(k)
        k.view(torch.uint8).random_(0, 256)
        v.view(torch.uint8).random_(0, 256)
        pairs.append((k, v))
    return HFKV(pairs, T)


def naive_offload(kv: KVCache, ids: list[int], offsets: list[int], arena: torch.Tensor) -> None:
    """What the mover replaces: one copy per layer, per K/V, per block (paged only)."""
    assert isinstance(kv, PagedKV)
    s = kv.shape
    per_kv = s.num_kv_heads * s.block_tokens * s.head_dim
    for block, off in zip(ids, offsets, strict=True):
        slot = arena[off : off + s.block_bytes].view(s.dtype).view(s.num_layers, 2, per_kv)
        for layer, t in enumerate(kv.tensors):
            for x in range(2):
                slot[layer, x].view(s.num_kv_heads, s.block_tokens, s.head_dim).copy_(
                    t[x, block].transpose(0, 1)
                )


def transfers(
    args: argparse.Namespace, device: torch.device, link: float, tmpdir: str
) -> list[Row]:
    rows: list[Row] = []
    for T in args.block_tokens:
        for batch in args.batch:
            for layout in args.layouts:
                rows += one_shape(args, device, link, tmpdir, layout, T, batch)
    return rows


def one_shape(
    args: argparse.Namespace,
    device: torch.device,
    link: float,
    tmpdir: str,
    layout: str,
    T: int,
    batch: int,
) -> list[Row]:
    """Offload and onboard of one batch size, block size and layout, per slot placement."""
    rows: list[Row] = []
    pin = cuda_pin_hook(strict=True) if device.type == "cuda" else None
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    kv = make_kv(layout, args, T, 2 * batch, device)
    bb = kv.shape.block_bytes
    capacity = (2 * batch + 2) * ((bb + 4095) // 4096 * 4096)
    arena = HostArena(capacity, directory=tmpdir, pin=pin)
    try:
        host = torch.from_numpy(arena.array())
        host.fill_(0)  # fault the pages in before timing
        # the torch path twice: the A/A pair says how far two runs of one path differ
        movers = {"": Mover(host, max_run_copies=args.max_run_copies),
                  " A/A": Mover(host, max_run_copies=args.max_run_copies)}
        if device.type == "cuda" and pin and pin.pinned_bytes and block_kernel.load():
            # one launch per batch, the kernel reading and writing the mapped slots
            movers[" kernel"] = Mover(host, device_address=device_address(host.data_ptr()))
        if device.type == "cuda" and detect().direct_host_access and pin and pin.pinned_bytes:
            # c2c: kernels gather/scatter straight into the registered arena
            alias = {device: device_alias(host, device)}
            movers[" direct"] = Mover(host, device_arenas=alias,
                                      max_run_copies=args.max_run_copies)
        all_slots = [arena.alloc(bb) for _ in range(2 * batch)]
        placements = {
            "adjacent": [s for s in all_slots[:batch] if s is not None],
            "scattered": random.Random(0).sample([s for s in all_slots[::2] if s is not None],
                                                 batch),
        }
        ids = random.Random(1).sample(range(kv.num_blocks), batch)
        nbytes = batch * bb
        floor = one_copy(host[:nbytes], device, args.iters)
        for slots_name in args.slots:
            offsets = placements[slots_name]
            assert len(offsets) == batch
            runs: list[tuple[str, Callable[[], object]]] = []
            for tag, m in movers.items():
                runs += [
                    (f"offload{tag}", lambda o=offsets, m=m: m.offload(kv, ids, o, stream=stream)),
                    (f"onboard{tag}", lambda o=offsets, m=m: m.onboard(kv, ids, o, stream=stream)),
                ]
            if args.naive and layout == "paged" and device.type == "cpu":
                runs.append(("offload naive", lambda o=offsets: naive_offload(kv, ids, o, host)))
            for what, seconds in timed_in_turns(runs, device, args.iters).items():
                speed = gb_per_s(nbytes, seconds)
                rows.append(Row(what, layout, T, batch, slots_name, bb, speed, speed / link,
                                speed / floor[what.split()[0]]))
                print_row(rows[-1])
        if layout == "paged":
            rows += connector_rows(kv, ids, device, link, floor, T, batch, args.iters)
    finally:
        arena.close()
    return rows


def one_copy(host: torch.Tensor, device: torch.device, iters: int) -> dict[str, float]:
    """The floor of a batch: one copy of its bytes each way between the (registered)
    arena and the device, timed as the batch is (GB/s by "offload" / "onboard")."""
    other = torch.empty_like(host, device=device)
    return {
        "offload": gb_per_s(host.numel(), timed(
            lambda: host.copy_(other, non_blocking=True), device, iters)),
        "onboard": gb_per_s(host.numel(), timed(
            lambda: other.copy_(host, non_blocking=True), device, iters)),
    }


def connector_rows(
    kv: KVCache, ids: list[int], device: torch.device, link: float, floor: dict[str, float],
    T: int, batch: int, iters: int,
) -> list[Row]:
    """The vLLM connector's worker: pages <-> host block rows (pinned on CUDA)."""
    assert isinstance(kv, PagedKV)
    variants = {"": PagedLayers(kv.tensors, kv.num_blocks, one_launch=False),
                " A/A": PagedLayers(kv.tensors, kv.num_blocks, one_launch=False)}
    if device.type == "cuda" and block_kernel.load():
        variants[" kernel"] = PagedLayers(kv.tensors, kv.num_blocks)
    block = variants[""].block_bytes
    host = torch.empty((batch, block), dtype=torch.uint8, pin_memory=device.type == "cuda")
    host.fill_(0)
    nbytes = batch * block
    cases: list[tuple[str, Callable[[], object]]] = []
    for tag, pages in variants.items():
        cases += [(f"offload connector{tag}", lambda p=pages: p.gather((ids,), host)),
                  (f"onboard connector{tag}", lambda p=pages: p.scatter((ids,), host))]
    rows = []
    for what, seconds in timed_in_turns(cases, device, iters).items():
        speed = gb_per_s(nbytes, seconds)
        rows.append(Row(what, "paged", T, batch, "host rows", block, speed,
                        speed / link, speed / floor[what.split()[0]]))
        print_row(rows[-1])
    return rows


def print_row(r: Row) -> None:
    print(
        f"| {r.what} | {r.layout} | {r.block_tokens} | {r.batch} | {r.slots} | "
        f"{r.block_bytes >> 10} KiB | {r.gbs:.2f} GB/s | {r.vs_link:.0%} | {r.vs_copy:.0%} |",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"),
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--block-tokens", type=lambda s: [int(x) for x in s.split(",")],
                   default=[8, 16, 64])
    p.add_argument("--batch", type=lambda s: [int(x) for x in s.split(",")], default=[64])
    p.add_argument("--layouts", type=lambda s: s.split(","), default=["paged", "hf"])
    p.add_argument("--slots", type=lambda s: s.split(","), default=["adjacent", "scattered"])
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--max-run-copies", type=int, default=MAX_RUN_COPIES,
                   help="more slot runs than this: one indexed copy over rows")
    p.add_argument("--link-mib", type=int, default=1024)
    p.add_argument("--naive", action="store_true", help="also time the per-layer-per-block loop")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    p.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --device cpu", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    info = detect()
    print(f"# platform {info.describe()}")
    print(f"# {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"{torch.get_num_threads()} torch threads, device {device}")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmpdir:
        link = link_limit(device, args.link_mib << 20, args.iters, tmpdir)
        for name, speed in link.items():
            print(f"# link {name}: {speed:.2f} GB/s")
        ceiling = min(link.values())
        print("| op | layout | tokens/block | batch | slots | block | throughput | vs link | "
              "vs one copy |")
        print("|---|---|---|---|---|---|---|---|---|")
        rows = transfers(args, device, ceiling, tmpdir)
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"platform": info.describe(), "device": str(device), "link_gbs": link,
             "rows": [asdict(r) for r in rows]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
