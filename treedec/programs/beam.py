"""Beam search on the tree engine: transformers' algorithm, each live beam a leaf of one tree.

The prompt is prefilled once; each step computes the next-token logits of every live
beam in ONE engine step (tree attention: each beam attends to its own path, the shared
prefix is read in place). Candidate selection is that of transformers'
``GenerationMixin._beam_search`` (greedy, ``do_sample=False``):

1. every live beam's log-softmax plus its cumulative log-prob; the top
   ``keep = max(2, 1 + len(eos)) * num_beams`` candidates over all beams, best first;
2. a candidate *hits a stop* if its token is an EOS id or it reaches ``max_new_tokens``;
   of the first ``num_beams`` candidates, those that hit a stop become finished
   hypotheses scored ``sum_logprobs / new_tokens ** length_penalty`` (``new_tokens``
   counts the EOS token); the best ``num_beams`` finished hypotheses are kept;
3. the first ``num_beams`` candidates that hit no stop are the next live beams;
4. the search ends when every candidate hits a stop (``max_new_tokens``), when
   ``early_stopping is True`` and ``num_beams`` hypotheses are finished, or when the
   heuristic says the best live beam cannot beat the worst finished hypothesis: its
   score over ``length ** length_penalty``, with ``length`` the tokens generated so far,
   or ``max_new_tokens`` when ``early_stopping == "never"`` and ``length_penalty > 0``.

With a grammar (structured outputs: ``beam_program(..., grammar=...)``, :class:`BeamSearchParams`'
``structured_outputs``) every live beam carries its own matcher: each step its logits are masked by its matcher's
bitmask before the log-softmax (the scores are the masked distribution's), a candidate the grammar forbids is never
kept, and a beam continued by several candidates forks its matcher, one per child (xgrammar's ``fork``); a grammar
ends only at an EOS id (the grammar's stop ids when the search has none).

On the tree: a beam continued by one candidate grows in place (its leaf is extended); a
beam continued by m > 1 candidates gets m children (they share its KV, nothing is
copied); a beam not continued is pruned with every ancestor that leads only to it, so
its pages are freed at once. When the search returns, the request's tree is pruned:
every page it used is free again (the result keeps the tokens, not the KV).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from treedec.checks import describe, finite_float, positive_int
from treedec.engine import Engine
from treedec.runtime.request import MODEL_EOS, Positions, RequestStats, eos_token_ids, pages_in_use
from treedec.runtime.program import Program, ProgramContext, StepRequest
from treedec.runtime.scheduler import run_program
from treedec.sampling.grammar import BitmaskRows, Grammar, apply_bitmask
from treedec.sampling.structured import StructuredOutputsParams, structured_outputs
from treedec.tree.validate import int_list

EARLY_STOPPING = (False, True, "never")


@dataclass
class BeamSearchStats(RequestStats):
    """Counters of one :func:`beam_search` run: one step per generated position, its
    queries the live beams (see :class:`~treedec.runtime.request.RequestStats`)."""


@dataclass(frozen=True)
class BeamSearchParams:
    """How ``LLM.beam_search`` searches (vLLM's ``BeamSearchParams``; :func:`beam_program`'s arguments). Checked on construction.

    Attributes
    ----------
    beam_width : the beams kept, and the sequences returned.
    max_tokens : new tokens at most; a hypothesis that reaches it without an EOS ends there.
    ignore_eos : the model's EOS ids do not end a hypothesis.
    temperature : 0 only: the search scores the raw log-probabilities (transformers' beam search; a temperature
        raises NotImplementedError).
    length_penalty : the exponent of the length in a finished hypothesis' score (``sum of log-probs /
        new tokens ** length_penalty``; > 0 favours long ones).
    include_stop_str_in_output : False only (beam search ends on EOS ids, not stop strings; True raises
        NotImplementedError).
    early_stopping : treedec's (transformers'): False (stop when the best live beam cannot win), True (stop as soon
        as ``beam_width`` hypotheses are finished) or ``"never"``.
    structured_outputs : None, or a :class:`~treedec.sampling.structured.StructuredOutputsParams` (a mapping of its
        fields): every hypothesis matches it, each beam with its own grammar state (treedec's; vLLM's beam search
        takes none).
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool | str = False
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self):
        object.__setattr__(self, "structured_outputs", structured_outputs(self.structured_outputs))
        positive_int("beam_width", self.beam_width)
        positive_int("max_tokens", self.max_tokens)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {describe(self.ignore_eos)}")
        if finite_float("temperature", self.temperature) != 0:
            raise NotImplementedError(f"beam search at temperature {self.temperature}: treedec's beam search scores "
                                      f"the raw log-probabilities (transformers' algorithm); give temperature=0")
        finite_float("length_penalty", self.length_penalty)
        if self.include_stop_str_in_output is not False:
            raise NotImplementedError("include_stop_str_in_output: beam search ends on EOS ids only, it has no stop "
                                      "strings to include")
        if not any(self.early_stopping is v if isinstance(v, bool) else self.early_stopping == v
                   for v in EARLY_STOPPING):
            raise ValueError(f"early_stopping must be False, True or 'never', got {describe(self.early_stopping)}")


