"""Many generation requests at once: one forest, one engine step per iteration for all of them.

:func:`generate_batch` is the offline batch API (vLLM's ``LLM.generate`` over a list of
requests): each :class:`~treedec.search.requests_file.RequestSpec` is a prompt and its ``n``
outputs, sampled (or greedy at temperature 0) under its own stop rule (EOS ids, stop strings,
``max_new_tokens``: :class:`~treedec.search.stops.StopChecker`). Each request is a
:class:`GenerateProgram` run by the scheduler (:func:`~treedec.search.scheduler.run_programs`):
its prompt is prefilled as a new tree of the engine's forest (past a prefix it shares with
other requests, which is stored once), its ``n`` outputs become children of the prompt's node
(the prompt's K/V is stored once), and every iteration ONE engine step computes the next token
of every live output of every request. A request retires when all its outputs ended, pruning
its tree (pages freed for the next admissions).

Admission and pool pressure are the scheduler's: a request is admitted when its prompt and
the next step of every live request fit; an output that cannot grow waits, and when all wait
the newest request is preempted and run again (:mod:`treedec.search.scheduler`). A request
whose worst case (prompt and ``n`` outputs of ``max_new_tokens``) exceeds the whole pool
raises before anything runs.

Randomness: a request with a ``seed`` draws from its own generator, one uniform number per
output per draw (:func:`~treedec.search.sampling.sample_tokens` by inverse CDF), so its outputs
do not depend on which other requests share its steps, nor on a preemption: batched == alone
(tested). Requests without a seed draw from the batch's ``generator`` as they run.
"""
from __future__ import annotations

import time
from collections.abc import Sized
from typing import Callable, Sequence

import torch

from treedec.engine import Engine
from treedec.models.text import encode_prompt
from treedec.errors import PoolExhaustedError
from treedec.search.requests_file import RequestResult, RequestSpec
from treedec.search.logits import (NonFiniteLogitsError, TokenLogprobs, apply_allowed_tokens, apply_bad_words,
                                   apply_logit_bias, apply_logits_processors, apply_penalties, drawable_rows,
                                   mask_stop_tokens, prompt_logprobs, token_logprobs, token_mask)
from treedec.search.sampling import SamplingParams, sample_tokens
from treedec.search.prefix_cache import PrefixCache
from treedec.search.program import Program, ProgramContext, Read, StepRequest
from treedec.search.request import Positions, check_positions, position_limit
from treedec.search.scheduler import SchedulerStats, run_programs
from treedec.search.stops import StopChecker, StopRule
from treedec.transfer import to_device
from treedec.tree.validate import int_list

__all__ = ["GenerateProgram", "generate_batch", "prepare_requests", "request_results", "step_progress"]


