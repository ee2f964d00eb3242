"""Speculative decoding of many requests at once: every request's draft tree in ONE step.

:func:`speculative_batch` is :func:`~treedec.programs.generate.generate_batch` for speculative
decoding: each request is a :class:`~treedec.programs.speculative.program.SpeculativeProgram` run by the
scheduler (:mod:`treedec.runtime.scheduler`): every iteration each live request's draft source
proposes a token tree after its sequence, all the trees are verified in one engine step (one
plan over the forest, one forward), and each request keeps its accepted path (its K/V moved
onto the sequence, the rest freed) and the bonus token, under its own stop rule (EOS ids, stop
strings, ``max_new_tokens``: an EOS or a stop string inside an accepted path cuts it there).

Any draft source batches: n-gram lookup, fixed trees, Medusa heads (their row head runs inside
the shared step for every request's rows; the requests' drafts must share one heads module),
drafts that read the target's hidden states, EAGLE drafters and draft models (greedy drafts on one
drafter engine draft together: one drafter step per tree layer for all the pass's requests,
:mod:`treedec.programs.speculative.drafter_batch`). Acceptance is greedy by default (then every request's
tokens are exactly those of plain greedy decoding of its prompt, whatever the draft: tested);
``acceptance`` gives a sampled rule.
"""
from __future__ import annotations

from typing import Callable, Sequence

from treedec.checks import positive_int
from treedec.engine import Engine
from treedec.errors import PoolExhaustedError
from treedec.runtime.decode import LaneOutput
from treedec.programs.speculative.acceptance import AcceptanceRule, RejectionSampling
from treedec.programs.generate import grammar_compiler, prepare_requests, request_grammar, request_results
from treedec.sampling.grammar import Grammar, GrammarCompiler
from treedec.programs.speculative.draft_budget import DraftBudget
from treedec.programs.speculative.drafts import DraftSource, check_draft_source
from treedec.runtime.prefix_cache import PrefixCache
from treedec.runtime.request import check_positions
from treedec.runtime.requests import RequestResult, RequestSpec
from treedec.runtime.scheduler import SchedulerStats, run_programs
from treedec.programs.speculative.program import SpeculativeProgram
from treedec.programs.speculative.step_tokens import StepTokens
from treedec.sampling.stops import StopChecker

#: The :class:`~treedec.sampling.params.SamplingParams` fields speculative decoding implements (the others, e.g.
#: logits processors, min_tokens, logit_bias, are refused before anything runs rather than ignored); temperature,
#: top_k, top_p and min_p are the acceptance rule's; the penalties and logprobs the program's
#: (:mod:`treedec.programs.speculative.target_processing`).
SPECULATIVE_PARAMS = frozenset({"n", "temperature", "top_k", "top_p", "min_p", "seed", "stop", "stop_token_ids",
                                "ignore_eos", "max_tokens", "include_stop_str_in_output", "truncate_prompt_tokens",
                                "best_of", "repetition_penalty", "presence_penalty", "frequency_penalty", "logprobs"})

__all__ = ["sampled_acceptance", "speculative_batch", "speculative_program", "speculative_results"]