@dataclass
class BeamSearchResult:
    """The finished hypotheses of :func:`beam_search`, best first.

    Attributes
    ----------
    sequences : ``num_beams`` lists of new tokens (the prompt not included); a hypothesis
        that ended on an EOS id ends with that token.
    scores : their scores, ``sum of token log-probs / len(sequence) ** length_penalty``
        (float32 arithmetic, as transformers' ``sequences_scores``).
    stats : :class:`BeamSearchStats`.
    """

    sequences: list[list[int]]
    scores: list[float]
    stats: BeamSearchStats


def beam_search(engine: Engine, prompt_ids: Sequence[int], num_beams: int, max_new_tokens: int,
                length_penalty: float = 1.0, eos_token_id: int | Sequence[int] | str | None = MODEL_EOS,
                early_stopping: bool | str = False) -> BeamSearchResult:
    """Beam search of width ``num_beams`` after ``prompt_ids``; see the module docstring. The arguments are those
    of :func:`beam_program`, whose program this runs alone."""
    return run_program(engine, beam_program(engine, prompt_ids, num_beams, max_new_tokens, length_penalty,
                                            eos_token_id, early_stopping))


def beam_program(engine: Engine, prompt_ids: Sequence[int], num_beams: int, max_new_tokens: int,
                 length_penalty: float = 1.0, eos_token_id: int | Sequence[int] | str | None = MODEL_EOS,
                 early_stopping: bool | str = False, grammar: Grammar | None = None) -> BeamProgram:
    """The :class:`BeamProgram` of a beam search of width ``num_beams`` after ``prompt_ids``, its arguments checked
    (:func:`beam_search` runs it alone; many run batched with :func:`~treedec.runtime.scheduler.run_programs`).

    Returns the same hypotheses and scores as transformers'
    ``model.generate(input_ids, num_beams=num_beams, do_sample=False, max_new_tokens=...,
    length_penalty=..., eos_token_id=..., early_stopping=..., num_return_sequences=num_beams)``
    (up to ties between equal float32 scores). ``num_beams=1`` runs this algorithm with
    one beam, which is not transformers' greedy search when an EOS id is given.

    Parameters
    ----------
    engine : the engine; the request is a new tree of ``engine.tree``, pruned on return
        (also when the search raises). :class:`BeamProgram` runs the same search batched with
        other programs (:func:`~treedec.runtime.scheduler.run_programs`).
    prompt_ids : the prompt's token ids (at least one).
    num_beams : int >= 1, with ``max(2, 1 + len(eos ids)) * num_beams <= vocab_size``.
    max_new_tokens : int >= 1; hypotheses that reach it without EOS finish there.
    length_penalty : exponent of the length in the finished score (> 0 favours long ones).
    eos_token_id : ``"model"`` (default: ``engine.model.eos_token_ids``, the checkpoint's, as
        transformers' default), an id, several ids, or None (hypotheses end only at
        ``max_new_tokens``).
    early_stopping : False (stop when the heuristic says the best live beam cannot win),
        True (also stop as soon as ``num_beams`` hypotheses are finished) or "never".
    grammar : a compiled structured-output constraint (:class:`~treedec.sampling.grammar.Grammar`): every
        hypothesis matches it (see the module docstring); without EOS ids its stop ids end a hypothesis.

    Raises
    ------
    ValueError : a bad argument (a prompt and ``max_new_tokens`` past the model's positions included),
        before the engine is touched.
    """
    positive_int("num_beams", num_beams)
    positive_int("max_new_tokens", max_new_tokens)
    length_penalty = finite_float("length_penalty", length_penalty)
    vocab = engine.model.config.vocab_size
    eos = eos_token_ids(eos_token_id, engine.model)
    if grammar is not None and not eos:
        eos = tuple(grammar.stop_token_ids)
    if not any(early_stopping is v if isinstance(v, bool) else early_stopping == v for v in EARLY_STOPPING):
        raise ValueError(f"early_stopping must be False, True or 'never', got {early_stopping!r}")
    keep = max(2, 1 + len(eos)) * num_beams
    if keep > vocab:
        raise ValueError(f"num_beams={num_beams} with {len(eos)} EOS id(s) keeps {keep} candidates per step, more "
                         f"than the vocabulary ({vocab}); use num_beams <= {vocab // max(2, 1 + len(eos))}")
    prompt_ids = int_list(prompt_ids, "prompt_ids", low=0)
    return BeamProgram(prompt_ids, num_beams, max_new_tokens, length_penalty, eos, early_stopping, keep, grammar)


