"""Parallel sampling and self-consistency: n samples of one prompt as n branches of its node.

The prompt is prefilled once; sample i is a child node of the prompt's node, so every
sample reads the prompt's KV in place (pages used: the prompt's, plus each sample's
own). Each step samples the next token of every live sample from its logits and
computes them all in ONE engine step. A sample ends on an EOS id or at
``max_new_tokens``; an ended sample is pruned at once (its pages freed for the others),
or kept as a node under the prompt's node with ``keep=True``. The loop is
:class:`~treedec.programs.generate.GenerateProgram`'s, run alone (:func:`~treedec.programs.generate.generate_batch`
runs it for many requests at once).

:func:`self_consistency` samples n answers, maps each to an answer with the caller's
extractor, and takes the majority vote (:func:`majority_vote`).
"""
from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from treedec.checks import positive_int
from treedec.engine import Engine
from treedec.programs.generate import GenerateProgram, unseeded_seed
from treedec.runtime.request import MODEL_EOS, RequestStats, eos_token_ids
from treedec.runtime.requests import RequestSpec
from treedec.sampling.params import SamplingParams
from treedec.runtime.scheduler import run_programs
from treedec.sampling.stops import StopRule
from treedec.tree.validate import int_list

__all__ = ["Sample", "SamplingResult", "SamplingStats", "SelfConsistencyResult", "majority_vote", "parallel_sample",
           "self_consistency"]

@dataclass
class Sample:
    """One sample of :func:`parallel_sample`.

    Attributes
    ----------
    tokens : its new tokens (the prompt not included); ends with the EOS id if it ended on one.
    stop_reason : "eos" or "length" (``max_new_tokens`` reached).
    node : with ``keep=True``, its node: a child of the prompt's node holding ``tokens``
        (all computed); else None.
    """

    tokens: list[int]
    stop_reason: str
    node: int | None = None


@dataclass
class SamplingStats(RequestStats):
    """Counters of one :func:`parallel_sample` run: a step's queries are one token per live
    sample, plus each kept sample's last token in the step after it ended
    (see :class:`~treedec.runtime.request.RequestStats`)."""


@dataclass
class SamplingResult:
    """The samples of :func:`parallel_sample`, in sample order.

    Attributes
    ----------
    samples : the n :class:`Sample`.
    root : with ``keep=True``, the prompt's node (prune it to free the request); else None
        (every page of the request is free again).
    stats : :class:`SamplingStats`.
    """

    samples: list[Sample]
    root: int | None
    stats: SamplingStats