def speculative_batch(engine: Engine, requests: Sequence[RequestSpec], draft: Callable[[RequestSpec], DraftSource],
                      tokenizer=None, chat_template: bool = False, max_draft_tokens: int = 64,
                      acceptance: Callable[[RequestSpec], AcceptanceRule] | None = None,
                      on_request_done: Callable[[list[RequestResult]], None] | None = None,
                      max_step_tokens: int | None = None, draft_budget: DraftBudget | None = None,
                      pipeline: bool | None = None, on_step: Callable[[SchedulerStats], None] | None = None,
                      prefix_cache: PrefixCache | None = None, grammars: GrammarCompiler | None = None
                      ) -> tuple[list[RequestResult], SchedulerStats]:
    """Speculative decoding of ``requests`` batched over ``engine``'s forest.

    Parameters
    ----------
    requests : :class:`RequestSpec` with ``n=1``; ``temperature=0`` unless ``acceptance`` is given.
    draft : makes each request's draft source, e.g. ``lambda spec: PromptLookupDraft()``.
    tokenizer, chat_template, on_request_done, on_step, prefix_cache, grammars : as
        :func:`~treedec.programs.generate.generate_batch` (structured outputs: greedy requests only).
    max_draft_tokens : the largest tree a draft may propose (its root included): the scheduler
        keeps its pages free for each live request's next step.
    acceptance : makes each request's acceptance rule (default greedy), e.g.
        ``lambda spec: RejectionSampling(spec.params.temperature, seed=spec.params.seed)``.
    max_step_tokens : as :func:`~treedec.programs.generate.generate_batch`.
    draft_budget : how many draft tokens each request verifies a step (:mod:`treedec.programs.speculative.draft_budget`):
        default ``DraftBudget()`` (automatic: 256 verify tokens a step for the batch on a GPU, roots included,
        measured acceptance; no limit on the CPU). Each step's decision is in ``draft_budget.history`` and
        each request's verified tree sizes in its result's ``stats["draft_sizes"]``.
    pipeline : the requests' steps pipelined (:mod:`treedec.programs.speculative.verify_table`: drafts with a fixed
        tree drafted on the device, greedy or rejection sampling; True raises where they do not); None (the
        default): where they allow it on a GPU, at any batch size; False: never. Each result's
        ``stats["pipelined"]`` says which ran and ``stats["pipeline_note"]`` why not. Pipelined, the requests whose
        trees share a shape, a drafting and an acceptance rule are verified, accepted, their K/V moved and their
        next trees drafted as one batched operation each a step (the verify table's groups): the host work of a
        step is a fixed number of array operations for the group, whatever its size, and overlaps the device's
        step.

    Returns
    -------
    ``(results, stats)`` as :func:`~treedec.programs.generate.generate_batch`; each result's ``stats``
    also holds ``accepted`` (draft tokens accepted at each of its steps).
    """
    if not callable(draft):
        raise TypeError(f"draft must be a function of a RequestSpec returning a draft source, got {draft!r:.60}")
    if acceptance is not None and not callable(acceptance):
        raise TypeError(f"acceptance must be a function of a RequestSpec returning an AcceptanceRule, "
                        f"got {acceptance!r:.60}")
    positive_int("max_draft_tokens", max_draft_tokens)
    if draft_budget is None:
        draft_budget = DraftBudget()
    elif not isinstance(draft_budget, DraftBudget):
        raise TypeError(f"draft_budget must be a DraftBudget or None, got {type(draft_budget).__name__}")
    prepared = prepare_requests(engine, requests, tokenizer, chat_template)
    if grammars is None and any(spec.params.structured_outputs is not None for spec, _ in prepared):
        grammars = grammar_compiler(engine, tokenizer)
    programs, heads = [], {}
    for spec, prompt_ids in prepared:
        program = speculative_program(engine, spec, prompt_ids, draft(spec), tokenizer,
                                      None if acceptance is None else acceptance(spec), max_draft_tokens,
                                      draft_budget, pipeline, greedy_only=acceptance is None,
                                      grammar=request_grammar(grammars, spec))
        head = program.draft.row_head
        if head is not None:
            heads.setdefault(head, spec.id)
            if len(heads) > 1:
                raise ValueError(f"requests {list(heads.values())[0]!r} and {spec.id!r} have drafts with different row "
                                 f"heads (e.g. Medusa heads of other weights or tree depths); a batch's drafts share "
                                 f"the engine's one row head")
        programs.append(program)
    outputs: dict[int, list[RequestResult]] = {}

    def done(index: int, result) -> None:
        spec, prompt_ids = prepared[index]
        outputs[index] = speculative_results(spec, prompt_ids, result)
        if on_request_done is not None:
            on_request_done(outputs[index])

    _, stats = run_programs(engine, programs, on_done=done, max_step_tokens=max_step_tokens, on_step=on_step,
                            prefix_cache=prefix_cache)
    return [r for index in sorted(outputs) for r in outputs[index]], stats


