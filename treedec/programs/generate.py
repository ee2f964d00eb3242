"""Many generation requests at once: one forest, one engine step per iteration for all of them.

:func:`generate_batch` is the offline batch API (vLLM's ``LLM.generate`` over a list of
requests): each :class:`~treedec.commands.requests_file.RequestSpec` is a prompt and its ``n``
outputs, sampled (or greedy at temperature 0) under its own stop rule (EOS ids, stop strings,
``max_new_tokens``: :class:`~treedec.sampling.stops.StopChecker`). Each request is a
:class:`GenerateProgram` run by the scheduler (:func:`~treedec.runtime.scheduler.run_programs`):
its prompt is prefilled as a new tree of the engine's forest (past a prefix it shares with
other requests, which is stored once), its ``n`` outputs become children of the prompt's node
(the prompt's K/V is stored once), and every iteration ONE engine step computes the next token
of every live output of every request. A request retires when all its outputs ended, pruning
its tree (pages freed for the next admissions).

Admission and pool pressure are the scheduler's: a request is admitted when its prompt and
the next step of every live request fit; an output that cannot grow waits, and when all wait
the newest request is preempted and run again (:mod:`treedec.runtime.scheduler`). A request
whose worst case (prompt and ``n`` outputs of ``max_new_tokens``) exceeds what the pool can give it (its
free pages, and those the prefix cache can evict) raises before anything runs.

Every output is a lane of the scheduler's batch (:mod:`treedec.runtime.lanes`): all lanes of all requests are
drawn by one batched sampler call a step. Randomness: each draw's number is a hash of the request's ``seed``, the
output's index and the draw's index (:func:`~treedec.sampling.rng.counter_uniform`, inverse CDF), so a seeded
request's outputs do not depend on which other requests share its steps, nor on a preemption: batched == alone
(tested). Requests without a seed get one derived from the run's ``generator`` (or torch's global generator).
"""
from __future__ import annotations

import time
from collections.abc import Sized
from typing import Callable, Sequence

import torch

from treedec.engine import Engine
from treedec.models.text import encode_prompt
from treedec.errors import PoolExhaustedError
from treedec.runtime.requests import RequestResult, RequestSpec
from treedec.runtime.decode import Decode, LaneOutput, OutputTokens
from treedec.sampling.logits import prompt_logprobs
from treedec.runtime.prefix_cache import PrefixCache
from treedec.sampling.grammar import Grammar, GrammarCompiler
from treedec.sampling.params import SEED_MAX, SamplingParams
from treedec.runtime.program import Program, ProgramContext
from treedec.runtime.request import Positions, check_positions, position_limit
from treedec.runtime.scheduler import SchedulerStats, run_programs
from treedec.sampling.stops import StopChecker, StopRule

__all__ = ["GenerateProgram", "check_requests", "generate_batch", "grammar_compiler", "prepare_requests",
           "request_grammar", "request_results", "step_progress", "worst_case_pages"]


