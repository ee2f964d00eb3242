"""The online engine: a background thread driving an :class:`~treedec.runtime.online.OnlineScheduler` over one
engine, for a server (:func:`treedec.serve.build_app`). :meth:`OnlineEngine.submit` turns a
:class:`~treedec.runtime.requests.RequestSpec` into its program (a :class:`~treedec.programs.generate.GenerateProgram`,
or with a draft source a speculative program as :class:`~treedec.LLM` decodes it) and returns an asyncio async
iterator of :class:`~treedec.runtime.streams.StreamOutput`: text deltas as they are accepted, each output's end
(with its last text) when it ends, then the request's final :class:`~treedec.runtime.requests.RequestResult` list,
handed to the caller's event loop with ``loop.call_soon_threadsafe``.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from typing import AsyncIterator, Callable, Iterator, Mapping

import numpy as np

from treedec.checks import positive_int
from treedec.engine import Engine
from treedec.errors import PoolExhaustedError
from treedec.programs.beam import BeamSearchParams, BeamSearchResult, beam_program
from treedec.programs.generate import GenerateProgram, grammar_compiler, prepare_requests, worst_case_pages
from treedec.programs.speculative.batch import sampled_acceptance, speculative_program, speculative_results
from treedec.programs.speculative.draft_budget import DraftBudget
from treedec.programs.speculative.drafts import DraftSource
from treedec.programs.speculative.step_tokens import StepTokens
from treedec.runtime.online import OnlineScheduler
from treedec.runtime.prefix_cache import PrefixCache
from treedec.runtime.program import Program, ProgramContext
from treedec.runtime.requests import RequestResult, RequestSpec
from treedec.runtime.scheduler_stats import SchedulerStats
from treedec.runtime.streams import OutputStream, StreamOutput
from treedec.sampling.grammar import Grammar, GrammarCompiler
from treedec.sampling.params import SEED_MAX, SamplingParams
from treedec.sampling.stops import StopChecker

__all__ = ["OnlineEngine"]


class OnlineEngine:
    """A background thread driving an :class:`OnlineScheduler` over ``engine``, for a server.

    The thread loops :meth:`OnlineScheduler.iterate` while there is work and sleeps when idle. Nothing
    else may step ``engine`` while it runs. :meth:`submit` (in a coroutine of an asyncio loop) returns an
    async iterator of :class:`~treedec.runtime.streams.StreamOutput`; :meth:`abort` ends a request (its stream raises
    :class:`~treedec.runtime.online.ProgramAborted`); :meth:`shutdown` aborts every request and joins the thread. Use
    it as a context manager to shut it down on exit.

    Parameters
    ----------
    engine : the engine (the thread's alone from now on).
    tokenizer : the default tokenizer of requests (text prompts, stop strings, streamed text).
    chat_template : encode ``prompt`` / ``messages`` through the tokenizer's chat template by default.
    max_step_tokens : as :class:`OnlineScheduler`'s.
    drafts : every request decoded speculatively with ``drafts(spec)`` as its draft source (e.g. an
        :class:`~treedec.LLM`'s ``llm.drafts.source``), as :class:`~treedec.LLM` decodes: greedy acceptance at
        temperature 0, lossless rejection sampling above. A request speculative decoding cannot take
        (``n > 1``, ...) is refused at :meth:`submit` (ValueError).
    pipeline : the speculative requests' steps pipelined, as
        :func:`~treedec.programs.speculative.batch.speculative_batch` runs them offline
        (:mod:`treedec.programs.speculative.verify_table`: the live requests whose trees share a shape verified,
        accepted and drafted as one batched operation each a step, whatever their number): None (the default) where
        the draft and the request allow it on a GPU; True: a request that cannot run pipelined is refused at
        :meth:`submit` (ValueError saying why); False: never. Each result's ``stats["pipelined"]`` and
        ``stats["pipeline_note"]`` say which ran and why.
    max_draft_tokens : the largest draft tree (root included) a speculative request verifies a step.
    seed : the seeds given to sampled requests without one (so that a preempted request, run again from its
        start, draws the same tokens and its streamed text stays right).
    on_iteration : called on the driving thread as ``on_iteration(stats, seconds)`` after each iteration (an
        engine step for every live program): the scheduler's stats and the iteration's wall time (metrics).
    history, prefix_cache : as :class:`OnlineScheduler`'s.
    grammars : compiles requests' ``structured_outputs`` (default: made from ``tokenizer`` at the first such request;
        e.g. an :class:`~treedec.LLM`'s ``llm.grammars``). A server compiles a request's constraint off its event
        loop (:meth:`grammar`, from a worker thread) before :meth:`submit` finds it cached.

    Attributes
    ----------
    error : what stopped the thread (a callback's bug), else None; then :meth:`submit` raises RuntimeError.

    Every request's size is bounded before it is queued: :meth:`submit` refuses one whose worst case
    (:func:`~treedec.programs.generate.worst_case_pages`: its prompt and ``n`` outputs of ``max_tokens``) exceeds the
    pages the pool can give one request (:attr:`OnlineScheduler.capacity`), so no request is admitted that could only
    fail later, after its ``n`` outputs' state was built. :attr:`waiting_outputs` counts the outputs waiting for
    admission (a server's queue bound) and :attr:`iteration_seconds` is a heartbeat (how long the iteration running
    now has run).
    """

    def __init__(self, engine: Engine, tokenizer=None, *, chat_template: bool = False,
                 max_step_tokens: int | None = None, drafts: Callable[[RequestSpec], DraftSource] | None = None,
                 max_draft_tokens: int = 64, pipeline: bool | None = None, seed: int = 0,
                 on_iteration: Callable[[SchedulerStats, float], None] | None = None, history: int = 1024,
                 prefix_cache: bool | PrefixCache = True, grammars: GrammarCompiler | None = None):
        for name, f in (("drafts", drafts), ("on_iteration", on_iteration)):
            if f is not None and not callable(f):
                raise TypeError(f"{name} must be callable or None, got {type(f).__name__}")
        positive_int("max_draft_tokens", max_draft_tokens)
        if pipeline is not None and not isinstance(pipeline, bool):
            raise ValueError(f"pipeline must be None, True or False, got {pipeline!r}")
        self.pipeline = pipeline
        self.engine, self.tokenizer, self.chat_template = engine, tokenizer, chat_template
        self.scheduler = OnlineScheduler(engine, max_step_tokens=max_step_tokens, on_done=self._done,
                                         on_error=self._failed, history=history, prefix_cache=prefix_cache)
        self.drafts, self.max_draft_tokens, self.on_iteration = drafts, max_draft_tokens, on_iteration
        self._budget = DraftBudget() if drafts is not None else None   # shared by the speculative requests
        self._seeds = np.random.default_rng(seed)
        self._requests: dict[int, _Request] = {}    # handle -> request (the driving thread pops it)
        self._handles: dict[int | str, int] = {}    # request id -> handle, while it runs
        self._waiting: dict[int | str, int] = {}    # request id -> its outputs, until its program first starts
        self._num_waiting = 0                       # their sum
        self._iteration_start: float | None = None  # (perf_counter) the iteration running now began
        self._lock = threading.Lock()
        self._between = threading.Lock()   # held by the driving thread through each iteration
        self._wake = threading.Event()
        self._stopping = False
        self._grammars, self._grammar_lock = grammars, threading.Lock()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="treedec-online", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Whether the driving thread runs (not shut down, not failed)."""
        return self._thread.is_alive() and not self._stopping

    @property
    def waiting_outputs(self) -> int:
        """The outputs (``n`` a request) of the requests submitted whose program has not started yet (any thread)."""
        return self._num_waiting

    @property
    def iteration_seconds(self) -> float:
        """How long the iteration running now has run, in seconds; 0.0 between iterations (any thread)."""
        start = self._iteration_start
        return 0.0 if start is None else max(0.0, time.perf_counter() - start)

    def grammar(self, params: SamplingParams) -> Grammar | None:
        """``params.structured_outputs`` compiled (cached; any thread), or None without them. Raises
        :class:`~treedec.sampling.grammar.GrammarError` (a ValueError) for a constraint that cannot be compiled."""
        if params.structured_outputs is None:
            return None
        with self._grammar_lock:
            if self._grammars is None:
                self._grammars = grammar_compiler(self.engine, self.tokenizer)
        return self._grammars.compile(params.structured_outputs)

    def submit(self, spec: RequestSpec, tokenizer=None, chat_template: bool | None = None,
               beam: BeamSearchParams | None = None, stream: OutputStream | None = None, stream_tokens: bool = False
               ) -> AsyncIterator[StreamOutput]:
        """Start request ``spec`` (its prompt encoded and checked here: a bad request raises here, ValueError or
        TypeError, or :class:`~treedec.errors.PoolExhaustedError` for one whose worst case exceeds what the pool can
        give a request, :attr:`OnlineScheduler.capacity`, or for a speculative request larger than the free pool);
        returns an async iterator of its :class:`~treedec.runtime.streams.StreamOutput`, the last one ``finished``.
        Call it in a coroutine (the running loop gets the outputs). A request id must be unique among the running
        requests. A sampled request without a seed gets one (see ``seed``).

        With ``beam`` the request is a beam search (:func:`~treedec.programs.beam.beam_program`, as
        :meth:`~treedec.LLM.beam_search` runs it; ``spec.params`` gives its prompt's options, ``n`` its
        ``beam_width``): its ``beam_width`` hypotheses, best first, are its outputs, streamed when it ends (their
        scores in ``stats["beam_score"]``); not on a speculative engine (ValueError).

        ``stream``: the request's outputs go there (an :class:`~treedec.runtime.streams.OutputStream` with
        ``deliver``, for the engine core: :mod:`treedec.core.engine_core`), which is returned; then it may be called on
        any thread.

        ``stream_tokens``: the request's outputs stream as token ids (:meth:`OutputStream.tokens
        <treedec.runtime.streams.OutputStream.tokens>`: each step's new tokens, their logprobs, the outputs' ends by
        EOS / stop ids / length) and no text is made: its stop strings are left to the caller (a server's frontend,
        which detokenizes them) and its program runs with no stop strings and no detokenizer; its results' texts are
        None. A speculative request's items carry each verification step's accepted tokens (several a step) and its
        draft accounting (:class:`~treedec.runtime.streams.StreamTokens`' ``accepted``, ``draft_sizes``). Not with
        ``beam`` (ValueError)."""
        loop = asyncio.get_running_loop() if stream is None else None
        tokenizer = self.tokenizer if tokenizer is None else tokenizer
        chat_template = self.chat_template if chat_template is None else chat_template
        if beam is not None and (self.drafts is not None or spec.params.n != beam.beam_width):
            raise ValueError("use_beam_search runs on a server without speculative decoding" if self.drafts is not None
                             else f"n must be the beam's width {beam.beam_width}, got {spec.params.n}")
        if stream_tokens:
            if beam is not None:
                raise ValueError("a request streams token ids only when it is generated, not a beam search")
            # (detokenize is not a speculative field: its program is given no tokenizer instead)
            plain = spec.params.replace(stop=()) if self.drafts is not None else \
                spec.params.replace(stop=(), detokenize=False)
            spec = dataclasses.replace(spec, params=plain)
        [(spec, prompt_ids)] = prepare_requests(self.engine, [spec], tokenizer, chat_template)
        if spec.params.structured_outputs is not None and (beam is not None or tokenizer is not self.tokenizer):
            raise ValueError("structured_outputs: not with use_beam_search" if beam is not None else
                             "structured_outputs are compiled for the engine's default tokenizer, not a request's own")
        grammar = self.grammar(spec.params)   # (a server compiled it off its loop: found in the cache)
        worst, capacity = worst_case_pages(self.engine.pool, spec.params, len(prompt_ids)), self.scheduler.capacity
        if self.drafts is None and worst > capacity:
            raise PoolExhaustedError(
                f"request {spec.id!r} may need {worst} KV pages (prompt {len(prompt_ids)} tokens + {spec.params.n} x "
                f"{spec.params.max_tokens} new tokens), more than the {capacity} the pool can give one request; lower "
                f"max_tokens or n, or give the engine more kv_tokens; nothing was run")
        if spec.params.temperature > 0 and spec.params.seed is None:
            with self._lock:
                seed = int(self._seeds.integers(0, SEED_MAX))
            spec = dataclasses.replace(spec, params=spec.params.replace(seed=seed))
        stream = OutputStream(loop, spec.id) if stream is None else stream
        to_results: Callable = lambda result, cached: result
        if beam is not None:
            eos = () if beam.ignore_eos else tuple(self.engine.model.eos_token_ids)
            program = beam_program(self.engine, prompt_ids, beam.beam_width, beam.max_tokens, beam.length_penalty,
                                   eos or None, beam.early_stopping)
            to_results = lambda result, cached: beam_results(spec, prompt_ids, result, tokenizer, eos, cached)
        elif self.drafts is None:
            program = GenerateProgram(spec, prompt_ids, tokenizer, grammar=grammar, on_tokens=stream.tokens) \
                if stream_tokens else GenerateProgram(spec, prompt_ids, tokenizer, grammar=grammar,
                                                      on_output=None if tokenizer is None else _streamed(stream))
        else:
            to_results = lambda result, cached: speculative_results(spec, prompt_ids, result)
            program = speculative_program(
                self.engine, spec, prompt_ids, self.drafts(spec), None if stream_tokens else tokenizer,
                sampled_acceptance(spec, lambda s: s.params.seed), self.max_draft_tokens, self._budget,
                pipeline=self.pipeline, greedy_only=False, grammar=grammar,
                on_text=None if tokenizer is None or stream_tokens else
                lambda delta, checker: stream.text(0, delta, checker.num_tokens),
                on_tokens=_step_tokens(stream) if stream_tokens else None)
        with self._lock:
            if self._stopping:
                raise RuntimeError("the online engine is shut down" if self.error is None else
                                   f"the online engine failed: {type(self.error).__name__}: {self.error}")
            if spec.id in self._handles:
                raise ValueError(f"request id {spec.id!r} is already running")
            restarts = _Restarts(program, lambda: self._started(spec.id, stream))
            handle = self.scheduler.submit(restarts)
            self._requests[handle] = _Request(spec, stream, lambda result: to_results(result, restarts.cached_tokens))
            self._handles[spec.id] = handle
            self._waiting[spec.id] = spec.params.n
            self._num_waiting += spec.params.n
        self._wake.set()
        return stream

    def abort(self, request_id: int | str, kept: Mapping[int, int] | None = None) -> bool:
        """Abort a running request (its stream raises :class:`~treedec.runtime.online.ProgramAborted`; its pages are
        freed at the next iteration); returns whether it was running. ``kept``: output index -> its tokens the
        caller kept (a frontend's stop string ended it there): its conversation to there is offered to the prefix cache
        first (:meth:`OnlineScheduler.abort`), so a chat's next turn reads it."""
        with self._lock:
            handle = self._handles.get(request_id)
        if handle is None:
            return False
        self.scheduler.abort(handle, kept)
        self._wake.set()
        return True

    @contextlib.contextmanager
    def between_iterations(self) -> Iterator[None]:
        """Hold the driving thread between two iterations (waiting for the one running now to end): the tree, the
        pool and the scheduler's queues do not change meanwhile, so a caller on another thread may read them whole
        (a pages report's invariant check). Hold it briefly: no iteration runs while it is held."""
        with self._between:
            yield

    def shutdown(self, timeout: float | None = None) -> bool:
        """Abort every running request, let the thread close them (their pages freed) and join it (for at most
        ``timeout`` seconds); returns whether the thread has ended."""
        with self._lock:
            self._stopping = True
            handles = list(self._handles.values())
        for handle in handles:
            self.scheduler.abort(handle)
        self._wake.set()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def __enter__(self) -> "OnlineEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _loop(self) -> None:
        scheduler = self.scheduler
        try:
            while True:
                self._wake.clear()
                with self._between:
                    busy = not scheduler.idle
                    if busy:
                        start = self._iteration_start = time.perf_counter()
                        try:
                            scheduler.iterate()
                        finally:
                            self._iteration_start = None
                if busy:
                    if self.on_iteration is not None:
                        self.on_iteration(scheduler.stats, time.perf_counter() - start)
                    continue
                if self._stopping:
                    return
                self._wake.wait()
        except BaseException as error:   # (a callback's bug): end every stream with it
            self.error = error
            with self._lock:
                self._stopping = True
                requests, self._requests = self._requests, {}
                self._handles.clear()
                self._waiting.clear()
                self._num_waiting = 0
            for request in requests.values():
                request.stream.fail(error)

    def _started(self, request_id: int | str, stream: OutputStream) -> None:
        """A run of the request's program starts (the driving thread): it no longer waits; its text starts again."""
        with self._lock:
            self._num_waiting -= self._waiting.pop(request_id, 0)
        stream.restart()

    def _finish(self, handle: int) -> _Request | None:
        with self._lock:
            request = self._requests.pop(handle, None)
            if request is not None:
                self._handles.pop(request.spec.id, None)
                self._num_waiting -= self._waiting.pop(request.spec.id, 0)
        return request

    def _done(self, handle: int, result) -> None:
        request = self._finish(handle)
        if request is not None:
            request.stream.finish(request.results(result))

    def _failed(self, handle: int, error: BaseException) -> None:
        request = self._finish(handle)
        if request is not None:
            request.stream.fail(error)


def _streamed(stream: OutputStream) -> Callable[[RequestSpec, int, str, StopChecker], None]:
    """A GenerateProgram's ``on_output`` into ``stream``: text deltas with their outputs' token counts, and each
    output's end with its last text."""
    def on_output(spec: RequestSpec, index: int, delta: str, checker: StopChecker) -> None:
        if checker.stopped:
            stream.end(index, delta, checker.stop_reason, checker.token_ids)
        else:
            stream.text(index, delta, checker.num_tokens)
    return on_output


def _step_tokens(stream: OutputStream) -> Callable[[StepTokens], None]:
    """A speculative program's ``on_tokens`` into ``stream`` (its one output's tokens, a run of them a step)."""
    def on_tokens(news: StepTokens) -> None:
        stream.output_tokens(0, news.tokens, news.logprobs, news.end, news.cached_tokens, accepted=news.accepted,
                             draft_sizes=news.draft_sizes)
    return on_tokens


def beam_results(spec: RequestSpec, prompt_ids: list[int], result: BeamSearchResult, tokenizer, eos: tuple[int, ...],
                 cached_tokens: int) -> list[RequestResult]:
    """A beam search's hypotheses (best first) as a request's outputs: each one's text as a generated output's
    (``spec.params``' detokenizer), ``"eos"`` when it ended on an EOS id, else ``"length"``."""
    results = []
    for i, (tokens, score) in enumerate(zip(result.sequences, result.scores)):
        detokenizer = spec.params.detokenizer(tokenizer, prompt_ids)
        text = None
        if detokenizer is not None:
            detokenizer.feed(tokens)
            detokenizer.finish()
            text = detokenizer.text
        results.append(RequestResult(spec.id, i, spec.prompt, list(prompt_ids), list(tokens), text,
                                     "eos" if tokens and tokens[-1] in eos else "length",
                                     {"cached_tokens": cached_tokens, "beam_score": score}))
    return results


@dataclasses.dataclass(frozen=True)
class _Request:
    spec: RequestSpec
    stream: OutputStream
    results: Callable[[object], list[RequestResult]]   # the program's result -> the request's outputs


class _Restarts(Program):
    """``program`` as the scheduler runs it, calling ``on_start()`` whenever a run of it starts (a preempted
    program runs again from its start: its stream's text starts again)."""

    def __init__(self, program: Program, on_start: Callable[[], None]):
        self.program, self.on_start = program, on_start
        self.prompt_ids, self.shares_prompt, self.name = program.prompt_ids, program.shares_prompt, program.name
        self.cached_tokens = 0   # its prompt's tokens its last run read from the prefix cache (a beam's usage)

    def run(self, ctx: ProgramContext):
        self.on_start()
        result = yield from self.program.run(ctx)
        self.cached_tokens = ctx.cached_tokens
        return result

    def positions(self):
        return self.program.positions()

    def start_pages(self, pool, shared: int = 0) -> int:
        return self.program.start_pages(pool, shared)

    def step_pages(self, pool) -> int:
        return self.program.step_pages(pool)