def generate_batch(engine: Engine, requests: Sequence[RequestSpec], tokenizer=None, chat_template: bool = False,
                   generator: torch.Generator | None = None,
                   on_request_done: Callable[[list[RequestResult]], None] | None = None,
                   min_shared_prefix: int | None = None, pipeline: bool | None = None,
                   max_step_tokens: int | None = None,
                   on_text: Callable[[RequestSpec, int, str], None] | None = None,
                   on_step: Callable[[SchedulerStats], None] | None = None,
                   prefix_cache: PrefixCache | None = None) -> tuple[list[RequestResult], SchedulerStats]:
    """Run ``requests`` batched over ``engine``'s forest (see the module docstring).

    Parameters
    ----------
    engine : the engine; its other trees are left alone (their pages are not the batch's).
    requests : the :class:`RequestSpec` of each request (``prompt`` and ``messages`` need a
        ``tokenizer``; ``prompt_ids`` are used as they are).
    tokenizer : the checkpoint's tokenizer (:func:`~treedec.models.text.load_tokenizer`): prompts
        are encoded with it, outputs detokenized (``RequestResult.text``), stop strings matched.
    chat_template : encode ``prompt`` / ``messages`` through the tokenizer's chat template.
    generator : draws of the requests without a ``seed`` (on the engine's device).
    on_request_done : called with a request's results when it retires (e.g. a progress bar).
    min_shared_prefix : the fewest common prompt tokens that requests share as one prefix node
        (default: the pool's page size; 0 turns sharing off; a prefix is whole pages: its length is rounded
        down to a multiple of the page size).
    pipeline : default on for a CUDA engine (off on the CPU, where nothing would overlap): each
        step is launched before the tokens drawn for it are read back (the step reads them on the
        device); an output that those tokens end computed one token more, which is pruned with it.
        The outputs are the same either way (tested); ``stats`` may count steps differently.
    max_step_tokens : prompt tokens (with the decode tokens) a step takes at most: see
        :func:`~treedec.search.scheduler.run_programs` (default ``engine.prefill_chunk``).
    on_text : streaming: called as ``on_text(spec, index, delta)`` with each output's new text as
        its tokens are accepted (needs ``tokenizer``). Text that may be the start of a stop string
        is held back until it is not, so the deltas of an output join to its final ``text``.
    on_step : called with the run's :class:`~treedec.search.scheduler.SchedulerStats` after each engine step
        (progress per step).
    prefix_cache : a prefix cache of ``engine``'s tree kept across calls
        (:func:`~treedec.search.scheduler.run_programs`).

    Returns
    -------
    ``(results, stats)``: every output's :class:`RequestResult`, in request order then output
    index, and the run's :class:`~treedec.search.scheduler.SchedulerStats`. Each result's
    ``stats`` holds the request's ``steps``, ``prompt_tokens`` and ``seconds`` (admission to
    retirement).

    Raises
    ------
    ValueError, TypeError : a bad request or argument (a prompt and ``max_new_tokens`` past the model's
        positions included), before the engine is touched.
    PoolExhaustedError : a request's worst case does not fit the pool's free pages, before
        anything runs.
    """
    if not isinstance(engine, Engine):
        raise TypeError(f"engine must be an Engine, got {type(engine).__name__}")
    if pipeline is not None and not isinstance(pipeline, bool):
        raise ValueError(f"pipeline must be a bool or None (on for a CUDA engine), got {pipeline!r}")
    pipeline = engine.device.type == "cuda" if pipeline is None else pipeline
    if on_text is not None and (tokenizer is None or not callable(on_text)):
        raise ValueError("on_text streams detokenized text: it must be callable and needs the checkpoint's tokenizer")
    prepared = prepare_requests(engine, requests, tokenizer, chat_template)
    programs = [GenerateProgram(spec, ids, tokenizer, generator, pipeline, on_text=on_text) for spec, ids in prepared]
    for program in programs:   # (run_programs checks this too, after the pages below)
        check_positions(engine.model, program.positions(), program.name, before_run=True)
    budget = engine.pool.num_free_pages
    for spec, prompt_ids in prepared:
        n, new = spec.params.n, spec.params.max_tokens
        worst = engine.pool.pages_for(len(prompt_ids)) + n * engine.pool.pages_for(new)
        if worst > budget:
            raise PoolExhaustedError(
                f"request {spec.id!r} may need {worst} KV pages (prompt {len(prompt_ids)} tokens + {n} x {new} new "
                f"tokens), the pool has {budget} free; lower max_tokens or n, or give the engine more kv_tokens; "
                f"nothing was run")
    done = None if on_request_done is None else (lambda index, results: on_request_done(results))
    results, stats = run_programs(engine, programs, min_shared_prefix=min_shared_prefix, on_done=done,
                                  max_step_tokens=max_step_tokens, on_step=on_step, prefix_cache=prefix_cache)
    return [r for request in results for r in request], stats


def step_progress(bar) -> Callable[[SchedulerStats], None]:
    """An ``on_step`` for the batch functions (:func:`generate_batch`, ``speculative_batch``): a requests progress
    bar (tqdm) shows the engine steps run so far too, so a long run moves every step, not only when a request
    finishes."""
    def on_step(stats: SchedulerStats) -> None:
        bar.set_postfix_str(f"step {stats.steps}", refresh=False)
        bar.update(0)   # (redrawn at tqdm's own rate)
    return on_step


