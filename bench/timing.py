"""Timers for bench/attention.py: kernel time, device copy bandwidth, per-call time inside a CUDA graph."""
from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import torch


def time_us(fn: Callable[[], object], device: torch.device) -> float:
    """Median time of one call in microseconds.

    CUDA: ``triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")`` (it
    flushes the L2 cache between calls). CPU: median of ``time.perf_counter`` over a few calls.
    """
    if device.type == "cuda":
        import triton.testing
        return 1e3 * triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def copy_bandwidth(device: torch.device) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    numel = (1 << 30) // 2 if device.type == "cuda" else (1 << 26) // 2   # 1 GiB on a GPU, 64 MiB on a CPU
    src = torch.randn(numel, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    seconds = time_us(lambda: dst.copy_(src), device) * 1e-6
    return 2 * src.numel() * src.element_size() / seconds


def graphed_us(runs: Sequence[Callable[[], object]], calls: int = 32) -> float:
    """Per-call time of ``calls`` calls cycling over ``runs`` (one per KV copy) captured in one CUDA graph.

    Launch overhead is amortized; with distinct KV copies no call reuses another's KV in L2,
    as across the layers of a model.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (lazy init, autotuning) outside the capture
        for run in runs:
            run()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            runs[i % len(runs)]()
    return time_us(graph.replay, torch.device("cuda")) / calls


def methods_in_order(model, all_methods: Sequence[str], chosen: Sequence[str]):
    """The engine methods of ``chosen`` in ``all_methods``' order (``hf_sdpa`` excluded); before the
    first ``*_compiled`` one, ``model.compile_pointwise()`` runs (it cannot be undone, hence the order)."""
    compiled = False
    for method in [m for m in all_methods if m in chosen and m != "hf_sdpa"]:
        if method.endswith("_compiled") and not compiled:
            model.compile_pointwise()
            compiled = True
        yield method