class BeamProgram(Program):
    """One beam search as a scheduler program (:mod:`treedec.runtime.scheduler`); its result is the
    :class:`BeamSearchResult`. Made by :func:`beam_search` (which checks the arguments) or directly,
    with ``eos`` the EOS ids and ``keep`` the candidates kept per step."""

    def __init__(self, prompt_ids: list[int], num_beams: int, max_new_tokens: int, length_penalty: float,
                 eos: tuple[int, ...], early_stopping: bool | str, keep: int, grammar: Grammar | None = None):
        self.prompt_ids = list(prompt_ids)
        self.args = (num_beams, max_new_tokens, length_penalty, eos, early_stopping, keep, grammar)

    def step_pages(self, pool) -> int:
        return self.args[0]   # each live beam may start a page

    def positions(self) -> Positions:
        p, m = len(self.prompt_ids), self.args[1]
        return Positions(p + m, f"a {p}-token prompt + max_new_tokens {m}")

    def run(self, ctx: ProgramContext):
        root = None
        try:
            root, out = yield from ctx.prompt(self.prompt_ids)
            search = _BeamSearch(ctx, root, *self.args)
            yield from search.run(out.logits[:1])
        finally:
            ctx.free(root)
        scores, sequences = zip(*search.finished)
        return BeamSearchResult([list(s) for s in sequences], list(scores), search.stats)


# ================================================================ private


@dataclass
class _Beam:
    node: int            # the leaf whose last token is this beam's last token
    tokens: list[int]    # new tokens so far
    matcher: object = None   # its grammar state (structured outputs), else None


