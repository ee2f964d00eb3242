"""Speculative decoding of many requests at once: every request's draft tree in ONE step.

:func:`speculative_batch` is :func:`~treedec.search.batch.generate_batch` for speculative
decoding: each request is a :class:`~treedec.search.speculative.program.SpeculativeProgram` run by the
scheduler (:mod:`treedec.search.scheduler`): every iteration each live request's draft source
proposes a token tree after its sequence, all the trees are verified in one engine step (one
plan over the forest, one forward), and each request keeps its accepted path (its K/V moved
onto the sequence, the rest freed) and the bonus token, under its own stop rule (EOS ids, stop
strings, ``max_new_tokens``: an EOS or a stop string inside an accepted path cuts it there).

Any draft source batches: n-gram lookup, fixed trees, Medusa heads (their row head runs inside
the shared step for every request's rows; the requests' drafts must share one heads module),
drafts that read the target's hidden states, EAGLE drafters and draft models (greedy drafts on one
drafter engine draft together: one drafter step per tree layer for all the pass's requests,
:mod:`treedec.search.speculative.drafter_batch`). Acceptance is greedy by default (then every request's
tokens are exactly those of plain greedy decoding of its prompt, whatever the draft: tested);
``acceptance`` gives a sampled rule.
"""
from __future__ import annotations

from typing import Callable, Sequence

from treedec.checks import positive_int
from treedec.engine import Engine
from treedec.errors import PoolExhaustedError
from treedec.search.speculative.acceptance import AcceptanceRule
from treedec.search.batch import prepare_requests, request_results
from treedec.search.speculative.draft_budget import DraftBudget
from treedec.search.speculative.drafts import DraftSource, check_draft_source
from treedec.search.request import check_positions
from treedec.search.requests_file import RequestResult, RequestSpec
from treedec.search.scheduler import SchedulerStats, run_programs
from treedec.search.speculative.program import SpeculativeProgram

#: The :class:`~treedec.search.sampling.SamplingParams` fields speculative decoding implements (the others, e.g.
#: penalties, min_p, logprobs, are refused before anything runs rather than ignored); temperature, top_k and top_p
#: are the acceptance rule's.
SPECULATIVE_PARAMS = frozenset({"n", "temperature", "top_k", "top_p", "seed", "stop", "stop_token_ids", "ignore_eos",
                                "max_tokens", "include_stop_str_in_output"})

__all__ = ["PIPELINE_MAX_REQUESTS", "speculative_batch"]

#: The largest batch :func:`speculative_batch` pipelines by itself (``pipeline=None``); see its ``pipeline``.
PIPELINE_MAX_REQUESTS = 16


