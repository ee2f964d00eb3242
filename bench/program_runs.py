"""The programs ``bench/programs.py`` times, and what they run on: each program through its public
function (:data:`PROGRAM_FUNCTIONS`), the inputs every run of a process shares (:class:`Workload`:
the model, the Medusa-64 tree, random heads and draft tokens, random EAGLE drafters), a fresh engine
per method (:func:`program_engine`) and the clock that stamps the return of every engine step
(:class:`StepClock`). ``bench/host_cost.py``, ``bench/host_phases.py`` and ``bench/batch.py`` run the
same programs and inputs.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from treedec.engine import CudaGraphConfig, Engine
from treedec.models import DecoderModel
from treedec.models.eagle_drafter import EagleDrafter
from treedec.models.medusa import MedusaHeads
from treedec.programs.greedy import greedy_generate
from treedec.programs.parallel_sampling import parallel_sample
from treedec.sampling.params import SamplingParams
from treedec.programs.speculative.drafts import TreeDraft
from treedec.programs.speculative.eagle import EagleDraft
from treedec.programs.speculative.medusa import MedusaDraft
from treedec.programs.speculative.program import speculative_generate
from treedec.tree.token_tree import TokenTree
from treedec.workloads.deft import MedusaTree, medusa_tree

PROGRAMS = ["greedy", "tree_verify", "medusa_heads", "parallel_sample", "eagle", "eagle3", "eagle_chains",
            "eagle3_chains"]
EAGLE_PROGRAMS = {"eagle": "eagle", "eagle3": "eagle3", "eagle_chains": "eagle", "eagle3_chains": "eagle3"}
EAGLE3_DRAFT_VOCAB = 32000


@dataclass
class Workload:
    """What every run of one process shares: the model, the tree, the heads, the draft tokens."""

    model: DecoderModel
    medusa: MedusaTree
    heads: MedusaHeads
    draft_tokens: list[int]
    samples: int
    seed: int
    pipeline: bool | None = None   # all programs but EAGLE's (None: on for a GPU)
    eagle_depth: int = 5
    eagle_top_k: int = 8
    drafters: dict = None          # kind -> EagleDrafter, made at first use
    drafter_engine: dict = None    # the Engine options of the run's method (set per run)

    def drafter(self, kind: str) -> EagleDrafter:
        self.drafters = self.drafters or {}
        if kind not in self.drafters:
            self.drafters[kind] = random_drafter(self.model, kind, self.seed)
        return self.drafters[kind]


@dataclass
class ProgramRun:
    """What a program reports back: its engine steps after the prefill, the KV tokens each read, and the engine
    steps launched past the last one and rolled back (a pipelined speculative loop launches one before it reads
    the stop)."""

    steps: int
    kv_tokens: list[int]
    extra: dict
    rolled_back: int = 0


# ===================================================================== programs


def _greedy(engine: Engine, prompt: list[int], steps: int, work: Workload) -> ProgramRun:
    greedy_generate(engine, prompt, max_new_tokens=steps + 1, pipeline=work.pipeline)
    return ProgramRun(steps, [len(prompt) + i + 1 for i in range(steps)], {})


def _tree_verify(engine: Engine, prompt: list[int], steps: int, work: Workload) -> ProgramRun:
    draft = TreeDraft(TokenTree(tuple(work.medusa.parents.tolist())), work.draft_tokens)
    return _speculative(engine, prompt, steps, draft, work.pipeline)


def _medusa_heads(engine: Engine, prompt: list[int], steps: int, work: Workload) -> ProgramRun:
    return _speculative(engine, prompt, steps, MedusaDraft(work.heads, work.medusa.paths), work.pipeline)


def _parallel_sample(engine: Engine, prompt: list[int], steps: int, work: Workload) -> ProgramRun:
    generator = torch.Generator(engine.device).manual_seed(work.seed)
    result = parallel_sample(engine, prompt, work.samples, max_new_tokens=steps + 1,
                             params=SamplingParams(temperature=1.0), generator=generator, pipeline=work.pipeline)
    n = result.stats.steps
    return ProgramRun(n, [len(prompt) + work.samples * (i + 1) for i in range(n)], {})


def _speculative(engine: Engine, prompt: list[int], steps: int, draft, pipeline: bool | None = None) -> ProgramRun:
    """``steps`` verification steps when nothing is accepted (random weights: nearly so); fewer otherwise."""
    _, stats = speculative_generate(engine, prompt, draft, max_new_tokens=steps + 1, pipeline=pipeline)
    # Before step i the sequence holds the prompt and (accepted + bonus) of every earlier step;
    # step i adds its root and draft tokens.
    before = np.cumsum([0] + [a + 1 for a in stats.accepted[:-1]])
    kv = [len(prompt) + int(b) + d + 1 for b, d in zip(before, stats.draft_sizes)]
    return ProgramRun(stats.steps, kv, {"accepted": stats.accepted, "pipelined": stats.pipelined,
                                        "pipeline_note": stats.pipeline_note,
                                        "draft_ms": [1e3 * s for s in stats.draft_seconds],
                                        "verify_ms": [1e3 * s for s in stats.verify_seconds]},
                      rolled_back=1 if stats.pipelined else 0)


def _eagle(kind: str, tree: str):
    def run(engine: Engine, prompt: list[int], steps: int, work: Workload) -> ProgramRun:
        drafter = Engine(work.drafter(kind), **work.drafter_engine)
        if tree == "chains":   # (a fixed tree of top-k * depth tokens: pipelined like the other fixed trees)
            draft = EagleDraft(drafter, depth=work.eagle_depth, top_k=work.eagle_top_k, tree="chains")
            out = _speculative(engine, prompt, steps, draft, work.pipeline)
        else:
            draft = EagleDraft(drafter, depth=work.eagle_depth, top_k=work.eagle_top_k,
                               total_tokens=work.medusa.size - 1)
            out = _speculative(engine, prompt, steps, draft)
        out.extra["drafter_graph_stats"] = dict(drafter.graph_stats)
        return out
    return run


PROGRAM_FUNCTIONS = {"greedy": _greedy, "tree_verify": _tree_verify, "medusa_heads": _medusa_heads,
                     "parallel_sample": _parallel_sample,
                     **{p: _eagle(k, "chains" if p.endswith("_chains") else "dynamic")
                        for p, k in EAGLE_PROGRAMS.items()}}


# ===================================================================== inputs and engines


def random_workload(model: DecoderModel, rng: np.random.Generator, tree_size: int = 64, samples: int = 16, seed: int = 0,
                    pipeline: bool | None = None) -> Workload:
    """The programs' inputs for ``model``: the Medusa tree of ``tree_size`` tokens, random heads (one per
    tree level, seeded by ``seed``), random draft tokens from ``rng``."""
    medusa = medusa_tree(tree_size)
    return Workload(model, medusa, random_heads(model, int(medusa.depth.max()), seed),
                    rng.integers(0, model.config.vocab_size, medusa.size - 1).tolist(), samples, seed, pipeline)


def random_drafter(model: DecoderModel, kind: str, seed: int) -> EagleDrafter:
    """A random EAGLE-1 (``kind="eagle"``) or EAGLE-3 (``"eagle3"``: a draft vocabulary of
    ``EAGLE3_DRAFT_VOCAB`` tokens, as the EAGLE-3 Llama-3.1 release, or the whole vocabulary if smaller)
    drafter for ``model``, seeded by ``seed``."""
    vocab = min(EAGLE3_DRAFT_VOCAB, model.config.vocab_size) if kind == "eagle3" else None
    return EagleDrafter.random(model, kind, seed=seed, draft_vocab_size=vocab)


def random_heads(model: DecoderModel, num_heads: int, seed: int) -> MedusaHeads:
    """Medusa heads with PyTorch's default random init (one ResBlock each), in the model's dtype and device."""
    c = model.config
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if model.device.type == "cuda" else []):
        torch.manual_seed(seed)
        return MedusaHeads(c.hidden_size, c.vocab_size, num_heads, dtype=model.dtype, device=model.device)


def program_engine(method: str, work: Workload, prompt: list[int], args, program: str = "") -> Engine:
    """A fresh engine for ``method``: graphs (uncaptured on the CPU, where they run the triton kernels),
    ``compile_model`` for ``graphs_model``; the KV pool sized from free memory on a GPU, on the CPU
    big enough for the prompt and the steps. An EAGLE program's pools (the target's and its drafter's,
    whose options go to ``work.drafter_engine``) are sized for the prompt and the steps everywhere. The target's
    pool stores ``args.kv_cache_dtype`` (a drafter's stays in its dtype), in the batch-invariant mode with
    ``args.batch_invariant``."""
    device = work.model.device
    graphs, backend = False, args.backend
    if method.startswith("graphs"):
        graphs = CudaGraphConfig(capture=device.type == "cuda")
        backend = "triton" if device.type != "cuda" else args.backend
    sized = 2 * len(prompt) + 4096
    work.drafter_engine = {"kv_tokens": sized, "page_size": args.page_size, "backend": backend, "cuda_graphs": graphs}
    return Engine(work.model, kv_tokens=sized if device.type != "cuda" or program in EAGLE_PROGRAMS else None,
                  page_size=args.page_size, backend=backend, cuda_graphs=graphs,
                  compile_model=method == "graphs_model", kv_cache_dtype=args.kv_cache_dtype,
                  batch_invariant=args.batch_invariant)


# ===================================================================== timing


class StepClock:
    """Stamps the return of every step of ``engine`` (no device synchronisation) and its graph counters.

    Wraps ``engine.step`` on the instance for the ``with`` block: the programs and
    ``Engine.prefill`` call it through the attribute. ``on_step`` is called after each stamp
    (the profiler's ``step``).
    """

    def __init__(self, engine: Engine, on_step=None):
        self.engine = engine
        self.ends: list[float] = []
        self.host_seconds: list[float] = []   # inside Engine.step
        self.graph_stats: list[Counter] = []
        self.start = 0.0
        self.on_step = on_step

    def __enter__(self) -> "StepClock":
        step, engine = self.engine.step, self.engine

        def timed_step(*args, **kwargs):
            began = time.perf_counter()
            out = step(*args, **kwargs)
            self.ends.append(time.perf_counter())
            self.host_seconds.append(self.ends[-1] - began)
            self.graph_stats.append(Counter(engine.graph_stats))
            if self.on_step is not None:
                self.on_step()
            return out

        self.engine.step = timed_step
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        del self.engine.step