def parallel_sample(engine: Engine, prompt_ids: Sequence[int], n: int, max_new_tokens: int,
                    params: SamplingParams = SamplingParams(),
                    eos_token_id: int | Sequence[int] | str | None = MODEL_EOS,
                    generator: torch.Generator | None = None, keep: bool = False,
                    pipeline: bool | None = None) -> SamplingResult:
    """``n`` independent samples after ``prompt_ids``, as ``n`` branches of the prompt's node.

    Parameters
    ----------
    engine : the engine; the request is a new tree of ``engine.tree``.
    prompt_ids : the prompt's token ids (at least one).
    n : samples, int >= 1.
    max_new_tokens : int >= 1; a sample that reaches it without EOS ends there.
    params : :class:`SamplingParams`: how tokens are drawn (temperature, top_k, top_p, min_p, penalties, ...);
        its ``n`` and ``max_tokens`` are those given here, its stops are ``eos_token_id``'s.
    eos_token_id : ``"model"`` (default: ``engine.model.eos_token_ids``, the checkpoint's), an
        id, several ids, or None.
    generator : torch.Generator on the model's device: the same seed gives the same samples.
        Each draw takes ``n`` uniform numbers from it (one per sample, live or not) and sample
        i's token is drawn with number i, so the samples do not depend on ``pipeline``.
    keep : False: each sample's node is pruned when it ends and the prompt's node at the
        end (all pages free); True: every sample stays as a child of ``result.root``.
    pipeline : default on for a CUDA engine (off on the CPU, where nothing would overlap):
        each step is planned and launched before the previous draw is read back (the step
        reads the drawn tokens on the device), so the host's work overlaps the device's. A
        sample that ended at that draw then computed one token more, which is dropped; the
        samples and the tree left are the same, ``stats`` may count one step more.

    Raises
    ------
    ValueError : a bad argument, before the engine is touched. If the run itself fails
        (e.g. PoolExhaustedError), the request is pruned before the error propagates.
    """
    positive_int("n", n)
    positive_int("max_new_tokens", max_new_tokens)
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
    if not isinstance(keep, bool):
        raise ValueError(f"keep must be a bool, got {keep!r}")
    if pipeline is not None and not isinstance(pipeline, bool):
        raise ValueError(f"pipeline must be a bool or None (on for a CUDA engine), got {pipeline!r}")
    eos = eos_token_ids(eos_token_id, engine.model)
    prompt_ids = int_list(prompt_ids, "prompt_ids", low=0)
    spec = RequestSpec(0, prompt_ids=tuple(prompt_ids), params=params.replace(n=n, max_tokens=max_new_tokens))
    program = GenerateProgram(spec, prompt_ids, rule=StopRule(max_new_tokens, eos), keep=keep)
    [outputs], run = run_programs(engine, [program], preempt=False, min_shared_prefix=0, pipeline=pipeline,
                                  seed=unseeded_seed(generator))
    first = outputs[0].stats
    stats = SamplingStats(steps=first["steps"], queries_per_step=first["queries_per_step"], peak_pages=run.peak_pages)
    samples = [Sample(r.output_ids, r.stop_reason, r.stats["nodes"][r.index] if keep else None) for r in outputs]
    return SamplingResult(samples, first["root"] if keep else None, stats)


# ================================================================ self-consistency


@dataclass
class SelfConsistencyResult:
    """The vote of :func:`self_consistency`.

    Attributes
    ----------
    answer : the majority answer, or None if no sample gave one.
    votes : answer -> number of samples that gave it, in order of first appearance.
    answers : each sample's extracted answer (None: no answer, not counted).
    samples : the :class:`SamplingResult` (its pages are already free).
    """

    answer: Hashable | None
    votes: dict[Hashable, int]
    answers: list[Hashable | None]
    samples: SamplingResult


def majority_vote(answers: Sequence[Hashable | None]) -> tuple[Hashable | None, dict[Hashable, int]]:
    """The most frequent non-None answer and the vote counts (in order of first appearance).

    None answers are ignored; a tie goes to the tied answer that appears first in
    ``answers``. No non-None answer: ``(None, {})``.
    """
    votes: dict[Hashable, int] = {}
    for i, a in enumerate(answers):
        if a is None:
            continue
        if not isinstance(a, Hashable):
            raise TypeError(f"answers[{i}] = {a!r:.60} is not hashable; extract_answer must return a hashable "
                            f"value (str, int, tuple, ...) or None")
        votes[a] = votes.get(a, 0) + 1
    best = max(votes, key=votes.__getitem__, default=None)   # max keeps the first of equal counts
    return best, votes


def self_consistency(engine: Engine, prompt_ids: Sequence[int], n: int,
                     extract_answer: Callable[[list[int]], Hashable | None], max_new_tokens: int,
                     params: SamplingParams = SamplingParams(),
                     eos_token_id: int | Sequence[int] | str | None = MODEL_EOS,
                     generator: torch.Generator | None = None) -> SelfConsistencyResult:
    """Self-consistency: ``n`` samples (:func:`parallel_sample`), one answer each, majority vote.

    ``extract_answer(tokens)`` maps a sample's new tokens to a hashable answer, or None
    when the sample has none (it then does not vote). Ties: :func:`majority_vote`. Every
    page of the request is free when this returns.
    """
    if not callable(extract_answer):
        raise ValueError(f"extract_answer must be callable (tokens -> answer or None), got {extract_answer!r:.60}")
    result = parallel_sample(engine, prompt_ids, n, max_new_tokens, params, eos_token_id, generator, keep=False)
    answers = [extract_answer(list(s.tokens)) for s in result.samples]
    answer, votes = majority_vote(answers)
    return SelfConsistencyResult(answer, votes, answers, result)

