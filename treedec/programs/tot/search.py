"""The engine-side work of a Tree-of-Thought search (:mod:`treedec.programs.tot.program`): the prompt's prefill,
thoughts generated together one token per engine step, their evaluations under their own nodes, pruning and
counters."""
from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from treedec.runtime.decode import Decode
from treedec.runtime.program import ProgramContext, StepRequest
from treedec.runtime.request import Positions, check_positions, position_limit
from treedec.sampling.params import SEED_MAX, SamplingParams, sample_tokens
from treedec.sampling.stops import StopRule
from treedec.programs.tot.task import BFSConfig, DFSConfig, LevelStats, ToTState, ToTTask, Tokenizer

__all__ = ["ToTSearch", "encode_checked"]


@dataclass
class _Stream:
    """One generated sequence: a thought, or one output of an evaluation."""

    parent: int
    tokens: list[int]
    node: int | None = None   # its node, when kept (a thought)


class ToTSearch:
    """The engine-side machinery both searches of :mod:`treedec.programs.tot.program` share: prefill, expansion,
    evaluation, pruning, counters."""

    def __init__(self, ctx: ProgramContext, task: ToTTask, tokenizer: Tokenizer, config: BFSConfig | DFSConfig,
                 progress: bool, label: str, eos: frozenset[int]):
        engine = ctx.engine
        self.ctx, self.eos = ctx, eos
        self.engine, self.tree, self.pool = engine, engine.tree, engine.pool
        self.task, self.tokenizer, self.config = task, tokenizer, config
        self.generator = torch.Generator(device=engine.device).manual_seed(config.seed)
        # a thought's and an evaluation output's stop rules (the same for every expansion)
        eos = tuple(eos)
        self.thought_rule = StopRule(task.thought_max_tokens, eos, task.thought_stop, include_stop_str=True)
        self.value_rule = StopRule(task.value_max_tokens, eos, task.value_stop, include_stop_str=True)
        self.logits: dict[int, torch.Tensor] = {}   # node -> [vocab] next-token logits at its last token
        self.counts: Counter = Counter()
        self.pages_peak = 0
        self.progress, self.label, self.bar = progress, label, None

    # ---------------------------------------------------------------- search steps

    def start(self, ids: list[int]):
        """Prefill the search's prompt ``ids`` (its task's root prompt, :attr:`ToTProgram.prompt_ids`); returns the
        search's root state (a generator: ``yield from``)."""
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
        streams = yield from self._generate([(heads[s.node], config.k) for s in states], self.thought_rule,
                                            config.sampling, append_last=True)
        for state_node, node in heads.items():
            if node != state_node:   # (a step prompt's logits: read once)
                self.logits.pop(node, None)
        self.counts["thought_tokens"] += sum(len(s.tokens) for s in streams)
        candidates = [ToTState(state.index + (i,), state.thoughts + (self._text(s.tokens, task.thought_stop),),
                               None, len(s.tokens), s.node)
                      for j, state in enumerate(states)
                      for i, s in enumerate(streams[j * config.k:(j + 1) * config.k])]
        yield from self._evaluate(candidates)
        return candidates

    def prune(self, nodes: list[int]) -> None:
        """Prune the subtrees of ``nodes`` (one edit: :meth:`~treedec.tree.SequenceTree.prune_many`) and forget
        their logits."""
        if nodes:
            self.tree.prune_many(nodes)
            self._forget_pruned()

    def prune_dead_ends(self, nodes: list[int], root: int) -> None:
        """Prune each of ``nodes`` with each ancestor below ``root`` that leads only to it, in order (a state whose
        thoughts all go goes with the last; :meth:`~treedec.tree.SequenceTree.prune_dead_ends`: one edit), and
        forget their logits."""
        if nodes:
            self.tree.prune_dead_ends(nodes, root)
            self._forget_pruned()

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
        # (a thought's last token that no step computed yet is pending, and its logits unknown: Decode.last_pending)
        evals = yield from self._append_prompts([(c.node, ids) for c, ids in zip(candidates, prompts)
                                                 if ids is not None],
                                                also=[c.node for c in candidates if c.node not in self.logits])
        streams = yield from self._generate([(e, self.config.value_samples) for e in evals], self.value_rule,
                                            self.config.value_sampling, append_last=False)
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
        self.prune(evals)

    def _append_prompts(self, prompts: list[tuple[int, list[int]]], also: Sequence[int] = ()):
        """Add each ``(parent, ids)`` as a new child of ``parent`` and compute them; returns the new nodes.

        Their last tokens' logits (and those of the nodes in ``also``, which must have
        pending tokens) go to ``self.logits``. Prompts run together, in steps of at most
        ``engine.prefill_chunk`` tokens (a longer prompt alone in its step). A generator.
        """
        lengths = [self.tree.sequence_length(parent) for parent, _ in prompts]
        if prompts and max([length + len(ids) for length, (_, ids) in zip(lengths, prompts)]) > position_limit(
                self.engine.model):   # (the first that passes the limit is named)
            for length, (_, ids) in zip(lengths, prompts):
                check_positions(self.engine.model, Positions(length + len(ids), f"{length} tokens + a {len(ids)}-token "
                                                             f"prompt of {type(self.task).__name__}"), self.ctx.name)
        groups, size = [[]], 0
        for item in prompts:
            if groups[-1] and size + len(item[1]) > self.engine.prefill_chunk:
                groups.append([])
                size = 0
            groups[-1].append(item)
            size += len(item[1])
        nodes, extra = [], list(also)
        for group in groups:
            need = sum([-(-len(ids) // self.pool.page_size) for _, ids in group])
            if extra and need > self.pool.num_free_pages:   # a program that waits has no pending tokens
                self.logits.update(zip(extra, (yield from self._step(extra))))
                extra = []
            # Each group's pages just before it takes them: others may take free pages while it steps.
            yield from self.ctx.reserve(need)
            new = [] if not group else self.tree.branch_many(
                [parent for parent, _ in group], [t for _, ids in group for t in ids], [len(ids) for _, ids in group]
            ).tolist()
            self.counts["prompt_tokens"] += sum(len(ids) for _, ids in group)
            if new or extra:
                self._note_pages()
                want = new + extra
                self.logits.update(zip(want, (yield from self._step(want))))
            nodes += new
            extra = []
        return nodes

    def _generate(self, heads: list[tuple[int, int]], rule: StopRule, params: SamplingParams, append_last: bool):
        """Branch each ``(parent, count)`` into ``count`` sequences with distinct first tokens, then
        decode all of them together until ``rule`` ends each (a stop string, an EOS id, its token budget): one
        :class:`~treedec.runtime.lanes.Decode` (its outputs are lanes of the scheduler's batch, every search's).

        ``append_last``: a finished sequence's last token still goes into the tree (thoughts:
        their evaluation and children read it) and its next-token logits go to ``self.logits``. Else it is only
        recorded (evaluation outputs: nothing reads past them). Returns the streams in head order (a generator).
        """
        if not heads:
            return []
        length, max_tokens = max([self.tree.sequence_length(parent) for parent, _ in heads]), rule.max_new_tokens
        check_positions(self.engine.model, Positions(length + max_tokens, f"{length} tokens + {max_tokens} generated"),
                        self.ctx.name)
        parents = [parent for parent, count in heads for _ in range(count)]
        # distinct first tokens per head; then every sequence's draws from the search's seed
        firsts = torch.cat([sample_tokens(self.logits[parent], params, self.generator, k=count).reshape(-1)
                            for parent, count in heads])
        seed = int(torch.randint(0, SEED_MAX, (1,), generator=self.generator, device=self.generator.device))
        decoded = yield Decode(parents, params, rule, first=firsts, count=len(parents), keep=append_last,
                               last_pending=append_last, tokenizer=self.tokenizer if rule.stop_strings else None,
                               seed=seed)
        streams = [_Stream(parent, o.token_ids, o.node) for parent, o in zip(parents, decoded.outputs)]
        computed = [len(o.token_ids) - (0 if append_last and o.logits is not None else 1) for o in decoded.outputs]
        self.counts["steps"] += max(computed)
        self.counts["queries"] += sum(computed)
        if self.bar is not None:
            self.bar.update(max(computed))
        if append_last:   # (a last token left pending: the next step's caller reads its logits)
            self.logits.update((o.node, o.logits) for o in decoded.outputs if o.logits is not None)
        self._note_pages()
        return streams

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
        return encode_checked(self.tokenizer, text, self.engine.model.config.vocab_size,
                              f"{type(self.task).__name__}.{what}")

    def _text(self, tokens: list[int], stops: tuple[str, ...]) -> str:
        """The decoded tokens, cut after the first stop string."""
        text = self.tokenizer.decode(tokens)
        ends = [text.find(s) + len(s) for s in stops if s in text]
        return text[:min(ends)] if ends else text

    def _forget_pruned(self) -> None:
        self.logits = {n: v for n, v in self.logits.items() if n in self.tree}

    def _pages_in_use(self) -> int:
        return self.pool.num_pages - self.pool.num_free_pages

    def _note_pages(self) -> None:
        self.pages_peak = max(self.pages_peak, self._pages_in_use())


def encode_checked(tokenizer: Tokenizer, text: str, vocab: int, what: str) -> list[int]:
    """``tokenizer.encode(text)`` as ints, checked: not empty, every id in the model's vocabulary ``[0, vocab)``
    (a ValueError naming ``what``, e.g. ``"Game24Task.root_prompt()"``, otherwise)."""
    ids = [int(i) for i in tokenizer.encode(text)]
    if not ids:
        raise ValueError(f"{what} encodes to no tokens: {text!r:.80}")
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise ValueError(f"{what} encodes to ids outside the model's vocabulary [0, {vocab}): {bad[:5]}")
    return ids