def prepare_requests(engine: Engine, requests, tokenizer, chat_template: bool) -> list[tuple[RequestSpec, list[int]]]:
    """Check every request and encode its prompt before anything runs: ``(spec, prompt_ids)`` each. Once all
    are valid, a tokenizer smaller than the model's vocabulary (a padded embedding) restricts the engine to
    it from then on (:meth:`Engine.restrict_vocab`: ids past it could not be decoded); nothing else changes."""
    if isinstance(requests, RequestSpec) or not isinstance(requests, Sequence):
        raise TypeError(f"requests must be a sequence of RequestSpec, got {type(requests).__name__}")
    if not isinstance(chat_template, bool):
        raise TypeError(f"chat_template must be a bool, got {chat_template!r}")
    vocab = engine.model.config.vocab_size
    out, ids = [], set()
    for k, spec in enumerate(requests):
        if not isinstance(spec, RequestSpec):
            raise TypeError(f"requests[{k}] must be a RequestSpec, got {type(spec).__name__}")
        if spec.id in ids:
            raise ValueError(f"requests[{k}]: request id {spec.id!r} is used twice")
        ids.add(spec.id)
        if spec.prompt_ids is not None:
            prompt_ids = list(spec.prompt_ids)
        elif tokenizer is None:
            raise ValueError(f"request {spec.id!r} gives its prompt as text: it needs the checkpoint's tokenizer "
                             f"(or give prompt_ids)")
        else:
            prompt_ids = encode_prompt(tokenizer, spec.prompt if spec.prompt is not None else list(spec.messages),
                                       chat_template or spec.messages is not None)
        prompt_ids = spec.params.truncated(prompt_ids, position_limit(engine.model))
        bad = [t for t in prompt_ids + list(spec.params.stop_token_ids) if t >= vocab]
        if bad:
            raise ValueError(f"request {spec.id!r}: token ids must be in [0, {vocab}), got {bad[:5]}")
        spec.params.check_vocab(vocab, f"request {spec.id!r}")
        if spec.params.stop and tokenizer is None:
            raise ValueError(f"request {spec.id!r} has stop strings {list(spec.params.stop)!r:.60}: they are matched "
                             f"on the output text and need the checkpoint's tokenizer")
        out.append((spec, prompt_ids))
    if isinstance(tokenizer, Sized) and len(tokenizer) < vocab:   # (HF tokenizers have a length; a bare codec may not)
        engine.restrict_vocab(len(tokenizer))   # a padded embedding: ids past the tokenizer are never sampled
    return out


def request_results(spec: RequestSpec, prompt_ids: list[int], checkers: list[StopChecker], steps: int,
                    seconds: float, draws: _Draws | None = None, cached_tokens: int = 0) -> list[RequestResult]:
    """The :class:`RequestResult` of each of a request's outputs (``seconds``: admission to retirement; ``draws``:
    their logprobs, when asked for; ``cached_tokens``: its prompt tokens read from the prefix cache,
    ``stats["cached_tokens"]``); an output a stop string ended has it in ``stats["stop_string"]``."""
    prompt = spec.prompt if spec.prompt is not None else (list(spec.messages) if spec.messages is not None else None)
    stats = {"steps": steps, "prompt_tokens": len(prompt_ids), "cached_tokens": cached_tokens, "seconds": seconds}
    logprobs = [None] * len(checkers) if draws is None else draws.output_logprobs()
    prompt_lp = None if draws is None else draws.prompt
    return [RequestResult(spec.id, i, prompt, list(prompt_ids), c.token_ids, c.text, c.stop_reason,
                          dict(stats) if c.stop_string is None else {**stats, "stop_string": c.stop_string},
                          logprobs=lp, prompt_logprobs=prompt_lp,
                          cumulative_logprob=None if lp is None else sum(
                              entry[t].logprob for entry, t in zip(lp, c.token_ids)))
            for i, (c, lp) in enumerate(zip(checkers, logprobs))]


