"""Layer-wise loading on a GPU: do the copies overlap the compute? A program.

One hit of the transformers adapter, taken apart, for a Llama-3-8B-shaped random model
(bf16) and a ``--tokens`` prefix in a pinned arena (``/dev/shm``): the copies alone
(every layer of the prefix, one launch per layer on a side stream), the compute alone
(``--new`` tokens attending to the loaded prefix), and both together as the adapter
runs them (each decoder layer waits for its own layer's event), for several grid sizes
of the copy kernel (``--blocks-per-sm``: fewer thread blocks leave the multiprocessors
to the model's kernels). Cases run in turns, the first combined case twice (A/A);
medians of ``--repeat``.

    python3 benchmarks/overlap_bench.py --tokens 16384 --blocks-per-sm 16,4,1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvbench.models import random_llama  # noqa: E402
from kvclient.integrations.hf import cache as hf_cache  # noqa: E402
from kvstore.host.arena import HostArena  # noqa: E402
from kvstore.host.pinning import cuda_pin_hook, device_address  # noqa: E402
from kvstore.kv_caches import HFKV  # noqa: E402
from kvstore.mover import Mover  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--new", type=int, default=16)
    p.add_argument("--block-tokens", type=int, default=16)
    p.add_argument("--blocks-per-sm", type=lambda s: [int(x) for x in s.split(",")],
                   default=[16, 4, 1])
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args(argv)
    device = torch.device("cuda")
    model = random_llama("llama3-8b", seed=0, dtype=torch.bfloat16, device=device,
                         max_position_embeddings=args.tokens + args.new + 16)
    cfg = model.config
    L, H, D, T = cfg.num_hidden_layers, cfg.num_key_value_heads, 128, args.block_tokens
    n = args.tokens // T
    block_bytes = L * 2 * H * T * D * 2
    with tempfile.TemporaryDirectory(dir="/dev/shm") as folder:
        arena = HostArena(n * block_bytes + (1 << 20), directory=folder,
                          pin=cuda_pin_hook(strict=True))
        host = torch.from_numpy(arena.array())
        offsets = [arena.alloc(block_bytes) for _ in range(n)]
        assert all(o is not None for o in offsets)
        start = offsets[0]
        values = host[start : start + n * block_bytes].view(torch.bfloat16)
        values.copy_((torch.randn(values.numel() // 64) * 0.5).to(torch.bfloat16).repeat(64))
        mover = Mover(host, device_address=device_address(host.data_ptr()))
        side = torch.cuda.Stream()
        ids = list(range(n))
        new_ids = torch.randint(0, cfg.vocab_size, (1, args.new), device=device)
        positions = torch.arange(args.tokens, args.tokens + args.new, device=device)[None]

        def load(blocks_per_sm: int) -> tuple[object, list[torch.cuda.Event]]:
            kv = torch.empty(L, 2, 1, H, args.tokens + args.new, D, dtype=torch.bfloat16,
                             device=device)
            kv.record_stream(side)
            events = mover.onboard_layers(HFKV(kv[..., : n * T, :], T), ids, offsets,
                                          stream=side, blocks_per_sm=blocks_per_sm)
            assert events is not None
            rooms = [(kv[i, 0], kv[i, 1]) for i in range(L)]
            return hf_cache.reserved_cache(cfg, rooms, n * T), events

        def forward(cache: object, events: list[torch.cuda.Event] | None) -> None:
            current = torch.cuda.current_stream()
            wait = (lambda i: current.wait_event(events[i])) if events else (lambda i: None)
            with torch.no_grad(), hf_cache.waiting_layers(model, wait):
                model(input_ids=new_ids, past_key_values=cache, position_ids=positions,
                      use_cache=True, logits_to_keep=1)

        def copies(bps: int) -> Callable[[], None]:
            return lambda: load(bps)[1][-1].synchronize()

        def together(bps: int) -> Callable[[], None]:
            return lambda: forward(*load(bps))

        def unordered(bps: int) -> Callable[[], None]:
            """Diagnostic only (the model reads layers still being copied): whether the
            copies and the compute run at once at all when nothing orders them."""

            def run() -> None:
                cache, events = load(bps)
                forward(cache, None)
                events[-1].synchronize()

            return run

        def compute() -> None:
            cache, events = load(16)
            events[-1].synchronize()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            forward(cache, None)
            torch.cuda.synchronize()
            compute_times.append(time.perf_counter() - t0)

        cases: dict[str, Callable[[], None]] = {}
        for bps in args.blocks_per_sm:
            cases[f"copies alone, {bps} blocks/SM"] = copies(bps)
            cases[f"copies + compute, {bps} blocks/SM"] = together(bps)
            cases[f"copies + compute unordered (diagnostic), {bps} blocks/SM"] = unordered(bps)
        # the first case again: how far two runs of one case differ here (A/A)
        first = args.blocks_per_sm[0]
        cases[f"copies + compute, {first} blocks/SM (A/A)"] = together(first)
        times: dict[str, list[float]] = {name: [] for name in cases}
        compute_times: list[float] = []
        for fn in cases.values():  # warm-up
            fn()
        compute()
        compute_times.clear()
        for _ in range(args.repeat):
            for name, fn in cases.items():
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                times[name].append(time.perf_counter() - t0)
            compute()
        link_ms = n * block_bytes / 55.4e9 * 1e3
        print(f"# {torch.cuda.get_device_name()}: {args.tokens} tokens, "
              f"{n * block_bytes / (1 << 20):,.0f} MiB prefix, {args.new} new tokens; "
              f"prefix over a 55.4 GB/s link: {link_ms:.1f} ms")
        print(f"compute alone (loaded prefix): {statistics.median(compute_times) * 1e3:.1f} ms")
        for name, values_ in times.items():
            print(f"{name}: {statistics.median(values_) * 1e3:.1f} ms "
                  f"(min {min(values_) * 1e3:.1f})")
        arena.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
