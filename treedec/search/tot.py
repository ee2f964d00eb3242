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

The task, tokenizer, configurations and results are defined in :mod:`treedec.search.tot_task`
(and import from here too).
"""
from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from treedec.engine import Engine
from treedec.search.controller import choose_token_ids
from treedec.search.request import MODEL_EOS, eos_token_ids
from treedec.search.scheduler import (Program, ProgramContext, Read, SchedulerStats, StepRequest, run_program,
                                      run_programs)
from treedec.transfer import to_device
from treedec.search.tot_task import (SELECTIONS, BFSConfig, ByteTokenizer, DFSConfig, LevelStats, ToTResult, ToTState,
                                     ToTTask, Tokenizer, _SearchConfig, check_task)

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
    """One ToT search per task, all in the engine's forest at once (:mod:`treedec.search.scheduler`):
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
    """One Tree-of-Thought search as a scheduler program (:mod:`treedec.search.scheduler`): BFS for a
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

    def step_pages(self, pool) -> int:
        # A level's thoughts each take a page per step; the evaluations' prompts wait for theirs.
        return self.config.k * getattr(self.config, "n", 1) * self.config.value_samples

    def run(self, ctx: ProgramContext):
        bfs = isinstance(self.config, BFSConfig)
        search = _Search(ctx, self.task, self.tokenizer, self.config, self.progress, "ToT-BFS" if bfs else "ToT-DFS",
                         self.eos)
        result = ToTResult("bfs" if bfs else "dfs")
        t0 = time.perf_counter()
        root = None
        try:
            root = yield from search.start()
            result.prompt_tokens = root.num_tokens
            yield from (self._bfs(search, root, result) if bfs else self._dfs(search, root, result))
        finally:
            search.release(None if root is None else root.node)
        result.wall_s = time.perf_counter() - t0
        return result

    def _bfs(self, search: "_Search", root: ToTState, result: ToTResult):
        task, config = self.task, self.config
        rng = np.random.default_rng(config.seed)
        states = [root]
        for depth in range(1, config.depth + 1):
            mark = search.mark()
            candidates = yield from search.expand(states)
            solved = [c for c in candidates if task.is_solved(c.thoughts)]
            kept = _select(candidates, config.n, config.selection, rng)
            keep = {c.node for c in kept}
            for c in candidates:
                if c.node not in keep:
                    search.prune_dead_end(c.node, root.node)
            result.expanded += [s.index for s in states]
            result.levels.append(search.level_stats(mark, depth, len(states), candidates, len(kept)))
            if self.on_level is not None:
                self.on_level(result.levels[-1])
            states = kept
            if solved:
                result.solved = max(solved, key=lambda c: c.value)
                break
        result.best = states

    def _dfs(self, search: "_Search", root: ToTState, result: ToTResult):
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
            for c in candidates:
                if all(c.node != s.node for s in survivors):
                    search.prune(c.node)
            result.levels.append(search.level_stats(mark, depth, 1, candidates, len(survivors)))
            if self.on_level is not None:
                self.on_level(result.levels[-1])
            for c in survivors:
                if depth == config.depth:
                    result.best.append(c)
                else:
                    yield from visit(c)
                search.prune(c.node)   # backtrack
            for child in tree.children(state.node):   # the step prompt, if there was one
                search.prune(child)

        yield from visit(root)
        result.best.sort(key=lambda c: -c.value)


# ================================================================ private


@dataclass
class _Stream:
    """One generated sequence: a thought, or one output of an evaluation."""

    parent: int
    tokens: list[int]
    node: int | None = None   # its node, once a token of it is in the tree
    done: bool = False


class _Search:
    """The engine-side machinery both searches share: prefill, expansion, pruning, counters."""

    def __init__(self, ctx: ProgramContext, task: ToTTask, tokenizer: Tokenizer, config: _SearchConfig,
                 progress: bool, label: str, eos: frozenset[int]):
        engine = ctx.engine
        self.ctx, self.eos = ctx, eos
        self.engine, self.tree, self.pool = engine, engine.tree, engine.pool
        self.task, self.tokenizer, self.config = task, tokenizer, config
        self.generator = torch.Generator(device=engine.device).manual_seed(config.seed)
        self.logits: dict[int, torch.Tensor] = {}   # node -> [vocab] next-token logits at its last token
        self.counts: Counter = Counter()
        self.pages_peak = 0
        self.progress, self.label, self.bar = progress, label, None

    # ---------------------------------------------------------------- search steps

    def start(self):
        """Prefill the task's prompt; returns the search's root state (a generator: ``yield from``)."""
        bos = getattr(self.tokenizer, "bos_id", None)
        ids = ([] if bos is None else [bos]) + self._encode(self.task.root_prompt(), "root_prompt()")
        node, out = yield from self.ctx.prompt(ids)
        self.logits[node] = out.logits[0]
        self._note_pages()
        if self.progress:
            from tqdm import tqdm
            self.bar = tqdm(desc=self.label, unit="step")
        return ToTState((), (), None, len(ids), node)

    def expand(self, states: list[ToTState]):
        """The k evaluated thoughts of every state in ``states``, state by state (a generator)."""
        task, config = self.task, self.config
        prompts = [(s.node, self._encode(text, "step_prompt()")) for s in states
                   if (text := task.step_prompt(s.thoughts))]
        heads = {s.node: s.node for s in states}
        for (state_node, _), node in zip(prompts, (yield from self._append_prompts(prompts))):
            heads[state_node] = node
        streams = yield from self._generate([(heads[s.node], config.k) for s in states], task.thought_max_tokens,
                                            task.thought_stop, config.temperature, append_last=True)
        for node in heads.values():
            if node not in (s.node for s in states):
                self.logits.pop(node, None)
        self.counts["thought_tokens"] += sum(len(s.tokens) for s in streams)
        candidates = [ToTState(state.index + (i,), state.thoughts + (self._text(s.tokens, task.thought_stop),),
                               None, len(s.tokens), s.node)
                      for j, state in enumerate(states)
                      for i, s in enumerate(streams[j * config.k:(j + 1) * config.k])]
        yield from self._evaluate(candidates)
        return candidates

    def prune(self, node: int) -> None:
        self.tree.prune(node)
        self.logits = {n: v for n, v in self.logits.items() if n in self.tree}

    def prune_dead_end(self, node: int, root: int) -> None:
        """Prune ``node``, then each ancestor below ``root`` left without children."""
        parent = self.tree.parent(node)
        self.tree.prune(node)
        while parent != root and parent in self.tree and not self.tree.children(parent):
            node, parent = parent, self.tree.parent(parent)
            self.tree.prune(node)
        self.logits = {n: v for n, v in self.logits.items() if n in self.tree}

    def release(self, root: int | None) -> None:
        """Free the search's pages."""
        if self.bar is not None:
            self.bar.close()
        self.ctx.free(root)
        self.logits.clear()

    # ---------------------------------------------------------------- stats

    def mark(self) -> tuple[float, Counter]:
        self.pages_peak = self._pages_in_use()
        return time.perf_counter(), Counter(self.counts)

    def level_stats(self, mark: tuple[float, Counter], depth: int, states: int, candidates: list[ToTState],
                    kept: int) -> LevelStats:
        wall = time.perf_counter() - mark[0]
        d = Counter(self.counts)
        d.subtract(mark[1])
        generated = d["thought_tokens"] + d["value_tokens"]
        stats = LevelStats(depth=depth, states=states, thoughts=len(candidates), kept=kept,
                           thought_tokens=d["thought_tokens"], value_tokens=d["value_tokens"],
                           prompt_tokens=d["prompt_tokens"], steps=d["steps"], queries=d["queries"], wall_s=wall,
                           tokens_per_s=generated / wall if wall > 0 else 0.0, pages_peak=self.pages_peak,
                           pages_after=self._pages_in_use(), best_value=max(c.value for c in candidates))
        if self.bar is not None:
            self.bar.set_postfix(depth=depth, tok_s=f"{stats.tokens_per_s:.0f}", pages=stats.pages_after)
        return stats

    # ---------------------------------------------------------------- engine work

    def _evaluate(self, candidates: list[ToTState]):
        """Set every candidate's value; compute their last tokens; leave no evaluation node behind
        (a generator)."""
        task = self.task
        prompts = []
        for c in candidates:
            text = task.value_prompt(c.thoughts)
            if text is not None and not text:
                raise ValueError(f"{type(task).__name__}.value_prompt returned '' for {c.thoughts!r}; return None "
                                 f"to value a state without the model")
            prompts.append(None if text is None else self._encode(text, "value_prompt()"))
        pending = set(self.engine.pending_nodes().tolist())
        evals = yield from self._append_prompts([(c.node, ids) for c, ids in zip(candidates, prompts)
                                                 if ids is not None],
                                                also=[c.node for c in candidates if c.node in pending])
        streams = yield from self._generate([(e, self.config.value_samples) for e in evals], task.value_max_tokens,
                                            task.value_stop, self.config.value_temperature, append_last=False)
        self.counts["value_tokens"] += sum(len(s.tokens) for s in streams)
        outputs: dict[int, list[str]] = {e: [] for e in evals}
        for s in streams:
            outputs[s.parent].append(self._text(s.tokens, task.value_stop))
        evaluated = iter(evals)
        for c, ids in zip(candidates, prompts):
            value = task.parse_value(c.thoughts, [] if ids is None else outputs[next(evaluated)])
            if not isinstance(value, (int, float, np.number)) or not math.isfinite(value):
                raise ValueError(f"{type(task).__name__}.parse_value must return a finite number, got {value!r}")
            c.value = float(value)
        for e in evals:
            self.prune(e)

    def _append_prompts(self, prompts: list[tuple[int, list[int]]], also: Sequence[int] = ()):
        """Add each ``(parent, ids)`` as a new child of ``parent`` and compute them; returns the new nodes.

        Their last tokens' logits (and those of the nodes in ``also``, which must have
        pending tokens) go to ``self.logits``. Prompts run together, in steps of at most
        ``engine.prefill_chunk`` tokens (a longer prompt alone in its step). A generator.
        """
        yield from self.ctx.reserve(sum(self.pool.pages_for(len(ids)) for _, ids in prompts))
        groups, size = [[]], 0
        for item in prompts:
            if groups[-1] and size + len(item[1]) > self.engine.prefill_chunk:
                groups.append([])
                size = 0
            groups[-1].append(item)
            size += len(item[1])
        nodes, extra = [], list(also)
        for group in groups:
            new = [self.tree.branch(parent, [ids])[0] for parent, ids in group]
            self.counts["prompt_tokens"] += sum(len(ids) for _, ids in group)
            if new or extra:
                self._note_pages()
                want = new + extra
                self.logits.update(zip(want, (yield from self._step(want))))
            nodes += new
            extra = []
        return nodes

    def _generate(self, heads: list[tuple[int, int]], max_tokens: int, stops: tuple[str, ...], temperature: float,
                  append_last: bool):
        """Branch each ``(parent, count)`` into ``count`` sequences with distinct first tokens, then
        decode all of them together until each has a stop string, an EOS id or ``max_tokens`` tokens.

        ``append_last``: a finished sequence's last token still goes into the tree (thoughts:
        their evaluation and children read it; it is computed by the next step, whose
        caller gets its logits in ``self.logits`` if this call does not). Else it is only
        recorded (evaluation outputs: nothing reads past them). Returns the streams in
        head order (a generator).
        """
        if not heads:
            return []
        firsts = yield Read(torch.cat([choose_token_ids(self.logits[parent], count, temperature, self.generator)
                                       for parent, count in heads]))   # one wait for every head's tokens
        parents = [parent for parent, count in heads for _ in range(count)]
        streams = [_Stream(parent, [tok]) for parent, tok in zip(parents, firsts)]
        fresh = streams
        while fresh:
            for s in fresh:
                s.done = len(s.tokens) >= max_tokens or s.tokens[-1] in self.eos or self._stopped(s.tokens, stops)
            placed = [s for s in fresh if append_last or not s.done]
            active = [s for s in fresh if not s.done]
            if not active:
                yield from self._place(placed)
                break
            yield from self._place(placed)
            out = yield from self._step([s.node for s in placed])
            row = {id(s): i for i, s in enumerate(placed)}
            for s in placed:
                if s.done:
                    self.logits[s.node] = out[row[id(s)]]
            picks = out if len(active) == len(placed) else out[to_device([row[id(s)] for s in active], out.device)]
            for s, tok in zip(active, (yield Read(_next_tokens(picks, temperature, self.generator)))):
                s.tokens.append(tok)
            fresh = active
        return streams

    def _place(self, streams: list[_Stream]):
        """Put each stream's newest token into the tree: a new child of its parent, or appended to its
        node (a generator: it waits for the pages)."""
        new = [s for s in streams if s.node is None]
        old = [s for s in streams if s.node is not None]
        yield from self.ctx.reserve(len(new) * self.pool.pages_for(1)
                                    + sum(self.tree.pages_to_extend(s.node, 1) for s in old))
        if old:
            self.tree.extend_many({s.node: s.tokens[-1:] for s in old})
        by_parent: dict[int, list[_Stream]] = {}
        for s in new:
            by_parent.setdefault(s.parent, []).append(s)
        for parent, group in by_parent.items():
            for s, node in zip(group, self.tree.branch(parent, [s.tokens[-1:] for s in group])):
                s.node = node
        self._note_pages()

    def _step(self, nodes: list[int]):
        """One step (a generator); returns ``[len(nodes), vocab]`` logits at each node's last pending token."""
        out = yield StepRequest(nodes)
        self.counts["steps"] += 1
        self.counts["queries"] += self.ctx.step_queries
        if self.bar is not None:
            self.bar.update(1)
        return out.logits

    # ---------------------------------------------------------------- helpers

    def _encode(self, text: str, what: str) -> list[int]:
        ids = [int(i) for i in self.tokenizer.encode(text)]
        vocab = self.engine.model.config.vocab_size
        if not ids:
            raise ValueError(f"{type(self.task).__name__}.{what} encodes to no tokens: {text!r:.80}")
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise ValueError(f"{type(self.task).__name__}.{what} encodes to ids outside the model's vocabulary "
                             f"[0, {vocab}): {bad[:5]}")
        return ids

    def _text(self, tokens: list[int], stops: tuple[str, ...]) -> str:
        """The decoded tokens, cut after the first stop string."""
        text = self.tokenizer.decode(tokens)
        ends = [text.find(s) + len(s) for s in stops if s in text]
        return text[:min(ends)] if ends else text

    def _stopped(self, tokens: list[int], stops: tuple[str, ...]) -> bool:
        if not stops:
            return False
        text = self.tokenizer.decode(tokens)
        return any(s in text for s in stops)

    def _pages_in_use(self) -> int:
        return self.pool.num_pages - self.pool.num_free_pages

    def _note_pages(self) -> None:
        self.pages_peak = max(self.pages_peak, self._pages_in_use())



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


def _next_tokens(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> torch.Tensor:
    """One next token per row of ``logits`` [r, vocab], on the device: argmax, or sampled from
    softmax(logits / T)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).view(-1)