class GenerateProgram(Program):
    """One request's ``n`` outputs, sampled (greedy at temperature 0) until each one's stop rule ends it.

    Its result is the list of its outputs' :class:`RequestResult` (their ``stats`` also hold the
    request's ``queries_per_step``). ``pipeline``: each step is launched with the drawn tokens
    still on the device (placeholders in the tree), and the host reads them while it runs.

    Parameters
    ----------
    spec, prompt_ids : the request and its encoded prompt.
    tokenizer : detokenizes the outputs (stop strings need it).
    generator : draws of a request without a ``seed``.
    pipeline : see above.
    rule : the outputs' :class:`~treedec.search.stops.StopRule`; default the request's, after the
        model's EOS ids.
    keep : an ended output's node stays in the tree (a child of the prompt's node) with every token
        computed, its last one in the step after it ended; the result's ``stats["nodes"]`` lists
        them and ``stats["root"]`` is the prompt's node, which the caller prunes. Else ended
        outputs are pruned at once and the request's tree when it returns.
    on_prompt : the one output (``spec.params.n`` must be 1) grows on the prompt's node itself, which stays in
        the tree when the program returns (``stats["root"]``, also ``stats["nodes"][0]``; the caller
        prunes it) holding the prompt and every output token but the last, as a speculative request's
        node does (:func:`~treedec.search.generate.greedy_generate`); with ``keep`` the last one too.
        A token computed past the end (pipelined) is truncated away.
    on_text : streaming, as :func:`generate_batch`'s.
    """

    def __init__(self, spec: RequestSpec, prompt_ids: list[int], tokenizer=None,
                 generator: torch.Generator | None = None, pipeline: bool = False, rule: StopRule | None = None,
                 keep: bool = False, on_text: Callable[[RequestSpec, int, str], None] | None = None,
                 on_prompt: bool = False):
        if on_prompt and spec.params.n != 1:
            raise ValueError(f"on_prompt grows the one output on the prompt's node: the request must have n=1, "
                             f"got n={spec.params.n}")
        self.spec, self.prompt_ids, self.tokenizer = spec, list(prompt_ids), tokenizer
        self.params = spec.params
        self.generator, self.pipeline, self.rule, self.keep = generator, pipeline, rule, keep
        self.on_text, self.on_prompt = on_text, on_prompt
        self.name = spec.name
        # prompt_logprobs read every prompt token's hidden state: a prefix shared with other requests has none here
        self.shares_prompt = spec.params.prompt_logprobs is None
        self.bad_words = spec.params.bad_words_token_ids(tokenizer)   # (tokenized once, here: not in the steps)

    def positions(self) -> Positions:
        m = self.spec.params.max_tokens
        return Positions(len(self.prompt_ids) + m, f"a {len(self.prompt_ids)}-token prompt + max_tokens {m}")

    def step_pages(self, pool) -> int:
        return self.spec.params.n   # each output may start a page

    def run(self, ctx: ProgramContext):
        engine, spec, n = ctx.engine, self.spec, self.spec.params.n
        started = time.perf_counter()
        generator = self.generator
        if spec.params.seed is not None and spec.params.temperature > 0:   # (made here: a re-run draws the same)
            generator = torch.Generator(engine.device).manual_seed(spec.params.seed)
        rule = self.rule if self.rule is not None else spec.params.stop_rule(engine.model.eos_token_ids)
        checkers = [StopChecker(rule, spec.params.detokenizer(self.tokenizer, self.prompt_ids)) for _ in range(n)]
        stream = None if self.on_text is None else (lambda i, delta: self.on_text(spec, i, delta))
        state = _Outputs(engine.tree, checkers, self.keep, stream, ctx.offer)
        queries: list[int] = []
        done = False
        try:
            wants_prompt = spec.params.prompt_logprobs is not None
            state.root, out = yield from ctx.prompt(self.prompt_ids, hidden=wants_prompt, all_rows=wants_prompt)
            draws = _Draws(self.params, self.prompt_ids, checkers, out.logits, engine.model.eos_token_ids,
                           self.bad_words)
            if wants_prompt:
                draws.prompt_logprobs(engine.model, out.hidden, out.logits.shape[-1])
            if self.on_prompt:
                state.grow_on_root()
            logits, argmax, rows = out.logits.expand(n, -1), None, list(range(n))
            drawn = draws.draw(logits, argmax, rows, generator)
            while True:
                if self.pipeline:   # placeholders for the drawn tokens; the step reads the ids on the device
                    going = [k for k, i in enumerate(rows) if len(checkers[i].token_ids) + 1 < spec.params.max_tokens]
                    placed = list(range(len(rows))) if self.keep else going   # kept: every token is computed
                    yield from ctx.reserve(state.pages([rows[k] for k in placed]))
                    state.place({rows[k]: 0 for k in placed})
                    ids = None
                    if placed:
                        ids = drawn if len(placed) == len(rows) else drawn[to_device(placed, drawn.device)]
                    out = yield StepRequest([state.nodes[rows[k]] for k in going],
                                            argmax=not self.params.reads_logits, tokens=ids,
                                            placed=[state.nodes[rows[k]] for k in placed], read=draws.report(drawn))
                    stepped = [rows[k] for k in going]
                    state.accept(rows, draws.checked(out.read, rows, self.name), placed=True)
                    if placed:
                        queries.append(ctx.step_queries)
                    if not any(not c.stopped for c in checkers):
                        break
                else:
                    ended = state.accept(rows, draws.checked((yield Read(draws.report(drawn))), rows, self.name),
                                         placed=False)
                    live = [i for i in range(n) if not checkers[i].stopped]
                    grow = {i: checkers[i].token_ids[-1] for i in live + (ended if self.keep else [])}
                    if not grow:
                        break
                    yield from ctx.reserve(state.pages(list(grow)))
                    state.place(grow)
                    out = yield StepRequest([state.nodes[i] for i in live], argmax=not self.params.reads_logits)
                    queries.append(ctx.step_queries)
                    if not live:
                        break
                    stepped = live
                keep = [k for k, i in enumerate(stepped) if not checkers[i].stopped]
                rows = [stepped[k] for k in keep]
                logits, argmax = out.logits, out.argmax
                if len(keep) < len(stepped):   # (most steps keep every row: no indexing kernels then)
                    index = to_device(keep, logits.device)
                    argmax = None if argmax is None else argmax[index]
                    logits = logits if argmax is not None else logits[index]   # greedy reads the argmax only
                drawn = draws.draw(logits, argmax, rows, generator)
            results = request_results(spec, self.prompt_ids, checkers, len(queries), time.perf_counter() - started,
                                      draws, ctx.cached_tokens)
            for r in results:
                r.stats["queries_per_step"] = list(queries)
                if self.keep or self.on_prompt:
                    r.stats.update(root=state.root, nodes=list(state.nodes))
            done = True
            return results
        finally:
            if not (done and (self.keep or self.on_prompt)):
                ctx.free(state.root)