def generate_batch(engine: Engine, requests: Sequence[RequestSpec], tokenizer=None, chat_template: bool = False,
                   generator: torch.Generator | None = None,
                   on_request_done: Callable[[list[RequestResult]], None] | None = None,
                   min_shared_prefix: int | None = None, pipeline: bool | None = None,
                   max_step_tokens: int | None = None,
                   on_text: Callable[[RequestSpec, int, str], None] | None = None,
                   on_step: Callable[[SchedulerStats], None] | None = None,
                   prefix_cache: PrefixCache | None = None, grammars: GrammarCompiler | None = None
                   ) -> tuple[list[RequestResult], SchedulerStats]:
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
        :func:`~treedec.runtime.scheduler.run_programs` (default ``engine.prefill_chunk``).
    on_text : streaming: called as ``on_text(spec, index, delta)`` with each output's new text as
        its tokens are accepted (needs ``tokenizer``). Text that may be the start of a stop string
        is held back until it is not, so the deltas of an output join to its final ``text``.
    on_step : called with the run's :class:`~treedec.runtime.scheduler.SchedulerStats` after each engine step
        (progress per step).
    prefix_cache : a prefix cache of ``engine``'s tree kept across calls
        (:func:`~treedec.runtime.scheduler.run_programs`).
    grammars : compiles the requests' ``structured_outputs`` (cached across calls: an :class:`~treedec.LLM`'s);
        default one made for this call from ``tokenizer`` when a request has them (:func:`grammar_compiler`).

    Returns
    -------
    ``(results, stats)``: every output's :class:`RequestResult`, in request order then output
    index, and the run's :class:`~treedec.runtime.scheduler.SchedulerStats`. Each result's
    ``stats`` holds the request's ``steps``, ``prompt_tokens`` and ``seconds`` (admission to
    retirement).

    Raises
    ------
    ValueError, TypeError : a bad request or argument (a prompt and ``max_new_tokens`` past the model's
        positions included), before the engine is touched.
    PoolExhaustedError : a request's worst case (:func:`worst_case_pages`) does not fit the pool's free pages and
        those ``prefix_cache`` can evict, before anything runs.
    """
    if not isinstance(engine, Engine):
        raise TypeError(f"engine must be an Engine, got {type(engine).__name__}")
    if pipeline is not None and not isinstance(pipeline, bool):
        raise ValueError(f"pipeline must be a bool or None (on for a CUDA engine), got {pipeline!r}")
    pipeline = engine.device.type == "cuda" if pipeline is None else pipeline
    if on_text is not None and (tokenizer is None or not callable(on_text)):
        raise ValueError("on_text streams detokenized text: it must be callable and needs the checkpoint's tokenizer")
    prepared = prepare_requests(engine, requests, tokenizer, chat_template)
    on_output = None if on_text is None else (lambda spec, i, delta, checker: delta and on_text(spec, i, delta))
    if grammars is None and any(spec.params.structured_outputs is not None for spec, _ in prepared):
        grammars = grammar_compiler(engine, tokenizer)
    programs = [GenerateProgram(spec, ids, tokenizer, on_output=on_output, grammar=request_grammar(grammars, spec))
                for spec, ids in prepared]
    for program in programs:   # (run_programs checks this too, after the pages below)
        check_positions(engine.model, program.positions(), program.name, before_run=True)
    free = engine.pool.num_free_pages   # and what the cache gives back when the scheduler needs its pages
    evictable = 0 if prefix_cache is None else prefix_cache.evictable_pages()
    for spec, prompt_ids in prepared:
        worst = worst_case_pages(engine.pool, spec.params, len(prompt_ids))
        if worst > free + evictable:
            cached = f" + {evictable} the prefix cache can give back" if prefix_cache is not None else ""
            raise PoolExhaustedError(
                f"request {spec.id!r} may need {worst} KV pages (prompt {len(prompt_ids)} tokens + {spec.params.n} x "
                f"{spec.params.max_tokens} new tokens), the pool has {free} free{cached}; lower max_tokens or n, or "
                f"give the engine more kv_tokens; nothing was run")
    done = None if on_request_done is None else (lambda index, results: on_request_done(results))
    results, stats = run_programs(engine, programs, min_shared_prefix=min_shared_prefix, on_done=done,
                                  max_step_tokens=max_step_tokens, on_step=on_step, prefix_cache=prefix_cache,
                                  pipeline=pipeline, seed=unseeded_seed(generator))
    return [r for request in results for r in request], stats


def grammar_compiler(engine: Engine, tokenizer) -> GrammarCompiler:
    """The :class:`~treedec.sampling.grammar.GrammarCompiler` of ``engine``'s model and ``tokenizer`` (its vocabulary
    the model's logits' width; a grammar's output ends at the checkpoint's EOS ids)."""
    if tokenizer is None:
        raise ValueError("structured_outputs are matched on tokens' text: they need the checkpoint's tokenizer")
    return GrammarCompiler(tokenizer, engine.model.config.vocab_size, tuple(engine.model.eos_token_ids))


def request_grammar(grammars: GrammarCompiler | None, spec: RequestSpec) -> Grammar | None:
    """``spec``'s ``structured_outputs`` compiled by ``grammars`` (cached), or None without them. Raises
    :class:`~treedec.sampling.grammar.GrammarError` (a ValueError) for a constraint that cannot be compiled."""
    so = spec.params.structured_outputs
    if so is None:
        return None
    if grammars is None:
        raise ValueError(f"{spec.name} has structured_outputs: it needs a GrammarCompiler (the tokenizer's)")
    return grammars.compile(so)


def unseeded_seed(generator: torch.Generator | None) -> int:
    """The seed the draws of a run's requests without a seed derive from: drawn from ``generator``, else from
    torch's global generator (so ``torch.manual_seed`` makes a run repeatable)."""
    device = "cpu" if generator is None else generator.device
    return int(torch.randint(0, SEED_MAX, (1,), generator=generator, device=device).item())


