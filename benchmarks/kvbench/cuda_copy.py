"""The rate of one host <-> device copy, timed with CUDA events: the link limit the GPU
benchmarks (``gpu_bench.py``, ``ttft_bench.py``) measure their copies against."""

from __future__ import annotations

import statistics

import torch


def copy_gbs(dst: torch.Tensor, src: torch.Tensor, iters: int = 5) -> float:
    """GB/s (1e9 bytes) of ``dst.copy_(src, non_blocking=True)``: the median of
    ``iters`` copies after a warm-up, each between two events on the current stream.
    With one side in pinned (or registered) host memory this is the link's rate."""
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    ms = []
    for _ in range(iters):
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        ms.append(start.elapsed_time(end))
    return dst.numel() * dst.element_size() / (statistics.median(ms) / 1e3) / 1e9