class _BeamSearch:
    """The state of one search: live beams (best first) with float32 scores, finished hypotheses."""

    def __init__(self, ctx: ProgramContext, root: int, num_beams: int, max_new_tokens: int, length_penalty: float,
                 eos: tuple[int, ...], early_stopping: bool | str, keep: int, grammar: Grammar | None = None):
        engine = ctx.engine
        self.ctx, self.engine, self.tree, self.root = ctx, engine, engine.tree, root
        self.num_beams, self.max_new_tokens, self.length_penalty = num_beams, max_new_tokens, length_penalty
        self.eos = torch.tensor(eos, dtype=torch.int64, device=engine.device)
        self.early_stopping, self.keep = early_stopping, keep
        self.masks = None if grammar is None else BitmaskRows(grammar.vocab, engine.device)
        self.beams = [_Beam(root, [], None if grammar is None else grammar.matcher(eos))]
        self.scores = torch.zeros(1, dtype=torch.float32, device=engine.device)   # [live beams] cumulative log-probs
        self.finished: list[tuple[float, list[int]]] = []         # (score, tokens), best first, <= num_beams
        # The pages the search does not hold (the prompt's are its own).
        self.held_before = pages_in_use(engine.pool) - self.tree.pages_freed_by_prune([root])
        self.stats = BeamSearchStats()
        self._note_pages()

    def run(self, logits: torch.Tensor):
        """Steps until a stop condition (a generator); ``logits`` [1, vocab]: the prompt's next-token logits."""
        for generated in range(1, self.max_new_tokens + 1):    # tokens each candidate of this step has
            vocab = logits.shape[-1]
            if self.masks is not None:   # (each beam's grammar state: the masked distribution's log-probs)
                logits = apply_bitmask(logits.float().clone(), self.masks.fill([b.matcher for b in self.beams]))
            cumulative = torch.log_softmax(logits.float(), dim=-1) + self.scores[:, None]
            top_scores, top_index = cumulative.reshape(-1).topk(self.keep)   # [keep], best first
            if self.masks is not None:   # (fewer allowed candidates than kept: the forbidden ones are no candidates)
                allowed = int(torch.isfinite(top_scores).sum())
                top_scores, top_index = top_scores[:allowed], top_index[:allowed]
            top_token = top_index % vocab
            parent, token = (top_index // vocab).tolist(), top_token.tolist()
            stops = torch.isin(top_token, self.eos) | (generated >= self.max_new_tokens)
            self._add_finished(top_scores, parent, token, stops.tolist(), generated)
            live = (~stops).nonzero().reshape(-1)[: self.num_beams].tolist()
            if bool(stops.all()) or not self._continues(top_scores[live], generated):
                return
            logits = yield from self._advance([(parent[i], token[i]) for i in live])
            self.scores = top_scores[live]

    def _add_finished(self, top_scores: torch.Tensor, parent: list[int], token: list[int], stops: list[bool],
                      generated: int) -> None:
        """Candidates among the first ``num_beams`` that hit a stop join the finished hypotheses.

        (transformers also refuses new hypotheses once its heuristic or ``early_stopping=True``
        has closed a batch item; for one request that state has already ended the search.)
        """
        scores = (top_scores / (generated ** self.length_penalty)).tolist()   # float32, as transformers
        new = [(scores[i], self.beams[parent[i]].tokens + [token[i]])
               for i in range(min(self.num_beams, len(stops))) if stops[i]]
        # A stable sort: on equal scores the older hypothesis stays first.
        self.finished = sorted(self.finished + new, key=lambda h: -h[0])[: self.num_beams]

    def _continues(self, live_scores: torch.Tensor, generated: int) -> bool:
        """False when the search is over: ``num_beams`` hypotheses are finished and either
        ``early_stopping is True`` or the best live beam cannot beat the worst of them."""
        if len(self.finished) < self.num_beams:
            return True
        if self.early_stopping is True:
            return False
        if self.early_stopping == "never" and self.length_penalty > 0:
            length = self.max_new_tokens
        else:
            length = generated
        best_possible = float(live_scores[:1] / (length ** self.length_penalty))   # float32, as transformers
        return best_possible > self.finished[-1][0]

    def _advance(self, chosen: list[tuple[int, int]]):
        """Make the chosen ``(parent beam, token)`` the live beams on the tree; run their step (a generator).

        Returns their next-token logits [len(chosen), vocab].
        """
        by_parent: dict[int, list[int]] = {}
        for p, t in chosen:
            by_parent.setdefault(p, []).append(t)
        for p, beam in enumerate(self.beams):
            if p not in by_parent:
                self.tree.prune_dead_end(beam.node, self.root)
        yield from self.ctx.reserve(sum(self.tree.pages_to_extend(self.beams[p].node, 1) if len(toks) == 1
                                        else len(toks) for p, toks in by_parent.items()))
        grow = {self.beams[p].node: toks for p, toks in by_parent.items() if len(toks) == 1}
        self.tree.extend_many(grow)
        children = {p: iter(self.tree.branch(self.beams[p].node, [[t] for t in toks]))
                    for p, toks in by_parent.items() if len(toks) > 1}
        beams = []
        for p, t in chosen:
            node = next(children[p]) if p in children else self.beams[p].node
            matcher = self.beams[p].matcher
            if matcher is not None:   # a branch's own grammar state: each child of a beam forks it
                matcher = matcher.fork() if p in children else matcher
                if not matcher.accept_token(t):
                    raise RuntimeError(f"beam search: the grammar does not accept token {t}, which its mask allowed")
            beams.append(_Beam(node, self.beams[p].tokens + [t], matcher))
        self.beams = beams
        logits = (yield StepRequest([b.node for b in beams])).logits
        self.stats.steps += 1
        self.stats.queries_per_step.append(len(beams))
        self._note_pages()
        return logits

    def _note_pages(self) -> None:
        self.stats.peak_pages = max(self.stats.peak_pages, pages_in_use(self.engine.pool) - self.held_before)