def step_progress(bar) -> Callable[[SchedulerStats], None]:
    """An ``on_step`` for the batch functions (:func:`generate_batch`, ``speculative_batch``): a requests progress
    bar (tqdm) shows the engine steps run so far too, so a long run moves every step, not only when a request
    finishes."""
    def on_step(stats: SchedulerStats) -> None:
        bar.set_postfix_str(f"step {stats.steps}", refresh=False)
        bar.update(0)   # (redrawn at tqdm's own rate)
    return on_step


def worst_case_pages(pool, params: SamplingParams, prompt_tokens: int) -> int:
    """The most KV pages a :class:`GenerateProgram` may hold at once: its prompt's, and each of its ``n`` outputs'
    ``max_tokens`` (an output's node starts on a page of its own), none of them shared."""
    return pool.pages_for(prompt_tokens) + params.n * pool.pages_for(params.max_tokens)


def prepare_requests(engine: Engine, requests, tokenizer, chat_template: bool) -> list[tuple[RequestSpec, list[int]]]:
    """Check every request and encode its prompt before anything runs (:func:`check_requests` for ``engine``'s
    model): ``(spec, prompt_ids)`` each. Once all are valid, a tokenizer smaller than the model's vocabulary (a padded
    embedding) restricts the engine to it from then on (:meth:`Engine.restrict_vocab`: ids past it could not be
    decoded); nothing else changes."""
    vocab = engine.model.config.vocab_size
    out = check_requests(requests, tokenizer, chat_template, vocab, position_limit(engine.model))
    if isinstance(tokenizer, Sized) and len(tokenizer) < vocab:   # (HF tokenizers have a length; a bare codec may not)
        engine.restrict_vocab(len(tokenizer))   # a padded embedding: ids past the tokenizer are never sampled
    return out


def check_requests(requests, tokenizer, chat_template: bool, vocab_size: int, positions: int
                   ) -> list[tuple[RequestSpec, list[int]]]:
    """Check every request and encode its prompt, for a model of ``vocab_size`` token ids and ``positions`` positions
    (:func:`~treedec.runtime.request.position_limit`: ``truncate_prompt_tokens=-1`` keeps that many): ``(spec,
    prompt_ids)`` each, the ids truncated. Raises ValueError or TypeError naming the request and the field; touches
    no engine (an :class:`~treedec.LLM` whose engine is in an engine core's process checks its requests with it)."""
    if isinstance(requests, RequestSpec) or not isinstance(requests, Sequence):
        raise TypeError(f"requests must be a sequence of RequestSpec, got {type(requests).__name__}")
    if not isinstance(chat_template, bool):
        raise TypeError(f"chat_template must be a bool, got {chat_template!r}")
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
        prompt_ids = spec.params.truncated(prompt_ids, positions)
        for field, given in (("prompt_ids", prompt_ids), ("stop_token_ids", spec.params.stop_token_ids)):
            bad = [t for t in given if t >= vocab_size]
            if bad:   # (the message starts with the field: a server names it as the error's param)
                raise ValueError(f"{field} of request {spec.id!r}: token id {bad[0]} is out of vocabulary (the "
                                 f"model's vocabulary has {vocab_size} tokens: ids must be in [0, {vocab_size})), got "
                                 f"{bad[:5]}")
        spec.params.check_vocab(vocab_size, f"request {spec.id!r}")
        if spec.params.structured_outputs is not None and tokenizer is None:
            raise ValueError(f"request {spec.id!r} has structured_outputs: they are matched on the tokens' text and "
                             f"need the checkpoint's tokenizer")
        if spec.params.stop and tokenizer is None:
            raise ValueError(f"request {spec.id!r} has stop strings {list(spec.params.stop)!r:.60}: they are matched "
                             f"on the output text and need the checkpoint's tokenizer")
        out.append((spec, prompt_ids))
    return out