def speculative_batch(engine: Engine, requests: Sequence[RequestSpec], draft: Callable[[RequestSpec], DraftSource],
                      tokenizer=None, chat_template: bool = False, max_draft_tokens: int = 64,
                      acceptance: Callable[[RequestSpec], AcceptanceRule] | None = None,
                      on_request_done: Callable[[list[RequestResult]], None] | None = None,
                      max_step_tokens: int | None = None, draft_budget: DraftBudget | None = None,
                      pipeline: bool | None = None, on_step: Callable[[SchedulerStats], None] | None = None
                      ) -> tuple[list[RequestResult], SchedulerStats]:
    """Speculative decoding of ``requests`` batched over ``engine``'s forest.

    Parameters
    ----------
    requests : :class:`RequestSpec` with ``n=1``; ``temperature=0`` unless ``acceptance`` is given.
    draft : makes each request's draft source, e.g. ``lambda spec: PromptLookupDraft()``.
    tokenizer, chat_template, on_request_done, on_step : as :func:`~treedec.search.batch.generate_batch`.
    max_draft_tokens : the largest tree a draft may propose (its root included): the scheduler
        keeps its pages free for each live request's next step.
    acceptance : makes each request's acceptance rule (default greedy), e.g.
        ``lambda spec: RejectionSampling(spec.params.temperature, seed=spec.params.seed)``.
    max_step_tokens : as :func:`~treedec.search.batch.generate_batch`.
    draft_budget : how many draft tokens each request verifies a step (:mod:`treedec.search.speculative.draft_budget`):
        default ``DraftBudget()`` (automatic: 256 draft tokens a step for the batch on a GPU, shared by
        measured acceptance; no limit on the CPU). Each step's decision is in ``draft_budget.history`` and
        each request's verified tree sizes in its result's ``stats["draft_sizes"]``.
    pipeline : each request's steps pipelined (:mod:`treedec.search.speculative.pipeline`: drafts with a fixed
        tree drafted on the device, greedy or rejection sampling; True raises where they do not); None (the
        default): where they allow it on a GPU, for batches of at most :data:`PIPELINE_MAX_REQUESTS` requests;
        False: never. Each result's ``stats["pipelined"]`` says which ran and ``stats["pipeline_note"]`` why
        not. A pipelined step's host work for a request (acceptance, the K/V move, the next tree: ~25 small
        device operations launched one request at a time, ~1.3 ms) overlaps the device's step, so it pays
        while the batch is small: measured on an H200 (2026-11-27, Medusa-64 trees over 4000-token prompts,
        ``bench/batch.py``, one machine) pipelined against not: 1 request 8.4 / 9.2 ms a step, 8 requests
        23.1 / 26.2, 16 requests 25.4-27.6 / 27.6-31.3, 32 requests 48-73 / 32-38.

    Returns
    -------
    ``(results, stats)`` as :func:`~treedec.search.batch.generate_batch`; each result's ``stats``
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
    note = None
    if pipeline is None and len(prepared) > PIPELINE_MAX_REQUESTS:
        pipeline, note = False, (f"a batch of {len(prepared)} requests (more than PIPELINE_MAX_REQUESTS = "
                                 f"{PIPELINE_MAX_REQUESTS}): pipelined steps' per-request host work outgrows the step")
    pool = engine.pool
    programs, heads = [], {}
    for spec, prompt_ids in prepared:
        if spec.params.n != 1 or (acceptance is None and spec.params.temperature != 0):
            raise ValueError(f"request {spec.id!r}: speculative_batch gives one output a request, accepted greedily "
                             f"unless an acceptance rule is given: it needs temperature=0 and n=1, got "
                             f"temperature={spec.params.temperature}, n={spec.params.n}")
        spec.params.check_supported(SPECULATIVE_PARAMS, "speculative decoding", f"request {spec.id!r}")
        source = draft(spec)
        check_draft_source(source, f"request {spec.id!r}: draft(spec)")
        head = source.row_head
        if head is not None:
            heads.setdefault(head, spec.id)
            if len(heads) > 1:
                raise ValueError(f"requests {list(heads.values())[0]!r} and {spec.id!r} have drafts with different row "
                                 f"heads (e.g. Medusa heads of other weights or tree depths); a batch's drafts share "
                                 f"the engine's one row head")
        rule = spec.params.stop_rule(engine.model.eos_token_ids)
        programs.append(SpeculativeProgram(prompt_ids, source, rule, tokenizer,
                                           None if acceptance is None else acceptance(spec),
                                           max_draft_tokens=max_draft_tokens, budget=draft_budget, pipeline=pipeline,
                                           pipeline_note=note))
        programs[-1].name = spec.name
        check_positions(engine.model, programs[-1].positions(), spec.name, before_run=True)
        # The sequence (prompt, new tokens) and one draft tree.
        worst = pool.pages_for(len(prompt_ids) + spec.params.max_tokens) + programs[-1].step_pages(pool)
        if worst > pool.num_free_pages:
            raise PoolExhaustedError(f"request {spec.id!r} may need {worst} KV pages, the pool has "
                                     f"{pool.num_free_pages} free; lower max_tokens or max_draft_tokens, or give "
                                     f"the engine more kv_tokens; nothing was run")
    outputs: dict[int, list[RequestResult]] = {}

    def done(index: int, result) -> None:
        checker, stats = result
        spec, prompt_ids = prepared[index]
        seconds = stats.prefill_seconds + sum(stats.draft_seconds) + sum(stats.verify_seconds)
        outputs[index] = request_results(spec, prompt_ids, [checker], stats.steps, seconds)
        outputs[index][0].stats["accepted"] = list(stats.accepted)
        outputs[index][0].stats["draft_sizes"] = list(stats.draft_sizes)
        outputs[index][0].stats["pipelined"] = stats.pipelined
        outputs[index][0].stats["pipeline_note"] = stats.pipeline_note
        if on_request_done is not None:
            on_request_done(outputs[index])

    _, stats = run_programs(engine, programs, on_done=done, max_step_tokens=max_step_tokens, on_step=on_step)
    return [r for index in sorted(outputs) for r in outputs[index]], stats