def speculative_program(engine: Engine, spec: RequestSpec, prompt_ids: list[int], source: DraftSource, tokenizer=None,
                        acceptance: AcceptanceRule | None = None, max_draft_tokens: int = 64,
                        budget: DraftBudget | None = None, pipeline: bool | None = None,
                        pipeline_note: str | None = None, greedy_only: bool = True,
                        on_text: Callable[[str, StopChecker], None] | None = None, grammar: Grammar | None = None,
                        on_tokens: Callable[[StepTokens], None] | None = None) -> SpeculativeProgram:
    """Request ``spec`` (its prompt encoded: ``prompt_ids``) as a :class:`SpeculativeProgram` drafted by ``source``,
    checked before anything runs: ``n=1`` and only the :data:`SPECULATIVE_PARAMS` (ValueError naming the others),
    ``temperature=0`` when ``greedy_only`` (no sampled ``acceptance`` rule), its positions within the model's, its
    worst case (sequence and one draft tree) within the pool's free pages (else
    :class:`~treedec.errors.PoolExhaustedError`), and with ``pipeline=True`` a draft and rule that run pipelined (else
    ValueError saying why). ``on_text`` streams its text, ``on_tokens`` its token ids (:class:`SpeculativeProgram`).
    ``grammar``: its ``structured_outputs`` compiled (:func:`~treedec.programs.generate.request_grammar`; greedy
    only)."""
    if spec.params.n != 1 or (greedy_only and spec.params.temperature != 0):
        raise ValueError(f"request {spec.id!r}: speculative decoding gives one output a request, accepted greedily "
                         f"unless an acceptance rule is given: it needs temperature=0 and n=1, got "
                         f"temperature={spec.params.temperature}, n={spec.params.n}")
    spec.params.check_supported(SPECULATIVE_PARAMS | {"structured_outputs"}, "speculative decoding",
                                f"request {spec.id!r}")
    if (grammar is None) != (spec.params.structured_outputs is None) or (grammar and spec.params.temperature != 0):
        raise ValueError(f"request {spec.id!r}: structured_outputs with speculative decoding take temperature=0 "
                         f"(greedy acceptance) and their compiled grammar")
    check_draft_source(source, f"request {spec.id!r}: draft(spec)")
    rule = spec.params.stop_rule(engine.model.eos_token_ids)
    if grammar is not None:
        rule = grammar.stop_rule(rule)
    program = SpeculativeProgram(prompt_ids, source, rule, tokenizer, acceptance, max_draft_tokens=max_draft_tokens,
                                 budget=budget, pipeline=pipeline, pipeline_note=pipeline_note, on_text=on_text,
                                 grammar=grammar, params=spec.params, on_tokens=on_tokens)
    program.name = spec.name
    refusal = program.pipeline_refusal(engine) if pipeline else None
    if refusal is not None:
        raise ValueError(f"request {spec.id!r} cannot run pipelined (pipeline=True): {refusal}")
    check_positions(engine.model, program.positions(), spec.name, before_run=True)
    pool = engine.pool   # the sequence (prompt, new tokens) and one draft tree
    worst = pool.pages_for(len(prompt_ids) + spec.params.max_tokens) + program.step_pages(pool)
    if worst > pool.num_free_pages:
        raise PoolExhaustedError(f"request {spec.id!r} may need {worst} KV pages, the pool has "
                                 f"{pool.num_free_pages} free; lower max_tokens or max_draft_tokens, or give "
                                 f"the engine more kv_tokens; nothing was run")
    return program


def speculative_results(spec: RequestSpec, prompt_ids: list[int], result) -> list[RequestResult]:
    """A :class:`SpeculativeProgram`'s result ``(checker, stats)`` as the request's one :class:`RequestResult`;
    its ``stats`` also hold ``accepted`` and ``draft_sizes`` (per verification step), ``pipelined`` and
    ``pipeline_note``."""
    checker, stats = result
    seconds = stats.prefill_seconds + sum(stats.draft_seconds) + sum(stats.verify_seconds)
    output = LaneOutput(checker.token_ids, checker.stop_reason, checker.text, checker.stop_string, stats.logprobs)
    [out] = request_results(spec, prompt_ids, [output], stats.steps, seconds, cached_tokens=stats.cached_tokens)
    out.stats.update(accepted=list(stats.accepted), draft_sizes=list(stats.draft_sizes), pipelined=stats.pipelined,
                     pipeline_note=stats.pipeline_note)
    return [out]


def sampled_acceptance(spec: RequestSpec, seed: Callable[[RequestSpec], int]) -> RejectionSampling | None:
    """The acceptance rule of a request decoded speculatively by :class:`~treedec.LLM` and the online engine: greedy
    (None, the default rule) at temperature 0, else lossless rejection sampling at its temperature, top-k, top-p and
    min-p, drawing from ``seed(spec)`` (called only then)."""
    if spec.params.temperature == 0:
        return None
    return RejectionSampling(temperature=spec.params.temperature, top_k=spec.params.top_k, top_p=spec.params.top_p,
                             min_p=spec.params.min_p, seed=seed(spec))