class _Draws:
    """How a request's next tokens are picked from a step's logits rows, and what it reports of them: the
    processing :class:`~treedec.search.sampling.SamplingParams` documents, in its order (the user's logits
    processors, ``allowed_token_ids``, ``bad_words``, ``min_tokens``, ``logit_bias``, the penalties with each
    output's token counts kept on the device; one function each in :mod:`treedec.search.logits`), then the draw
    (:func:`~treedec.search.sampling.sample_tokens`: the warpers, or the argmax at temperature 0); the chosen
    tokens' log-probabilities under the raw logits when ``logprobs`` is asked for (kept on the device until
    :meth:`output_logprobs`). Where the logits were processed, a row left with nothing to draw from is flagged
    on the device and read with the drawn tokens (:meth:`report`, :meth:`checked`): that request fails alone,
    without a wait of its own.

    ``eos_token_ids``: the ids ``min_tokens`` keeps from being drawn with ``stop_token_ids`` (the checkpoint's,
    as vLLM's, ``ignore_eos`` or not); ``bad_words``: the request's bad words as token sequences
    (:meth:`~treedec.search.sampling.SamplingParams.bad_words_token_ids`). Every id is checked against the
    vocabulary here, on the host (a device index past it would fault)."""

    def __init__(self, params: SamplingParams, prompt_ids: list[int], checkers: list[StopChecker],
                 logits: torch.Tensor, eos_token_ids: Sequence[int] = (),
                 bad_words: Sequence[Sequence[int]] = ()):
        self.params, self.prompt_ids, self.checkers = params, prompt_ids, checkers
        vocab, device = logits.shape[-1], logits.device
        self.penalized = params.repetition_penalty != 1 or params.presence_penalty != 0 \
            or params.frequency_penalty != 0
        self.prompt_mask = token_mask(prompt_ids, vocab, device, "prompt_ids") if self.penalized else None
        self.counts = torch.zeros(len(checkers), vocab, dtype=torch.int32, device=device) if self.penalized \
            else None
        self.allowed = None if params.allowed_token_ids is None else \
            token_mask(params.allowed_token_ids, vocab, device, "allowed_token_ids")
        self.bad_words = [list(word) for word in bad_words]
        for word in self.bad_words:
            int_list(word, "bad_words' token ids", low=0, high=vocab - 1)
        self.bad_context = max(map(len, self.bad_words), default=1) - 1   # output tokens a ban looks back at
        stops = {*eos_token_ids, *params.stop_token_ids, *(t for c in checkers[:1] for t in c.rule.eos_token_ids)}
        self.stop_ids = to_device(int_list(sorted(stops), "min_tokens' stop ids", low=0, high=vocab - 1), device,
                                  torch.int64) if params.min_tokens and stops else None
        self.bias = None
        if params.logit_bias is not None:
            ids = int_list(list(params.logit_bias), "logit_bias' token ids", low=0, high=vocab - 1)
            self.bias = (to_device(ids, device, torch.int64),
                         to_device(list(params.logit_bias.values()), device, torch.float32))
        self.records: list[tuple[list[int], TokenLogprobs]] = []   # (rows, their logprobs) per draw
        self.prompt: list[dict | None] | None = None
        self.drawable: torch.Tensor | None = None   # the last draw's rows: could each be drawn from

    def draw(self, logits: torch.Tensor, argmax: torch.Tensor | None, rows: list[int],
             generator: torch.Generator | None) -> torch.Tensor:
        """The next token (on the device) of each output in ``rows``, from its row of ``logits``; the step's
        ``argmax`` when the scheduler picked it already (plain greedy: nothing reads the logits)."""
        self.drawable = None
        if argmax is not None:
            return argmax
        params, scores, checkers = self.params, logits, self.checkers
        if params.logits_processors:
            scores = apply_logits_processors(params.logits_processors,
                                             [self.prompt_ids + checkers[i].token_ids for i in rows], scores)
        if self.allowed is not None:
            scores = apply_allowed_tokens(scores, self.allowed)
        if self.bad_words:
            scores = apply_bad_words(scores, self.bad_words, [checkers[i].last_tokens(self.bad_context) for i in rows])
        if self.stop_ids is not None:
            short = [k for k, i in enumerate(rows) if checkers[i].num_tokens < params.min_tokens]
            if short:
                scores = mask_stop_tokens(scores, self.stop_ids,
                                          None if len(short) == len(rows) else to_device(short, scores.device))
        if self.bias is not None:
            scores = apply_logit_bias(scores, *self.bias)
        index = to_device(rows, logits.device) if self.penalized else None
        if self.penalized:
            scores = apply_penalties(scores, self.prompt_mask, self.counts[index], params.repetition_penalty,
                                     params.presence_penalty, params.frequency_penalty)
        if params.processes_logits:
            self.drawable = drawable_rows(scores)
        uniform = None
        if params.temperature > 0:
            # One number per output per draw, whichever outputs are live: a request's stream does not
            # depend on when its outputs end, nor on the other requests.
            numbers = torch.rand(params.n, generator=generator, device=logits.device)
            uniform = numbers[to_device(rows, numbers.device)]
        drawn = sample_tokens(scores, params, uniform=uniform)
        if self.penalized:
            self.counts.index_put_((index, drawn), torch.ones_like(drawn, dtype=self.counts.dtype), accumulate=True)
        if params.logprobs is not None:
            self.records.append((list(rows), token_logprobs(logits, drawn, params.logprobs)))
        return drawn

    def report(self, drawn: torch.Tensor) -> torch.Tensor:
        """What the host reads of the last draw: ``drawn``, with -1 at a row that had nothing to draw from (its
        token, a clamped stand-in, is still valid for the device's next step)."""
        return drawn if self.drawable is None else torch.where(self.drawable, drawn, torch.full_like(drawn, -1))

    def checked(self, values: list[int], rows: list[int], name: str) -> list[int]:
        """``values`` read back from :meth:`report` for ``rows``; raises NonFiniteLogitsError naming the request
        ``name`` and the outputs whose row had nothing to draw from."""
        bad = [i for i, v in zip(rows, values) if v < 0]
        if bad:
            raise NonFiniteLogitsError(
                f"{name}: after its logits processing (processors, penalties, logit_bias, allowed_token_ids, "
                f"bad_words, min_tokens) the logits of output(s) {bad[:5]} have no finite value (or a NaN or +inf): "
                f"there is nothing to draw from; the request is stopped")
        return values

    def prompt_logprobs(self, model, hidden: torch.Tensor, vocab: int) -> None:
        """The prompt's log-probabilities (vLLM's ``prompt_logprobs``: None for its first token) from every
        prompt token's final hidden state (``hidden`` [L, hidden_size]), through the model's LM head."""
        logits = model.lm_head(hidden[:-1])[:, :vocab].float()
        self.prompt = [None] + prompt_logprobs(logits, self.prompt_ids, self.params.prompt_logprobs).to_dicts()

    def output_logprobs(self) -> list[list[dict] | None]:
        """Each output's logprobs, one dict per token (token id -> :class:`~treedec.search.logits.Logprob`: the
        chosen token and the ``logprobs`` most likely), or None when not asked for."""
        if self.params.logprobs is None:
            return [None] * len(self.checkers)
        outputs: list[list[dict]] = [[] for _ in self.checkers]
        for rows, record in self.records:
            for i, entry in zip(rows, record.to_dicts()):
                outputs[i].append(entry)
        return [out[:len(c.token_ids)] for out, c in zip(outputs, self.checkers)]   # (pipelined: one drawn past)


