"""Speculative decoding by token-tree verification: draft sources, verification, the loop.

Each step a :class:`DraftSource` proposes a :class:`~treedec.tree.token_tree.TokenTree`
whose root is the sequence's last token; one engine step computes the root and every
draft token at once (tree attention: each token attends to its own path only). An
:class:`~treedec.programs.speculative.acceptance.AcceptanceRule` picks the accepted path (greedy: the
longest path whose tokens equal the model's greedy choice at their parent); its K/V move
onto the sequence node (no recompute), the rest of the tree is pruned, and the token the
rule draws after the last accepted token (the *bonus* token) is the root of the next
step's tree. So every step emits ``accepted + 1`` tokens, and greedy speculative decoding
emits exactly the tokens of plain greedy decoding, whatever the draft. An EOS id on the
accepted path ends it there, as the bonus token: generation stops on it, and no K/V past
it is kept; a stop string or ``max_new_tokens`` inside the path cuts it there too.

:class:`SpeculativeProgram` is one request's loop as a program of the scheduler
(:mod:`treedec.runtime.scheduler`): batched, every live request's tree is verified in the same
engine step. :func:`speculative_generate` runs one request.

Draft sources are in :mod:`treedec.programs.speculative.drafts`, :mod:`treedec.programs.speculative.medusa` and
:mod:`treedec.programs.speculative.draft_model`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Collection, Sequence

import numpy as np
import torch

from treedec.checks import is_int, positive_int
from treedec.engine import Engine
from treedec.programs.speculative.acceptance import AcceptanceRule, GreedyAcceptance, RejectionSampling, greedy_path
from treedec.programs.speculative.device_acceptance import decode_outcome
from treedec.models.text import IncrementalDetokenizer
from treedec.programs.speculative.draft_budget import DraftBudget, cut_tree
from treedec.programs.speculative.drafts import (DraftSource, TargetOutput, check_draft_source, check_draft_tree,
                                                 target_states_at)
from treedec.programs.speculative.grammar_filter import DraftFilter
from treedec.runtime.request import MODEL_EOS, Positions, check_positions, eos_token_ids
from treedec.runtime.program import Program, ProgramContext, Read, StepRequest, kept_length
from treedec.runtime.scheduler import run_program
from treedec.programs.speculative.step_tokens import StepTokens, TokenHandOff
from treedec.programs.speculative.target_processing import TargetProcessing, penalizes
from treedec.programs.speculative.verify_table import Verify, pipeline_refusal
from treedec.sampling.params import GREEDY, SamplingParams, sample_tokens
from treedec.sampling.stops import StopChecker, StopRule
from treedec.transfer import HostCopy, to_device
from treedec.tree.token_tree import TokenTree


# ================================================================ verification


@dataclass
class SpeculativeStats:
    """Per-run counters of :func:`speculative_generate`.

    Attributes
    ----------
    steps : verification steps (engine steps after the prefill).
    accepted : draft tokens accepted at each step.
    draft_sizes : draft tokens verified at each step (the tree size less the root).
    draft_seconds, verify_seconds : wall time of each step's proposal and verification.
    prefill_seconds : wall time of the prefill and the first token.
    node : the request's sequence node (its tokens: prompt + every accepted token);
        prune it to free the request's pages.
    stop_reason : why generation stopped: "eos" (the last returned token is an EOS id)
        or "length" (``max_new_tokens`` reached), as :class:`~treedec.programs.parallel_sampling.Sample`'s.
    pipelined : whether the steps ran pipelined (:mod:`treedec.programs.speculative.verify_table`; then the draft
        is made inside the step, ``draft_seconds`` are 0 and ``verify_seconds`` is each step's wall time).
    pipeline_note : why they did not, when ``pipeline`` was left to choose.
    cached_tokens : prompt tokens read from the prefix cache across requests (none computed).
    logprobs : with the request's ``params.logprobs``, each new token's ``{token_id: Logprob}`` (the raw target's,
        :mod:`treedec.programs.speculative.target_processing`), else None.
    """

    steps: int = 0
    accepted: list[int] = field(default_factory=list)
    draft_sizes: list[int] = field(default_factory=list)
    draft_seconds: list[float] = field(default_factory=list)
    verify_seconds: list[float] = field(default_factory=list)
    prefill_seconds: float = 0.0
    node: int | None = None
    stop_reason: str = ""
    pipelined: bool = False
    pipeline_note: str = ""
    cached_tokens: int = 0
    logprobs: list[dict] | None = None

    @property
    def tokens_per_step(self) -> float:
        """Tokens emitted per verification step: mean accepted length + 1 (the bonus token)."""
        return (sum(self.accepted) + self.steps) / self.steps if self.steps else 0.0


@dataclass(frozen=True)
class VerifyResult:
    """The outcome of one verification step of :class:`SpeculativeProgram` (the accepted path settled).

    Attributes
    ----------
    accepted : the accepted draft tokens (now on the sequence node, K/V included).
    bonus : the token drawn after the last accepted one: the next root (not yet computed).
    hidden : [hidden_size] the target's final-norm hidden state at the last accepted token
        (the root when none was accepted); None unless asked for.
    head : the engine's row head ``head_name``'s output at that token, on the host; None
        unless asked for.
    path : the accepted tokens' indices in the token tree (each the child of the one before).
    """

    accepted: list[int]
    bonus: int
    hidden: torch.Tensor | None = None
    head: torch.Tensor | None = None
    path: list[int] = field(default_factory=list)


class SpeculativeProgram(Program):
    """One request's speculative decoding as a scheduler program (see the module docstring).

    Its result is ``(checker, stats)``: the :class:`~treedec.sampling.stops.StopChecker` that took the
    new tokens under ``rule`` (EOS ids, stop strings, ``max_new_tokens``: its ``token_ids``,
    ``text``, ``stop_reason``) and :class:`SpeculativeStats`.

    Parameters
    ----------
    prompt_ids : the prompt.
    draft : the request's draft source, a :class:`~treedec.programs.speculative.drafts.DraftSource` (else TypeError).
    rule : the request's :class:`~treedec.sampling.stops.StopRule`.
    tokenizer : detokenizes the output (stop strings need it).
    acceptance : default :class:`GreedyAcceptance`.
    keep_node : leave the request's node in the tree at the end (``stats.node``), and the draft's state (its
        drafter's pages); else prune it and ``reset`` the draft.
    on_step : called as ``on_step(stats, emitted)`` after every verification step.
    max_draft_tokens : the largest tree (root included) the draft may propose; its pages are the
        headroom the scheduler keeps for the request's steps.
    budget : the batch's :class:`~treedec.programs.speculative.draft_budget.DraftBudget` (shared by its programs): each
        proposal is cut to this request's share of the step's draft tokens.
    pipeline : run its steps pipelined (:mod:`treedec.programs.speculative.verify_table`); None: when the draft, the
        rule and the engine allow it on a GPU (``stats.pipelined``, ``stats.pipeline_note`` say what was
        chosen); True: ValueError, before anything runs, when they do not.
    pipeline_note : with ``pipeline=False``, why (``stats.pipeline_note``; default "pipeline=False"), e.g. the
        choice of :func:`~treedec.programs.speculative.batch.speculative_batch` for a large batch.
    on_text : streaming: called as ``on_text(delta, checker)`` with the output's new text after each verification step
        (``checker``: its :class:`~treedec.sampling.stops.StopChecker`, e.g. its ``num_tokens`` so far)
        (needs ``tokenizer``; a tail that may start a stop string is held back until it does not, as
        :attr:`~treedec.sampling.stops.StopChecker.streamable_text`). The deltas of one run join to a prefix of the
        final text (a run ended before its first verification step streams nothing); a run again from its
        start (a preemption) streams again from the start.
    on_tokens : streaming token ids instead (not with ``on_text``; no tokenizer, no stop strings: no text made):
        ``on_tokens(news)``, a :class:`~treedec.programs.speculative.step_tokens.StepTokens` after each verification
        step that emitted tokens and when the run ends (its last tokens, its end).
    grammar : structured outputs (greedy acceptance only): each proposal filtered by the grammar before it is
        submitted and the target's rows masked (:mod:`~treedec.programs.speculative.grammar_filter`); not pipelined.
    params : the request's :class:`~treedec.sampling.params.SamplingParams`, for its penalties (applied to the
        target's logits at every tree token, by its path: :mod:`treedec.programs.speculative.target_processing`)
        and ``logprobs`` (``stats.logprobs``); its other fields are the rule's and the stop rule's. Logprobs run
        the steps unpipelined (``stats.pipeline_note`` says so); penalties run either way (pipelined, the verify
        group keeps its rows' counts on the device).
    """

    def __init__(self, prompt_ids: Sequence[int], draft: DraftSource, rule: StopRule, tokenizer=None,
                 acceptance: AcceptanceRule | None = None, keep_node: bool = False,
                 on_step: Callable[[SpeculativeStats, int], None] | None = None, max_draft_tokens: int = 64,
                 budget: DraftBudget | None = None, pipeline: bool | None = None, pipeline_note: str | None = None,
                 on_text: Callable[[str, StopChecker], None] | None = None, grammar=None,
                 params: SamplingParams | None = None, on_tokens: Callable[[StepTokens], None] | None = None):
        check_draft_source(draft, "draft")
        if params is not None and not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams or None, got {type(params).__name__}")
        self.params = params
        self.penalized = params is not None and penalizes(params)   # (a verify group's key: its rows' counts)
        if on_text is not None and (tokenizer is None or not callable(on_text)):
            raise ValueError("on_text streams detokenized text: it must be callable and needs the tokenizer")
        if on_text is not None and on_tokens is not None:
            raise ValueError("a SpeculativeProgram streams text (on_text) or token ids (on_tokens), not both")
        self.on_tokens = None if on_tokens is None else TokenHandOff(on_tokens)
        if pipeline is not None and not isinstance(pipeline, bool):
            raise ValueError(f"pipeline must be None, True or False, got {pipeline!r}")
        if pipeline_note is not None and pipeline is not False:
            raise ValueError(f"pipeline_note says why pipeline is False; got it with pipeline={pipeline!r}")
        self.pipeline, self.pipeline_note = pipeline, pipeline_note or "pipeline=False"
        acceptance = GreedyAcceptance() if acceptance is None else acceptance
        if not isinstance(acceptance, AcceptanceRule):
            raise TypeError(f"acceptance must be an AcceptanceRule (first_token and accept methods), "
                            f"got {type(acceptance).__name__}")
        positive_int("max_draft_tokens", max_draft_tokens)
        self.prompt_ids = [int(x) for x in prompt_ids]
        self.draft, self.rule, self.tokenizer, self.acceptance = draft, rule, tokenizer, acceptance
        self.keep_node, self.on_step, self.max_draft_tokens = keep_node, on_step, max_draft_tokens
        self.on_text, self._shown = on_text, 0   # (characters streamed by this run)
        if budget is not None and not isinstance(budget, DraftBudget):
            raise TypeError(f"budget must be a DraftBudget or None, got {type(budget).__name__}")
        self.budget = budget
        if grammar is not None and type(acceptance) is not GreedyAcceptance:
            raise ValueError("structured outputs with speculative decoding take greedy acceptance (temperature 0)")
        self.grammar = grammar
        self.target_states = _target_states(draft)
        # A draft that reads the target's states at every token needs them for the whole prompt.
        self.shares_prompt = self.target_states is None

    def step_pages(self, pool) -> int:
        tree = self.draft.fixed_tree   # pipelined, a step also reserves the previous step's root and path
        return 1 + pool.pages_for(self.max_draft_tokens - 1) + (0 if tree is None else 1 + pool.pages_for(tree.size))

    def positions(self) -> Positions:
        # While it runs, the sequence (bonus root included) has at most prompt + max_new_tokens - 1 tokens,
        # and a tree hangs its deepest token max_depth positions past the root.
        p, m = len(self.prompt_ids), self.rule.max_new_tokens
        depth = self.draft.max_depth
        if not depth:
            return Positions(p + m, f"a {p}-token prompt + max_new_tokens {m}")
        return Positions(p + m + depth - 1, f"a {p}-token prompt + max_new_tokens {m} + the draft's max_depth "
                                            f"{depth} - 1")

    def pipeline_refusal(self, engine: Engine) -> str | None:
        """Why its steps cannot run pipelined on ``engine`` (:func:`~treedec.programs.speculative.verify_table.
        pipeline_refusal` of its draft and rule, its structured outputs, penalties and logprobs); None when they can."""
        if self.grammar is not None:
            return "structured outputs (the grammar's masks are host work between steps)"
        if self.params is not None and self.params.logprobs is not None:
            return "logprobs are recorded on the unpipelined path (the verify table does not keep their entries)"
        return pipeline_refusal(engine, self.draft, self.acceptance)

    def run(self, ctx: ProgramContext):
        engine, draft = ctx.engine, self.draft
        checker = StopChecker(self.rule, None if self.tokenizer is None
                              else IncrementalDetokenizer(self.tokenizer, self.prompt_ids))
        refusal = self.pipeline_refusal(engine)
        if self.pipeline and refusal is not None:
            raise ValueError(f"pipeline=True, but this speculative loop cannot run pipelined: {refusal}")
        note = self.pipeline_note if self.pipeline is False else (
            refusal or ("" if engine.device.type == "cuda" else "the engine is on the CPU (nothing to overlap)"))
        pipelined = bool(self.pipeline) or not note
        draft.start(engine)
        if isinstance(self.target_states, tuple):
            engine.capture_hidden_layers(self.target_states)
        head_name = _add_draft_head(engine, draft.row_head)
        stats = SpeculativeStats(pipelined=pipelined, pipeline_note="" if pipelined else note,
                                 cached_tokens=ctx.cached_tokens)
        self._shown = 0
        if self.on_tokens is not None:
            self.on_tokens.restart()
        done = False
        if self.budget is not None:
            self.budget.join(self)
        try:
            if pipelined:   # (treedec.programs.speculative.verify_table)
                yield from self._pipelined(ctx, checker, head_name, stats)
            else:
                yield from self._steps(ctx, checker, head_name, stats)
            stats.stop_reason = checker.stop_reason
            if self.on_tokens is not None:   # (the first token alone, or a pipelined row's tokens read at its end)
                self.on_tokens.hand_off(checker, stats)
            done = True
            return checker, stats
        finally:   # the conversation offered to its last token, or to the tokens an abort kept (ProgramContext.kept)
            kept = checker.num_tokens if done else (ctx.kept or {}).get(0, 0)
            length = 0 if ctx.cache is None or stats.node is None or not kept else \
                kept_length(engine.tree, stats.node, len(self.prompt_ids), checker.token_ids, kept)
            if length:
                ctx.offer(stats.node, length)
            if self.budget is not None:
                self.budget.leave(self)
            if not (done and self.keep_node):
                ctx.free(stats.node)
                draft.reset()   # a drafter's own pages (its engine may serve other requests)

    def _steps(self, ctx: ProgramContext, checker: StopChecker, head_name: str | None, stats: SpeculativeStats):
        """The unpipelined loop: the prompt, then draft, verify and accept until ``checker`` stops."""
        engine, draft, acceptance = ctx.engine, self.draft, self.acceptance
        needs_hidden = bool(draft.needs_hidden)
        states = self.target_states
        stop_ids = checker.rule.eos_token_ids
        max_depth = draft.max_depth
        want = {"hidden": needs_hidden or states == "hidden", "aux": isinstance(states, tuple),
                "heads": head_name is not None}
        greedy = type(acceptance) is GreedyAcceptance
        grammar = None if self.grammar is None else DraftFilter(self.grammar, engine.device, stop_ids)
        start = time.perf_counter()
        node, out = yield from ctx.prompt(self.prompt_ids, all_rows=states is not None, **want)
        stats.node = node
        p = self.params
        proc = None if p is None or not (penalizes(p) or p.logprobs is not None) else \
            TargetProcessing(p, self.prompt_ids, out.logits.shape[-1], out.logits.device)
        first = out.logits[0] if proc is None else proc.first(out.logits[:1])[0]
        checker.accept(acceptance.first_token(first if grammar is None else grammar.first(first)))
        if proc is not None:
            proc.emitted(out.logits, [0], checker.token_ids)
        if grammar is not None:
            grammar.advance(checker.token_ids)
        stats.prefill_seconds = time.perf_counter() - start
        # The sequence (prompt + tokens so far) is built once a step, O(sequence): observed, then proposed after.
        sequence = self.prompt_ids + checker.token_ids
        draft.observe(TargetOutput(sequence, out.hidden[-1] if needs_hidden else None,
                                   None if head_name is None else out.heads[head_name][0].cpu(),
                                   target_states_at(engine, states, out, None)))
        while not checker.stopped:
            start = time.perf_counter()
            if draft.drafts_together:   # with the other requests' drafts of this pass (one drafter step each layer)
                draft.submit(sequence)
                yield from ctx.together()
                tree, tokens = draft.collect()
            else:
                tree, tokens = draft.propose(sequence)
            tokens = check_draft_tree(engine, node, tree, tokens, sequence[-1], self.max_draft_tokens)
            probs = draft.draft_probs
            if grammar is not None:   # (drafts the grammar rejects at their parent's state: never verified)
                tree, tokens, probs = grammar.prune(tree, tokens, probs)
            if self.budget is not None:
                tree, tokens, probs = cut_tree(tree, tokens, self.budget.tokens(self, engine.device, tree.size - 1),
                                               probs)
                if grammar is not None:
                    grammar.cut(tree.size)
            deepest = max(tree.depth)
            if max_depth is not None and deepest > max_depth:
                raise ValueError(f"the draft proposed a tree {deepest} tokens deep, past its max_depth {max_depth}")
            check_positions(engine.model, Positions(len(sequence) + deepest, f"{len(sequence)} tokens so far + a "
                                                    f"draft tree {deepest} deep"), ctx.name)
            drafted = time.perf_counter()
            yield from ctx.reserve(1 + engine.pool.pages_for(tree.size - 1))
            ids = _add_tree(engine, node, tree, tokens)
            out = yield StepRequest([node] + ids, argmax=greedy and proc is None and grammar is None, **want)
            logits = out.logits if proc is None else \
                proc.tree(tree, to_device(np.asarray(tokens, dtype=np.int64), engine.device), out.logits)
            # Read with the other requests' reads in one copy: greedy, the step's argmax at every tree
            # token (the grammar's masks applied to the processed logits); rejection sampling, its decision made
            # on the device (no wait per child tried).
            if greedy:
                chosen = grammar.choice(logits) if grammar is not None else \
                    out.argmax if proc is None else sample_tokens(logits, GREEDY)
                decided = greedy_path(tree, tokens, (yield Read(chosen)))
            elif isinstance(acceptance, RejectionSampling):   # (its numbers: this request's step's, as pipelined)
                decided = decode_outcome((yield Read(acceptance.outcome(tree, tokens, logits, probs,
                                                                        step=stats.steps))))
            else:
                decided = None
            before = checker.num_tokens
            result = _settle(engine, node, tree, tokens, ids, acceptance, logits, out.hidden, out.heads,
                             head_name, stop_ids, checker, probs, decided)
            if grammar is not None and not checker.stopped:
                grammar.advance(result.accepted + [result.bonus])
            if proc is not None:   # (each emitted token drawn at its parent's row: the root's, then the path's)
                new = checker.token_ids[before:]
                proc.emitted(out.logits, ([0] + result.path)[:len(new)], new)
                if self.on_tokens is not None and p.logprobs is not None:   # (streamed a step: read a step)
                    stats.logprobs = proc.logprobs()
            stats.steps += 1
            stats.accepted.append(len(result.accepted))
            if self.budget is not None:
                self.budget.observe(self, len(result.accepted))
            stats.draft_sizes.append(tree.size - 1)
            stats.draft_seconds.append(drafted - start)
            stats.verify_seconds.append(time.perf_counter() - drafted)
            if not checker.stopped:
                sequence = self.prompt_ids + checker.token_ids
                draft.observe(TargetOutput(sequence, result.hidden if needs_hidden else None, result.head,
                                           target_states_at(engine, states, out, [0] + result.path)))
            self.stepped(stats, checker)
        stats.logprobs = None if proc is None else proc.logprobs()

    def _pipelined(self, ctx: ProgramContext, checker: StopChecker, head_name: str | None, stats: SpeculativeStats):
        """The pipelined loop: the prompt and the first token here, then the steps in the scheduler's verify table
        (:mod:`treedec.programs.speculative.verify_table`), with every other request of its group; fills ``stats``
        as :meth:`_steps` does."""
        engine, full, kind = ctx.engine, self.draft.fixed_tree, self.target_states
        if full.size > self.max_draft_tokens:
            raise ValueError(f"the draft's fixed tree has {full.size} tokens; at most max_draft_tokens="
                             f"{self.max_draft_tokens}")
        want = {"heads": head_name is not None, "hidden": kind == "hidden", "aux": isinstance(kind, tuple)}
        start = time.perf_counter()
        node, out = yield from ctx.prompt(self.prompt_ids, all_rows=kind is not None, **want)
        stats.node = node
        logits = out.logits[0] if not self.penalized else \
            TargetProcessing(self.params, self.prompt_ids, out.logits.shape[-1], out.logits.device).first(
                out.logits[:1])[0]
        first = self.acceptance.first_sample(logits)
        following = None if kind is None else torch.cat(
            [to_device(np.asarray(self.prompt_ids[1:], dtype=np.int64), engine.device), first])
        stats.prefill_seconds = time.perf_counter() - start
        yield Verify(self, node, first, checker, stats, head_name, None if head_name is None else out.heads[head_name][0],
                     target_states_at(engine, kind, out), following)

    def stepped(self, stats: SpeculativeStats, checker: StopChecker) -> None:
        """After a verification step (either loop): ``on_step``, then ``on_text`` or ``on_tokens`` with the news."""
        if self.on_step is not None:
            self.on_step(stats, len(checker.token_ids))
        if self.on_text is not None:
            end = checker.streamable_length
            if end > self._shown:   # (only the new characters are joined)
                self.on_text(checker.text_from(self._shown), checker)
                self._shown = end
        if self.on_tokens is not None:
            self.on_tokens.hand_off(checker, stats)


def speculative_generate(engine: Engine, prompt_ids: Sequence[int], draft: DraftSource, max_new_tokens: int,
                         acceptance: AcceptanceRule | None = None,
                         on_step: Callable[[SpeculativeStats, int], None] | None = None,
                         eos_token_id: int | Sequence[int] | str | None = MODEL_EOS, pipeline: bool | None = None
                         ) -> tuple[list[int], SpeculativeStats]:
    """Speculative decoding of one request: prefill, then verification steps.

    Parameters
    ----------
    draft : the draft source, a :class:`~treedec.programs.speculative.drafts.DraftSource` (else TypeError); its
        ``start`` / ``needs_hidden`` / ``row_head`` / ``observe`` / ... members are used.
    max_new_tokens : int >= 1.
    acceptance : default :class:`GreedyAcceptance` (then the tokens are exactly those of
        plain greedy decoding); :class:`~treedec.programs.speculative.acceptance.TypicalAcceptance` or
        :class:`~treedec.programs.speculative.acceptance.RejectionSampling` for sampled decoding.
    on_step : called as ``on_step(stats, emitted)`` after every verification step
        (``emitted``: new tokens so far), e.g. to advance a progress bar.
    eos_token_id : ``"model"`` (default: ``engine.model.eos_token_ids``, the checkpoint's),
        an id, several ids, or None (no EOS stop).
    pipeline : run step n+1 before step n's tokens reach the host
        (:mod:`treedec.programs.speculative.verify_table`: drafts with a ``fixed_tree`` drafted on the device, such
        as Medusa heads run in the step or a ``TreeDraft`` of fixed tokens, under greedy acceptance or
        rejection sampling). Default: on for a CUDA engine when the draft
        and rule allow it (``stats.pipelined`` and ``stats.pipeline_note`` say what was chosen and why); True
        raises ValueError when they do not. Same tokens either way.

    Returns ``(tokens, stats)``: the new tokens up to and including the first EOS id, at
    most ``max_new_tokens`` of them, and the run's :class:`SpeculativeStats`
    (``stats.stop_reason`` says which limit ended it). The request stays in
    ``engine.tree`` as node ``stats.node``: the prompt and the accepted tokens (a bonus
    token, not computed, is not on it).
    """
    positive_int("max_new_tokens", max_new_tokens)
    rule = StopRule(max_new_tokens, eos_token_ids(eos_token_id, engine.model))
    program = SpeculativeProgram(prompt_ids, draft, rule, acceptance=acceptance, keep_node=True, on_step=on_step,
                                 max_draft_tokens=engine.pool.num_pages * engine.pool.page_size, pipeline=pipeline)
    checker, stats = run_program(engine, program)
    return checker.token_ids, stats


# ================================================================ private


#: The row head name (:meth:`Engine.add_row_head`) of a draft source's ``row_head``.
DRAFT_HEAD = "draft"


def _add_draft_head(engine: Engine, row_head) -> str | None:
    """Put the draft's ``row_head`` on the engine as :data:`DRAFT_HEAD` (replacing another draft's);
    its name, or None for a draft without one."""
    if row_head is None:
        return None
    if DRAFT_HEAD in engine.row_heads:
        if engine.row_head(DRAFT_HEAD) == row_head:   # bound methods of one draft compare equal
            return DRAFT_HEAD
        engine.remove_row_head(DRAFT_HEAD)
    engine.add_row_head(DRAFT_HEAD, row_head)
    return DRAFT_HEAD


def _target_states(draft) -> str | tuple[int, ...] | None:
    """The draft's ``target_states`` member, checked: None, "hidden" or a tuple of layer indices."""
    states = draft.target_states
    if states is None or states == "hidden":
        return states
    if isinstance(states, (tuple, list)) and states and all(is_int(i) for i in states):
        return tuple(int(i) for i in states)
    raise ValueError(f"a draft's target_states must be None, 'hidden' or a tuple of layer indices, got {states!r}")


def _add_tree(engine: Engine, node: int, tree: TokenTree, tokens: list[int]) -> list[int]:
    """Append the root to ``node`` and hang the draft tokens under it; their node ids.
    (The root may start a fresh page and the drafts take fresh pages of their own.)"""
    engine.tree.extend(node, tokens[:1])
    return engine.tree.add_token_tree(node, tokens[1:], tree.draft_parents()) if tree.size > 1 else []


def _settle(engine: Engine, node: int, tree: TokenTree, tokens: list[int], ids: list[int],
            acceptance: AcceptanceRule, logits: torch.Tensor, hidden: torch.Tensor | None,
            heads: dict | None, head_name: str | None, stop_ids: Collection[int],
            checker: StopChecker | None = None, draft_probs: torch.Tensor | None = None,
            decided: tuple[list[int], int] | None = None) -> VerifyResult:
    """After the step: the accepted path (cut at an EOS, and where ``checker`` ends the output) moves
    onto ``node``, the rest of the tree is freed. ``decided``: the acceptance's ``(path, bonus)`` when the
    caller has it already (read for all requests of a batch at once); else ``acceptance.accept`` decides."""
    head = HostCopy(heads[head_name]) if head_name is not None else None
    if decided is not None:
        path, bonus = decided
    else:
        path, bonus = (acceptance.accept(tree, tokens, logits) if draft_probs is None
                       else acceptance.accept(tree, tokens, logits, draft_probs))
    assert all(tree.parents[c] == p for p, c in zip([0] + path, path)), f"not a root path: {path=}"
    stop = next((d for d, i in enumerate(path) if tokens[i] in stop_ids), None)
    if stop is not None:
        path, bonus = path[:stop], tokens[path[stop]]
    if checker is not None:   # a stop string or the token budget inside the path
        decision = checker.accept([tokens[i] for i in path] + [int(bonus)])
        path = path[:min(decision.keep, len(path))]
    if ids:
        engine.tree.accept(node, [ids[i - 1] for i in path])   # their K/V move onto node; the rest is freed
    last = path[-1] if path else 0
    return VerifyResult([tokens[i] for i in path], int(bonus), None if hidden is None else hidden[last],
                        None if head is None else head.tensor()[last], list(path))