def request_results(spec: RequestSpec, prompt_ids: list[int], outputs: Sequence[LaneOutput], steps: int,
                    seconds: float, prompt_logprobs: list[dict | None] | None = None,
                    cached_tokens: int = 0) -> list[RequestResult]:
    """The :class:`RequestResult` of each of a request's ``outputs`` (``seconds``: admission to retirement;
    ``prompt_logprobs``: its prompt's, when asked for; ``cached_tokens``: its prompt tokens read from the prefix
    cache, ``stats["cached_tokens"]``); an output a stop string ended has it in ``stats["stop_string"]``."""
    prompt = spec.prompt if spec.prompt is not None else (list(spec.messages) if spec.messages is not None else None)
    stats = {"steps": steps, "prompt_tokens": len(prompt_ids), "cached_tokens": cached_tokens, "seconds": seconds}
    return [RequestResult(spec.id, i, prompt, list(prompt_ids), o.token_ids, o.text, o.stop_reason,
                          dict(stats) if o.stop_string is None else {**stats, "stop_string": o.stop_string},
                          logprobs=o.logprobs, prompt_logprobs=prompt_logprobs,
                          cumulative_logprob=None if o.logprobs is None else sum(
                              entry[t].logprob for entry, t in zip(o.logprobs, o.token_ids)))
            for i, o in enumerate(outputs)]


