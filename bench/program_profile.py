"""``bench/programs.py --profile K``: where the time of a program's step goes, from ``torch.profiler``
(GPU busy time by kernel kind, GPU idle time, host time inside ``Engine.step``)."""
from __future__ import annotations

import math
import statistics
from collections import Counter

import torch

from bench.program_runs import PROGRAM_FUNCTIONS, StepClock, Workload, program_engine

#: Kernel name pieces of each category of :func:`profile_program` (first match wins).
KERNEL_KINDS = (("attention", ("tree_attention", "tree_attn", "_stage1", "_merge", "attend", "flash")),
                ("gemm", ("gemm", "xmma", "nvjet", "cutlass", "cublas", "matmul", "splitk", "sm90_", "sm80_")))


def profile_program(program: str, method: str, work: Workload, prompt: list[int], args) -> dict:
    """Where the time of a step goes: the program again on a fresh engine under ``torch.profiler``
    over its last ``args.profile`` steps; per step (ms): GPU busy time by kernel kind, GPU idle time
    (wall time less the union of kernel intervals) and host time inside ``Engine.step``."""
    from torch.profiler import ProfilerActivity, profile, schedule

    model = work.model
    engine = program_engine(method, work, prompt, args, program)
    prefill_steps = math.ceil(len(prompt) / engine.prefill_chunk)
    total = args.warmup + args.steps
    active = min(args.profile, args.steps)
    # The profiler records the last `active` steps (a pipelined loop's rolled-back step is one of them).
    wait = prefill_steps + total - active - 1
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if model.device.type == "cuda" else [])
    with profile(activities=activities,
                 schedule=schedule(wait=wait, warmup=1, active=active, repeat=1)) as prof:
        with StepClock(engine, on_step=prof.step) as clock:
            PROGRAM_FUNCTIONS[program](engine, prompt, total, work)
    summary = kernel_summary(prof, active)
    steps = len(clock.ends)
    wall_ms = 1e3 * (clock.ends[-1] - clock.ends[-1 - active]) if steps > active else float("nan")
    return {"steps": active, "wall_ms": wall_ms / active, "gpu_busy_ms": summary["gpu_busy_ms"],
            "gpu_idle_ms": wall_ms / active - summary["gpu_busy_ms"], "kernel_ms": summary["kernel_ms"],
            "kernels_per_step": summary["kernels_per_step"],
            "engine_step_host_ms": 1e3 * statistics.median(clock.host_seconds[-active:]),
            "top_kernels_ms": summary["top_kernels_ms"]}


def kernel_summary(prof, steps: int, top: int = 12) -> dict:
    """The GPU kernels a finished ``torch.profiler`` run recorded, per step over its ``steps`` steps (ms): busy
    time (the union of kernel intervals), time by kernel kind (:data:`KERNEL_KINDS`), kernels a step, and the
    ``top`` kernels by time (names cut to 80 characters)."""
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and e.time_range.end > e.time_range.start and not e.name.startswith("ProfilerStep")]
    by_kind: Counter = Counter()
    names: Counter = Counter()
    for e in kernels:
        name = e.name.lower()
        kind = next((k for k, pieces in KERNEL_KINDS if any(p in name for p in pieces)), "other")
        by_kind[kind] += e.time_range.elapsed_us()
        names[e.name[:80]] += e.time_range.elapsed_us()
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    busy, end = 0.0, -math.inf
    for a, b in spans:
        if b > end:
            busy += b - max(a, end)
            end = b
    return {"gpu_busy_ms": busy / 1e3 / steps, "kernel_ms": {k: v / 1e3 / steps for k, v in sorted(by_kind.items())},
            "kernels_per_step": len(kernels) / steps,
            "top_kernels_ms": {k: round(v / 1e3 / steps, 4) for k, v in names.most_common(top)}}