class _Outputs:
    """A request's outputs on the tree: each one's node (a child of the prompt's, from its first token; or
    the prompt's own, :meth:`grow_on_root`) and where its tokens start in that node. ``offer``: an ended
    output's sequence but its last token (whose K/V is not computed or not kept) goes to it before its node is
    pruned (:meth:`ProgramContext.offer`)."""

    def __init__(self, tree, checkers: list[StopChecker], keep: bool, stream=None, offer=None):
        self.tree, self.checkers, self.keep, self.stream, self.offer = tree, checkers, keep, stream, offer
        self.root: int | None = None
        self.nodes: list[int | None] = [None] * len(checkers)
        self.starts = [0] * len(checkers)  # each output's first token's index in its node
        self.shown = [0] * len(checkers)   # characters of each output's text streamed so far

    def grow_on_root(self) -> None:
        """The one output grows on the prompt's node, after the prompt: it stays when the output ends."""
        self.nodes[0], self.starts[0] = self.root, self.tree.node_length(self.root)

    def pages(self, outputs: list[int]) -> int:
        """Pages that appending a token to each of ``outputs`` may take."""
        return sum(1 if self.nodes[i] is None else self.tree.pages_to_extend(self.nodes[i], 1) for i in outputs)

    def place(self, tokens: dict[int, int]) -> None:
        """Append each output's token: its node's next, or a new child of the prompt's node."""
        grow = {self.nodes[i]: [t] for i, t in tokens.items() if self.nodes[i] is not None}
        if grow:
            self.tree.extend_many(grow)
        fresh = [i for i in tokens if self.nodes[i] is None]
        if fresh:
            for i, node in zip(fresh, self.tree.branch(self.root, [[tokens[i]] for i in fresh])):
                self.nodes[i] = node

    def accept(self, rows: list[int], tokens: list[int], placed: bool) -> list[int]:
        """Give each drawn token to its output's stop rule; returns the outputs that ended. ``placed``: the
        tokens are in the tree as placeholders (their real ids are set; an output that ended is pruned
        with its placeholder unless kept). Unplaced, an ended output is pruned unless kept. An output on
        the prompt's node is never pruned: its ended token's placeholder is truncated away unless kept."""
        ended = []
        for i, token in zip(rows, tokens):
            checker, node = self.checkers[i], self.nodes[i]
            stopped = checker.accept(token).reason is not None
            if stopped:
                ended.append(i)
            at = self.starts[i] + len(checker.token_ids) - 1
            if stopped and not self.keep:
                if self.offer is not None and node is not None:   # the conversation, to its last token
                    self.offer(node, self.tree.sequence_length(node) - self.tree.node_length(node) + at)
                if node == self.root:   # (on the prompt's node) the last token, if placed, is dropped
                    if self.tree.node_length(node) > at:
                        self.tree.truncate(node, at)
                elif node is not None:
                    self.tree.prune(node)
                    self.nodes[i] = None
            elif placed:
                self.tree.set_tokens(node, at, [token])
            if self.stream is not None:
                end = checker.streamable_length
                if end > self.shown[i]:   # (only the new characters are joined: no copy of the whole text)
                    self.stream(i, checker.text_from(self.shown[i]))
                    self.shown[i] = end
        return ended