class GenerateProgram(Program):
    """One request's ``n`` outputs, sampled (greedy at temperature 0) until each one's stop rule ends it.

    After its prompt, the program yields one :class:`~treedec.runtime.lanes.Decode`: its outputs are lanes of the
    scheduler's batch (:mod:`treedec.runtime.lanes`), drawn every step with every other request's by one batched
    sampler, and the program is resumed once, when its last output ended. Its result is the list of its outputs'
    :class:`RequestResult` (their ``stats`` also hold the request's ``queries_per_step``: the tokens its outputs
    computed in each of its decode steps).

    Parameters
    ----------
    spec, prompt_ids : the request and its encoded prompt.
    tokenizer : detokenizes the outputs (stop strings need it).
    rule : the outputs' :class:`~treedec.sampling.stops.StopRule`; default the request's, after the
        model's EOS ids.
    keep : an ended output's node stays in the tree (a child of the prompt's node) with every token
        computed, its last one in the step after it ended; the result's ``stats["nodes"]`` lists
        them and ``stats["root"]`` is the prompt's node, which the caller prunes. Else ended
        outputs are pruned at once and the request's tree when it returns.
    on_prompt : the one output (``spec.params.n`` must be 1) grows on the prompt's node itself, which stays in
        the tree when the program returns (``stats["root"]``, also ``stats["nodes"][0]``; the caller
        prunes it) holding the prompt and every output token but the last, as a speculative request's
        node does (:func:`~treedec.programs.greedy.greedy_generate`); with ``keep`` the last one too.
    on_output : streaming: called as ``on_output(spec, index, delta, checker)`` with each output's new text as its
        tokens are accepted and once when it ends, with its last text (possibly ""), ``checker`` its
        :class:`~treedec.sampling.stops.StopChecker` (:attr:`Decode.on_text <treedec.runtime.decode.Decode>`);
        :func:`generate_batch`'s ``on_text`` is its text alone.
    grammar : ``spec.params.structured_outputs`` compiled (:func:`request_grammar`); None without them.
    on_tokens : streaming token ids instead of text: called as ``on_tokens(news, cached_tokens, prompt_logprobs)``
        once a step with the :class:`~treedec.runtime.decode.OutputTokens` of the outputs that took a token
        (:attr:`Decode.on_tokens <treedec.runtime.decode.Decode>`), the prompt's tokens this run read from the prefix
        cache and its ``prompt_logprobs`` (None unless asked for). Not with ``on_output``; give ``spec.params`` no
        stop strings and ``detokenize=False`` for no text to be made.
    """

    def __init__(self, spec: RequestSpec, prompt_ids: list[int], tokenizer=None, rule: StopRule | None = None,
                 keep: bool = False, on_output: Callable[[RequestSpec, int, str, StopChecker], None] | None = None,
                 on_prompt: bool = False, grammar: Grammar | None = None,
                 on_tokens: Callable[[OutputTokens, int, list | None], None] | None = None):
        if on_output is not None and on_tokens is not None:
            raise ValueError(f"{spec.name}: a GenerateProgram streams text (on_output) or token ids (on_tokens), "
                             f"not both")
        if (grammar is None) != (spec.params.structured_outputs is None):
            raise ValueError(f"{spec.name}: a GenerateProgram takes the compiled grammar of its structured_outputs "
                             f"(request_grammar), and one only with them")
        if on_prompt and spec.params.n != 1:
            raise ValueError(f"on_prompt grows the one output on the prompt's node: the request must have n=1, "
                             f"got n={spec.params.n}")
        self.spec, self.prompt_ids, self.tokenizer = spec, list(prompt_ids), tokenizer
        self.params = spec.params
        self.rule, self.keep, self.on_output, self.on_prompt = rule, keep, on_output, on_prompt
        self.on_tokens = on_tokens
        self.name = spec.name
        # prompt_logprobs read every prompt token's hidden state: a prefix shared with other requests has none here
        self.shares_prompt = spec.params.prompt_logprobs is None
        self.bad_words = spec.params.bad_words_token_ids(tokenizer)   # (tokenized once, here: not in the steps)
        self.grammar = grammar

    def positions(self) -> Positions:
        m = self.spec.params.max_tokens
        return Positions(len(self.prompt_ids) + m, f"a {len(self.prompt_ids)}-token prompt + max_tokens {m}")

    def step_pages(self, pool) -> int:
        return self.spec.params.n   # each output may start a page

    def run(self, ctx: ProgramContext):
        engine, spec, params = ctx.engine, self.spec, self.spec.params
        started = time.perf_counter()
        rule = self.rule if self.rule is not None else params.stop_rule(engine.model.eos_token_ids)
        if self.grammar is not None:
            rule = self.grammar.stop_rule(rule)
        root, done = None, False
        try:
            wants_prompt = params.prompt_logprobs is not None
            root, out = yield from ctx.prompt(self.prompt_ids, hidden=wants_prompt, all_rows=wants_prompt)
            prompt_lp = None
            if wants_prompt:
                prompt_lp = prompt_logprob_dicts(engine.model, out.hidden, out.logits.shape[-1], self.prompt_ids,
                                                 params.prompt_logprobs)
            stream = None if self.on_output is None else \
                (lambda i, delta, checker: self.on_output(spec, i, delta, checker))
            tokens = None if self.on_tokens is None else \
                (lambda news: self.on_tokens(news, ctx.cached_tokens, prompt_lp))
            decoded = yield Decode(root, params, rule, logits=out.logits[0], count=params.n, on_parent=self.on_prompt,
                                   keep=self.keep, offer=None if self.keep or self.on_prompt else ctx.offer,
                                   prompt_ids=self.prompt_ids, tokenizer=self.tokenizer, on_text=stream,
                                   on_tokens=tokens,
                                   name=ctx.name, bad_words=self.bad_words, grammar=self.grammar,
                                   min_tokens_stop_ids=tuple(sorted(
                                       {*engine.model.eos_token_ids, *params.stop_token_ids, *rule.eos_token_ids})))
            # each output computed its tokens but the last (kept: all), one a decode step
            computed = [len(o.token_ids) - (0 if self.keep else 1) for o in decoded.outputs]
            queries = [sum(c > j for c in computed) for j in range(max(computed))]
            results = request_results(spec, self.prompt_ids, decoded.outputs, len(queries),
                                      time.perf_counter() - started, prompt_lp, ctx.cached_tokens)
            for r in results:
                r.stats["queries_per_step"] = list(queries)
                if self.keep or self.on_prompt:
                    r.stats.update(root=root, nodes=[o.node for o in decoded.outputs])
            done = True
            return results
        finally:
            if not (done and (self.keep or self.on_prompt)):
                ctx.free(root)


def prompt_logprob_dicts(model, hidden: torch.Tensor, vocab: int, prompt_ids: list[int], k: int
                         ) -> list[dict | None]:
    """The prompt's log-probabilities (vLLM's ``prompt_logprobs``: None for its first token) from every prompt
    token's final hidden state (``hidden`` [L, hidden_size]), through the model's LM head."""
    logits = model.lm_head(hidden[:-1])[:, :vocab].float()
    return [None] + prompt_logprobs(logits, prompt_ids, k).to_dicts()
