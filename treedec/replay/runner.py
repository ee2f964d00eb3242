"""Replay a schedule through the real engine and measure every step.

    model = from_config("tiny", dtype=torch.float32, device="cpu")
    run = replay(model, workload_schedule("tot-sorting", iterations=20), ReplayConfig(planner="flatten"))
    run.summary["decode_ms_mean"], run.steps[5]["kv_io_bytes"]

Per step (results JSON ``runs[i].steps``):

- ``total_ms``: wall time from the step's first op until its tokens are on the host (the
  controller reads them: a device synchronisation ends every step, as in a decoding loop);
- ``prefill_ms``: the prompts' prefills (a ``prompt`` op runs its own forwards, unless it is
  pending: then the step's forward computes it, and the step's kind is still ``prefill``);
- ``bookkeeping_ms``: the tree operations (branch / extend / token tree / accept, with its
  K/V move / prune) and finding each node's logits row;
- ``plan_ms``: :meth:`TreeAttention.plan` of the step's forward (host planning + the copy of
  the plan to the device);
- ``attention_ms``: time inside :meth:`TreeAttention.run`, summed over the layers. On a
  GPU only with ``profile_split`` (CUDA events around every call, which adds a little
  launch overhead), else null; on the CPU always (wall time, nothing is asynchronous);
- ``other_ms``: the rest of the forward (projections, MLP, norms, logits, launches, and
  the attention when it is not measured);
- ``kv_io_bytes``: K and V bytes the attention kernels load, from the plan: KV tokens read
  per KV head (each chunk once per work item) x KV heads x head dim x 2 x dtype bytes x
  layers;
- ``kv_pages``: pages of the KV pool in use after the step's ops.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import statistics
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from treedec.attention import PlanConfig
from treedec.checks import int_in_range
from treedec.engine import Engine
from treedec.models import DecoderModel
from treedec.replay.driver import ScheduleDriver, dry_run
from treedec.workloads.schedule import DEFAULT_MAX_TREE_TOKENS, Prompt, Schedule


@dataclass(frozen=True)
class ReplayConfig:
    """How to replay.

    ``kv_tokens`` None sizes the pool to the schedule's peak (from a dry run) plus one
    page, at most ``max_kv_tokens`` (a schedule needing more is refused before anything is
    allocated: its counts can ask for any number of tokens). ``warmup_steps`` replays that
    many steps after step 0 once, untimed, before the timed run (kernel compilation,
    allocator warm-up, graph captures). ``cuda_graphs`` replays the engine's steps from
    CUDA graphs (a GPU and a kernel backend); attention is then not timed on its own, so it
    excludes ``profile_split``.
    """

    planner: str = "flatten"
    backend: str = "auto"
    page_size: int = 16
    kv_tokens: int | None = None
    max_kv_tokens: int = DEFAULT_MAX_TREE_TOKENS
    profile_split: bool = False
    warmup_steps: int = 0
    seed: int = 0
    progress: bool = False
    cuda_graphs: bool = False
    kv_cache_dtype: str = "auto"

    def __post_init__(self):
        if self.cuda_graphs and self.profile_split:
            raise ValueError("ReplayConfig: profile_split times attention alone, which a CUDA graph cannot; "
                             "choose one of cuda_graphs and profile_split")
        for name, minimum in (("page_size", 1), ("kv_tokens", 1), ("max_kv_tokens", 1), ("warmup_steps", 0)):
            value = getattr(self, name)
            if name != "kv_tokens" or value is not None:
                int_in_range(f"ReplayConfig.{name}", value, minimum)


@dataclass
class ReplayRun:
    """One replay: per-step measurements, a summary, and every token the model chose."""

    planner: str
    backend: str
    steps: list[dict]
    summary: dict
    emitted: list[int] = field(repr=False)

    def to_json(self) -> dict:
        digest = hashlib.sha256(json.dumps(self.emitted).encode()).hexdigest()
        return {"planner": self.planner, "backend": self.backend, "summary": self.summary,
                "emitted_tokens_sha256": digest, "steps": self.steps}


class AttentionTimer:
    """Wraps an engine's :class:`TreeAttention` to time ``run`` (planning and KV reads are in ``engine.stats``).

    Everything else is forwarded to the wrapped object.
    """

    def __init__(self, attn, time_run: bool):
        self._attn = attn
        self.time_run = time_run
        self.cuda = attn.device.type == "cuda"
        self.reset()

    def __getattr__(self, name):
        return getattr(self._attn, name)

    def reset(self) -> None:
        self._run_seconds = 0.0
        self._events: list = []

    def run(self, *args, **kwargs):
        if not self.time_run:
            return self._attn.run(*args, **kwargs)
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = self._attn.run(*args, **kwargs)
            end.record()
            self._events.append((start, end))
            return out
        t0 = time.perf_counter()
        out = self._attn.run(*args, **kwargs)
        self._run_seconds += time.perf_counter() - t0
        return out

    def run_seconds(self) -> float | None:
        """Attention time since :meth:`reset` (None when ``run`` is not timed)."""
        if not self.time_run:
            return None
        if self._events:
            self._events[-1][1].synchronize()
        return self._run_seconds + sum(s.elapsed_time(e) for s, e in self._events) / 1e3


@contextlib.contextmanager
def timed_attention(engine: Engine, time_run: bool) -> Iterator[AttentionTimer]:
    """``engine.attn`` wrapped in an :class:`AttentionTimer` for the ``with`` block (and so every layer that runs
    it, ``engine.attention.layer_attn``); the engine's own attention is put back when the block ends, also when it
    raises."""
    attn, layers = engine.attn, engine.attention
    timer = AttentionTimer(attn, time_run=time_run)
    engine.attn = timer
    engine.attention = dataclasses.replace(layers, layer_attn=tuple(timer if a is attn else a for a in layers.layer_attn))
    try:
        yield timer
    finally:
        engine.attn, engine.attention = attn, layers


def replay(model: DecoderModel, schedule: Schedule, config: ReplayConfig = ReplayConfig()) -> ReplayRun:
    """Replay ``schedule`` on ``model`` with a fresh :class:`Engine`; the tree is empty again at the end.

    Everything that can be checked before a forward is, and before anything is allocated
    (the tree's tokens against the KV pool's capacity, positions against the model's
    ``max_position`` and sliding window, token ids against the vocabulary: a
    :class:`~treedec.workloads.ScheduleError` naming the op; then the pool against the
    dry run's peak pages: a ValueError), so a schedule that cannot run fails before its
    first step.
    """
    c = model.config
    capacity = config.kv_tokens or config.max_kv_tokens
    positions, position_limit = c.max_position, "the model's max_position (max_position_embeddings)"
    if c.sliding_window is not None and c.sliding_window < c.max_position:
        positions, position_limit = c.sliding_window, "the model's sliding window"
    schedule.check_fits(max_tree_tokens=capacity, max_position=positions, vocab_size=c.vocab_size,
                        tokens_limit="kv_tokens" if config.kv_tokens else "max_kv_tokens",
                        position_limit=position_limit)
    sizing = dry_run(schedule, config.page_size, max_tree_tokens=capacity)
    pages = max(sizing["peak_pages"], schedule.stats.widest_branch)   # a branch of k children needs k pages
    need = (pages + 1) * config.page_size
    if config.kv_tokens is None and need > config.max_kv_tokens:
        raise ValueError(f"{schedule.source} needs a KV pool of {need} tokens ({pages} pages of "
                         f"{config.page_size}, one page spare), more than max_kv_tokens={config.max_kv_tokens}")
    kv_tokens = config.kv_tokens or need
    if kv_tokens < pages * config.page_size:
        raise ValueError(f"kv_tokens={kv_tokens} is too small: {schedule.source} holds up to "
                         f"{sizing['peak_pages']} pages of {config.page_size} tokens and branches into up to "
                         f"{schedule.stats.widest_branch} children (a page each)")
    engine = Engine(model, kv_tokens=kv_tokens, page_size=config.page_size, backend=config.backend,
                    plan_config=PlanConfig(planner=config.planner), cuda_graphs=config.cuda_graphs,
                    kv_cache_dtype=config.kv_cache_dtype)
    with timed_attention(engine, time_run=config.profile_split or engine.device.type != "cuda") as timer:
        if config.warmup_steps:
            warm = ScheduleDriver(engine, seed=config.seed)
            for step in schedule.steps[:config.warmup_steps + 1]:
                for op in step:
                    warm.apply(op)
                warm.forward()
            warm.release()
        io_bytes_per_token = engine.pool.bytes_per_token   # (its K/V dtype's: fp8 reads half the bytes)
        driver = ScheduleDriver(engine, seed=config.seed)
        pool = engine.pool
        steps = []
        started = time.perf_counter()
        for i, step in enumerate(_progress(schedule, config)):
            timer.reset()
            t0 = time.perf_counter()
            prefill = 0.0
            for op in step:
                if isinstance(op, Prompt) and not op.pending:   # a pending prompt is computed by the step's forward
                    tp = time.perf_counter()
                    driver.apply(op)
                    prefill += time.perf_counter() - tp
                else:
                    driver.apply(op)
            t_ops = time.perf_counter()
            kv_pages = pool.num_pages - pool.num_free_pages
            queries = driver.pending
            plan_prefill, io_prefill = engine.stats["plan_seconds"], engine.stats["kv_tokens_read"]
            attention_prefill = timer.run_seconds()
            driver.layout_seconds = 0.0
            ran = driver.forward() is not None
            t1 = time.perf_counter()
            plan = engine.stats["plan_seconds"] - plan_prefill
            attention = timer.run_seconds()
            attention = None if attention is None else attention - attention_prefill
            bookkeeping = (t_ops - t0 - prefill) + driver.layout_seconds
            forward = (t1 - t_ops) - driver.layout_seconds
            kind = "prefill" if any(isinstance(op, Prompt) for op in step) else "decode" if ran else "edit"
            steps.append({
                "step": i, "kind": kind, "queries": queries, "tree_tokens": engine.tree.num_tokens,
                "kv_pages": kv_pages, "total_ms": 1e3 * (t1 - t0), "prefill_ms": 1e3 * prefill,
                "bookkeeping_ms": 1e3 * bookkeeping, "plan_ms": 1e3 * plan,
                "attention_ms": None if attention is None else 1e3 * attention,
                "other_ms": 1e3 * (forward - plan - (attention or 0.0)) if ran else 0.0,
                "kv_io_bytes": (engine.stats["kv_tokens_read"] - io_prefill) * io_bytes_per_token,
            })
        wall = time.perf_counter() - started
        driver.release()
        engine.tree.check_invariants()
        summary = _summary(steps, sizing)
        summary.update(tokens_generated=driver.generated, wall_s=wall, kv_pool_pages=pool.num_pages,
                       pages_free_at_end=pool.num_free_pages == pool.num_pages)
    return ReplayRun(planner=config.planner, backend=engine.attn.backend, steps=steps, summary=summary,
                     emitted=driver.emitted)


def replay_results(model: DecoderModel, schedule: Schedule, configs: list[ReplayConfig], model_name: str,
                   workload: str) -> dict:
    """Replay ``schedule`` once per config (e.g. one per planner) and gather the results JSON."""
    runs = [replay(model, schedule, cfg) for cfg in configs]
    device = model.device
    return {
        "workload": workload,
        "schedule": {"name": schedule.name, "source": schedule.source, "steps": len(schedule),
                     "meta": schedule.meta, "stats": dataclasses.asdict(schedule.stats)},
        "model": model_name, "dtype": str(model.dtype).removeprefix("torch."),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "page_size": configs[0].page_size, "profile_split": configs[0].profile_split,
        "cuda_graphs": configs[0].cuda_graphs, "kv_cache_dtype": configs[0].kv_cache_dtype,
        "runs": [r.to_json() for r in runs],
        "same_tokens": len({json.dumps(r.emitted) for r in runs}) == 1,
    }


def _summary(steps: list[dict], sizing: dict) -> dict:
    decode = [s for s in steps if s["kind"] == "decode"]
    total = [s["total_ms"] for s in decode]

    def add(key):
        values = [s[key] for s in decode]
        return None if any(v is None for v in values) else sum(values)

    return {
        "decode_steps": len(decode), "decode_ms_total": sum(total),
        "decode_ms_mean": statistics.fmean(total) if total else None,
        "decode_ms_median": statistics.median(total) if total else None,
        "attention_ms_total": add("attention_ms"), "plan_ms_total": add("plan_ms"),
        "bookkeeping_ms_total": add("bookkeeping_ms"), "other_ms_total": add("other_ms"),
        "kv_io_bytes_total": add("kv_io_bytes"), "queries": sum(s["queries"] for s in decode),
        "prefill_ms_total": sum(s["prefill_ms"] for s in steps),
        "peak_kv_pages": max((s["kv_pages"] for s in steps), default=0),
        "dry_run_peak_pages": sizing["peak_pages"],
    }


def _progress(schedule: Schedule, config: ReplayConfig):
    if not config.progress:
        return schedule.steps
    from tqdm import tqdm
    return tqdm(schedule.steps, desc=f"{schedule.name} [{config.planner}]", unit="step")
