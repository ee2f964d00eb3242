"""Tree-of-Thought search (Yao et al., 2023) on the engine's decoding tree: BFS and DFS.

A search state is a node of ``engine.tree``: the task's prompt (the search root) and the
thoughts so far, each thought a child node of the one before. Expanding a set of states:

1. *step prompt*: ``task.step_prompt(thoughts)``, when not empty, becomes a child of each
   state's node; one engine step computes all of them.
2. *thoughts*: each state's node (or its step prompt) gets ``k`` children, each starting
   with one of the k best (``temperature == 0``) or k sampled first tokens; then every
   unfinished thought of every state takes one token per engine step, all in the same step,
   until its text contains a string of ``task.thought_stop``, its newest token is an EOS
   id, or it has ``task.thought_max_tokens`` tokens (a random model never writes a stop
   string: the token limit is what ends its thoughts).
3. *evaluation*: ``task.value_prompt(thoughts)`` becomes a child of each thought's node, so
   it reads the thought's KV where it lies; all of them run in one step (more when they
   exceed ``engine.prefill_chunk`` tokens together). Each evaluation node then gets
   ``value_samples`` outputs of up to ``task.value_max_tokens`` tokens, decoded together,
   which ``task.parse_value`` turns into the thought's value; the evaluation nodes are pruned.

Nothing shared is recomputed or copied: a thought's tokens are computed once and read in
place by its evaluation and by every thought below it. :func:`tot_bfs` keeps the ``n`` best
thoughts of each level (greedy, or sampled in proportion to their values) and prunes the
others at once, with any state none of whose thoughts was kept (their pages are freed).
:func:`tot_dfs` goes into the best thought first, prunes thoughts valued below a threshold,
and backtracks (prunes the subtree) when a state's thoughts are used up. Both stop at the
first thought ``task.is_solved`` accepts and free every page of the search at the end.

The task, tokenizer, configurations and results are defined in :mod:`treedec.programs.tot.task`
(and import from here too).
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

import numpy as np

from treedec.engine import Engine
from treedec.runtime.request import MODEL_EOS, Positions, eos_token_ids
from treedec.runtime.program import Program, ProgramContext
from treedec.runtime.scheduler import SchedulerStats, run_program, run_programs
from treedec.programs.tot.search import ToTSearch, encode_checked
from treedec.programs.tot.task import (SELECTIONS, BFSConfig, ByteTokenizer, DFSConfig, LevelStats, ToTResult, ToTState,
                                     ToTTask, Tokenizer, check_task)

__all__ = ["SELECTIONS", "BFSConfig", "ByteTokenizer", "DFSConfig", "LevelStats", "ToTProgram", "ToTResult", "ToTState",
           "ToTTask", "Tokenizer", "tot_batch", "tot_bfs", "tot_dfs"]


# ================================================================ the searches


def tot_bfs(engine: Engine, task: ToTTask, tokenizer: Tokenizer, config: BFSConfig = BFSConfig(), *,
            progress: bool = False, on_level: Callable[[LevelStats], None] | None = None,
            eos_token_id: int | Sequence[int] | str | None = MODEL_EOS) -> ToTResult:
    """Breadth-first ToT: ``config.depth`` levels of k thoughts per kept state, n kept per level.

    Every level's thoughts decode together (one engine step per token for all of them) and
    are evaluated together; the thoughts not kept are pruned right after the selection.
    The search stops early at a level where ``task.is_solved`` accepts a thought. The
    engine must have no pending tokens; its tree is left as it was found.

    ``on_level(stats)`` is called after each level's pruning (the tree then holds the prompt
    and the kept states' paths); ``progress`` shows a progress bar of engine steps. A thought
    or value output also ends on an EOS id (kept as its last token): ``eos_token_id`` is
    ``"model"`` (default: ``engine.model.eos_token_ids``), an id, several ids, or None.
    """
    if not isinstance(config, BFSConfig):
        raise TypeError(f"config must be a BFSConfig, got {type(config).__name__}")
    return run_program(engine, ToTProgram(engine, task, tokenizer, config, progress=progress, on_level=on_level,
                                          eos_token_id=eos_token_id))


def tot_dfs(engine: Engine, task: ToTTask, tokenizer: Tokenizer, config: DFSConfig = DFSConfig(), *,
            progress: bool = False, on_level: Callable[[LevelStats], None] | None = None,
            eos_token_id: int | Sequence[int] | str | None = MODEL_EOS) -> ToTResult:
    """Depth-first ToT with a value threshold and backtracking.

    Expanding a state makes its k thoughts (decoded and evaluated together). Thoughts valued
    below ``config.threshold`` are pruned at once; the others are visited best first, each
    one's subtree pruned when the search comes back from it (its siblings wait in the tree
    with their KV, so backtracking recomputes nothing). Thoughts at ``config.depth`` are not
    expanded: those at or above the threshold are the result's ``best``. The search stops
    at the first thought ``task.is_solved`` accepts or after ``config.max_expansions``
    expansions. ``on_level`` is called after each expansion's pruning; ``eos_token_id`` as
    in :func:`tot_bfs`.
    """
    if not isinstance(config, DFSConfig):
        raise TypeError(f"config must be a DFSConfig, got {type(config).__name__}")
    return run_program(engine, ToTProgram(engine, task, tokenizer, config, progress=progress, on_level=on_level,
                                          eos_token_id=eos_token_id))


def tot_batch(engine: Engine, tasks: Sequence[ToTTask], tokenizer: Tokenizer,
              config: BFSConfig | DFSConfig = BFSConfig(), *, progress: bool = False,
              eos_token_id: int | Sequence[int] | str | None = MODEL_EOS,
              on_task_done: Callable[[int, ToTResult], None] | None = None
              ) -> tuple[list[ToTResult], SchedulerStats]:
    """One ToT search per task, all in the engine's forest at once (:mod:`treedec.runtime.scheduler`):
    every engine step computes the thoughts, evaluations and prompts of every live search.

    Each search is the one :func:`tot_bfs` (a :class:`BFSConfig`) or :func:`tot_dfs` (a
    :class:`DFSConfig`) runs alone: the same thoughts, values and result (each search draws from
    its own generator, seeded by ``config.seed``). Returns the results in task order and the
    scheduler's counters; ``progress`` shows a progress bar over the tasks, ``on_task_done(index,
    result)`` is called as each search ends.
    """
    programs = [ToTProgram(engine, task, tokenizer, config, eos_token_id=eos_token_id) for task in tasks]
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(programs), desc="ToT tasks", unit="task")

    def done(index: int, result: ToTResult) -> None:
        if bar is not None:
            bar.update(1)
        if on_task_done is not None:
            on_task_done(index, result)

    try:
        return run_programs(engine, programs, on_done=done)
    finally:
        if bar is not None:
            bar.close()


class ToTProgram(Program):
    """One Tree-of-Thought search as a scheduler program (:mod:`treedec.runtime.scheduler`): BFS for a
    :class:`BFSConfig`, DFS for a :class:`DFSConfig`. Its result is the :class:`ToTResult`.
    Checks the task and configuration on construction."""

    def __init__(self, engine: Engine, task: ToTTask, tokenizer: Tokenizer, config: BFSConfig | DFSConfig, *,
                 progress: bool = False, on_level: Callable[[LevelStats], None] | None = None,
                 eos_token_id: int | Sequence[int] | str | None = MODEL_EOS):
        if not isinstance(config, (BFSConfig, DFSConfig)):
            raise TypeError(f"config must be a BFSConfig or a DFSConfig, got {type(config).__name__}")
        check_task(task)
        vocab = engine.model.config.vocab_size
        for name in ("k", "value_samples"):
            if getattr(config, name) > vocab:
                raise ValueError(f"{type(config).__name__}.{name} must be at most the vocabulary size {vocab}, "
                                 f"got {getattr(config, name)}")
        self.eos = frozenset(eos_token_ids(eos_token_id, engine.model))
        self.task, self.tokenizer, self.config = task, tokenizer, config
        self.progress, self.on_level = progress, on_level
        # The root prompt as the scheduler's prompt: searches of one forest read one copy of its common start (the
        # task's few-shot examples), and a prefix cache across requests holds it.
        bos = tokenizer.bos_id
        self.prompt_ids = ([] if bos is None else [bos]) + encode_checked(tokenizer, task.root_prompt(), vocab,
                                                                          f"{type(task).__name__}.root_prompt()")

    def positions(self) -> Positions:
        # The step and value prompts are the task's, made from the thoughts: they are checked as they come.
        task, depth = self.task, self.config.depth
        root = len(self.prompt_ids)
        return Positions(root + depth * task.thought_max_tokens + task.value_max_tokens,
                         f"a {root}-token root prompt + depth {depth} x thought_max_tokens {task.thought_max_tokens} "
                         f"+ value_max_tokens {task.value_max_tokens}")

    def step_pages(self, pool) -> int:
        # A level's thoughts each take a page per step; the evaluations' prompts wait for theirs.
        return self.config.k * getattr(self.config, "n", 1) * self.config.value_samples

    def run(self, ctx: ProgramContext):
        bfs = isinstance(self.config, BFSConfig)
        search = ToTSearch(ctx, self.task, self.tokenizer, self.config, self.progress, "ToT-BFS" if bfs else "ToT-DFS",
                         self.eos)
        result = ToTResult("bfs" if bfs else "dfs")
        t0 = time.perf_counter()
        root = None
        try:
            root = yield from search.start(self.prompt_ids)
            result.prompt_tokens = root.num_tokens
            yield from (self._bfs(search, root, result) if bfs else self._dfs(search, root, result))
        finally:
            search.release(None if root is None else root.node)
        result.wall_s = time.perf_counter() - t0
        return result

    def _bfs(self, search: ToTSearch, root: ToTState, result: ToTResult):
        task, config = self.task, self.config
        rng = np.random.default_rng(config.seed)
        states = [root]
        for depth in range(1, config.depth + 1):
            mark = search.mark()
            candidates = yield from search.expand(states)
            solved = [c for c in candidates if task.is_solved(c.thoughts)]
            kept = _select(candidates, config.n, config.selection, rng)
            keep = {c.node for c in kept}
            search.prune_dead_ends([c.node for c in candidates if c.node not in keep], root.node)
            result.expanded += [s.index for s in states]
            result.levels.append(search.level_stats(mark, depth, len(states), candidates, len(kept)))
            if self.on_level is not None:
                self.on_level(result.levels[-1])
            states = kept
            if solved:
                result.solved = max(solved, key=lambda c: c.value)
                break
        result.best = states

    def _dfs(self, search: ToTSearch, root: ToTState, result: ToTResult):
        task, config, tree = self.task, self.config, search.tree

        def visit(state: ToTState):
            if result.solved is not None or len(result.expanded) >= config.max_expansions:
                return
            depth = len(state.index) + 1
            mark = search.mark()
            candidates = yield from search.expand([state])
            result.expanded.append(state.index)
            ranked = sorted(candidates, key=lambda c: -c.value)   # stable: ties keep the sampling order
            result.solved = next((c for c in ranked if task.is_solved(c.thoughts)), None)
            survivors = [] if result.solved is not None else [c for c in ranked if c.value >= config.threshold]
            search.prune([c.node for c in candidates if all(c.node != s.node for s in survivors)])
            result.levels.append(search.level_stats(mark, depth, 1, candidates, len(survivors)))
            if self.on_level is not None:
                self.on_level(result.levels[-1])
            for c in survivors:
                if depth == config.depth:
                    result.best.append(c)
                else:
                    yield from visit(c)
                search.prune([c.node])   # backtrack
            search.prune(tree.children(state.node))   # the step prompt, if there was one

        yield from visit(root)
        result.best.sort(key=lambda c: -c.value)


# ================================================================ private


def _select(candidates: list[ToTState], n: int, selection: str, rng: np.random.Generator) -> list[ToTState]:
    """The n kept candidates, best value first: the n best, or n drawn without replacement with
    probabilities proportional to their (clipped at 0) values."""
    values = np.array([c.value for c in candidates], dtype=np.float64)
    if len(candidates) <= n or selection == "greedy":
        order = np.argsort(-values, kind="stable")[:n]
    else:
        weights = np.clip(values, 0, None)
        weights += max(weights.sum(), 1.0) * 1e-9   # every candidate can be drawn, zero-valued ones last
        drawn = rng.choice(len(candidates), size=n, replace=False, p=weights / weights.sum())
        order = sorted(drawn.tolist(), key=lambda i: -values[i])
    return [candidates[i] for i in order]
