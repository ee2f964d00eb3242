"""The engine core: the online scheduler of one :class:`~treedec.LLM` behind the messages of
:mod:`treedec.core.messages`, in the server's process (:class:`EngineCore`, driven by
:class:`~treedec.core.client.InProcessClient`) or in a process of its own (:func:`run_core_process`, started by
:class:`~treedec.core.process_client.ProcessClient`), as vLLM v1's ``EngineCore`` / ``EngineCoreProc``.

:class:`EngineCore` wraps an :class:`~treedec.core.online_engine.OnlineEngine` (its thread drives the scheduler; its
logic is unchanged). :meth:`EngineCore.handle` takes one :data:`~treedec.core.messages.CoreInput`: a request is
checked and queued there (refused: a :class:`~treedec.core.messages.RequestFailure`), an abort passed on. Each
request's stream items (new token ids and each output's end for a request that streams them, which the core does
not detokenize; text deltas for the others; its results or its error) are gathered as they come, and
after every engine iteration ONE :class:`~treedec.core.messages.IterationOutputs` carries all of them with the
core's stats (its iteration time, queue, free pages) to ``sink``; the arrivals of one input batch are acknowledged by
one more (their acceptance and what was refused), so a refusal reaches the client whether or not the engine runs.

The process (:func:`run_core_process`) builds the LLM from a picklable recipe, answers
:class:`~treedec.core.messages.CoreReady` (or :class:`~treedec.core.messages.CoreStartupFailed` with the error's
line), then reads inputs from a ZMQ PULL socket and sends outputs on a PUSH socket. It ends when told
(:class:`~treedec.core.messages.Shutdown`), when its frontend process is gone, or when the engine's thread fails (exit
code 1: the frontend sees the process end and fails every request with ``engine_failed``).
"""
from __future__ import annotations

import functools
import os
import threading
import time
import traceback
from typing import Any, Callable

from treedec.errors import PoolExhaustedError
from treedec.runtime.online import ProgramAborted
from treedec.runtime.request import pages_in_use, position_limit
from treedec.runtime.requests import RequestSpec
from treedec.runtime.streams import OutputStream, StreamFailure, StreamOutput, StreamTokens
from treedec.sampling.grammar import GrammarError
from treedec.core.online_engine import OnlineEngine
from treedec.core.messages import (AbortRequests, AddRequest, CoreInput, CoreOutput, CoreReady, CoreStartupFailed,
                                    IterationOutputs, IterationStats, MessageCodec, OutputDelta, PagesQuery,
                                    PagesReport, PositionLogprobs, RequestFailure, RequestFinished, Shutdown,
                                    TokenDelta, dumps, loads)

__all__ = ["ERROR_KINDS", "EngineCore", "run_core_process"]

#: The errors of one request that keep their class across the process boundary (the frontend answers each as
#: today: 400, ``kv_cache_exceeded``, ``server_shutdown``; a constraint that cannot be compiled, or no grammar engine:
#: 400 naming the field); any other is the engine's failure (503 ``engine_failed``).
ERROR_KINDS: dict[str, type[BaseException]] = {"ValueError": ValueError, "TypeError": TypeError,
                                               "PoolExhaustedError": PoolExhaustedError,
                                               "ProgramAborted": ProgramAborted, "GrammarError": GrammarError,
                                               "ModuleNotFoundError": ModuleNotFoundError}

#: Seconds the core's input loop waits for a message before it checks its frontend and its engine again.
_POLL_SECONDS = 0.1


class EngineCore:
    """The online scheduler of ``llm`` behind the core's messages (see the module docstring); ``sink(message)`` gets
    every :class:`~treedec.core.messages.IterationOutputs`, on the engine's thread or the caller's.

    Parameters
    ----------
    llm : the LLM (its engine is the core's alone from now on; its prefix cache, when it keeps one, is the core's).
    sink : where the output messages go.
    max_step_tokens, seed : as :class:`~treedec.core.online_engine.OnlineEngine`'s.
    prefix_cache : keep a prefix cache over the engine when the LLM keeps none (a server's core always keeps one);
        False: the LLM's own alone (its ``enable_prefix_caching``), as the offline LLM runs.
    """

    def __init__(self, llm, sink: Callable[[IterationOutputs], None], *, max_step_tokens: int | None = None,
                 seed: int = 0, prefix_cache: bool = True):
        self.llm, self.sink = llm, sink
        self._lock = threading.Lock()   # the batch below; taken before the online engine's own lock, never inside it
        self._accepted: list[str] = []
        self._tokens: list[TokenDelta] = []
        self._outputs: list[OutputDelta] = []
        self._token_requests: set[str] = set()   # the running requests that stream token ids
        self._finished: list[RequestFinished] = []
        self._failed: list[RequestFailure] = []
        self.online = OnlineEngine(llm.engine, llm.tokenizer, max_step_tokens=max_step_tokens,
                                   drafts=None if llm.drafts is None else llm.drafts.source, seed=seed,
                                   on_iteration=self._iterated,   # (one cache per engine: the LLM's if it keeps one)
                                   prefix_cache=prefix_cache if llm.prefix_cache is None else llm.prefix_cache)

    def ready(self, pid: int) -> CoreReady:
        """What the frontend needs of the core's model."""
        llm = self.llm
        pool = llm.engine.pool
        return CoreReady(name=llm.name, max_model_len=llm.max_model_len, positions=position_limit(llm.model),
                         vocab_size=llm.model.config.vocab_size,
                         speculative=llm.drafts is not None, device=str(llm.model.device),
                         kv_tokens=pool.num_pages * pool.page_size, kv_cache_dtype=llm.engine.kv_cache_dtype,
                         page_size=pool.page_size, batch_invariant=llm.engine.batch_invariance is not None,
                         note="" if llm.drafts is None else llm.drafts.note,
                         tokenizer=None if llm.tokenizer is None else dumps(llm.tokenizer), pid=pid,
                         eos_token_ids=list(llm.model.eos_token_ids))

    # ------------------------------------------------------------ inputs

    def handle(self, messages: list[CoreInput]) -> PagesReport | None:
        """Take a batch of inputs (in order); the arrivals among them are acknowledged by one message. Returns the
        answer of a :class:`~treedec.core.messages.PagesQuery` (the last one), else None. A
        :class:`~treedec.core.messages.Shutdown` aborts every request (the caller ends the core)."""
        answer, arrivals = None, False
        for message in messages:
            if isinstance(message, AddRequest):
                self._add(message)
                arrivals = True
            elif isinstance(message, AbortRequests):
                for j, request_id in enumerate(message.request_ids):
                    kept = None if message.kept is None else {i: k for i, k in enumerate(message.kept[j]) if k}
                    self.online.abort(request_id, kept)
            elif isinstance(message, PagesQuery):
                answer = self.pages(message.token)
            elif isinstance(message, Shutdown):
                self.online.shutdown(timeout=0)
            else:
                raise TypeError(f"the engine core got a {type(message).__name__}, not an input message")
        if arrivals:
            self.flush(0.0)
        return answer

    def _add(self, message: AddRequest) -> None:
        rid = message.request_id
        stream = OutputStream(None, rid, deliver=functools.partial(self._deliver, rid))   # (C: no frame a token)
        with self._lock:   # (acknowledged in the message that counts it as waiting)
            try:
                spec = RequestSpec(rid, prompt_ids=message.prompt_ids, params=loads(message.params))
                self.online.submit(spec, beam=None if message.beam is None else loads(message.beam), stream=stream,
                                   stream_tokens=message.stream_tokens)
            except Exception as e:
                self._failed.append(_failure(rid, e))
            else:
                self._accepted.append(rid)
                if message.stream_tokens:
                    self._token_requests.add(rid)

    # ------------------------------------------------------------ outputs

    def _deliver(self, rid: str, item: Any) -> None:
        """A stream item of request ``rid`` (the engine's thread, or a submit's)."""
        with self._lock:
            if isinstance(item, StreamTokens):
                self._tokens.append(TokenDelta(
                    rid, item.index, item.token_ids,
                    None if item.logprobs is None else [PositionLogprobs.of(e) for e in item.logprobs], item.end,
                    item.cached_tokens, None if item.prompt_logprobs is None else
                    [None if e is None else PositionLogprobs.of(e) for e in item.prompt_logprobs],
                    item.accepted, item.draft_sizes))
            elif isinstance(item, StreamOutput):
                if item.results is not None:
                    tokens = rid in self._token_requests
                    self._token_requests.discard(rid)
                    self._finished.append(RequestFinished(rid, None if tokens else dumps(item.results)))
                elif rid in self._token_requests:   # (every output of a token stream ends in its news)
                    raise AssertionError(f"request {rid!r} streams token ids, and got a text item: {item}")
                else:
                    self._outputs.append(OutputDelta(rid, item.index or 0, item.text, item.tokens, item.stop_reason,
                                                     item.token_ids))
            elif isinstance(item, StreamFailure):
                self._token_requests.discard(rid)
                self._failed.append(_failure(rid, item.error))

    def _iterated(self, stats, seconds: float) -> None:
        self.flush(seconds)

    def flush(self, seconds: float) -> None:
        """Send what was gathered since the last message, with the core's stats (``seconds``: the iteration's)."""
        online, pool = self.online, self.llm.engine.pool
        scheduler = online.scheduler
        s = scheduler.stats
        with self._lock:
            message = IterationOutputs(
                self._accepted, self._tokens, self._outputs, self._finished, self._failed,
                IterationStats(seconds=seconds, steps=s.steps, num_running=scheduler.num_running,
                               num_waiting=scheduler.num_waiting, waiting_outputs=online.waiting_outputs,
                               prompt_tokens=s.prompt_tokens, cached_tokens=s.cached_tokens,
                               preemptions=s.preemptions, free_pages=pool.num_free_pages, num_pages=pool.num_pages,
                               queries=s.queries_per_step[-1] if s.queries_per_step and seconds else 0,
                               cache_pages=0 if scheduler.cache is None else scheduler.cache.num_pages))
            self._accepted, self._tokens, self._outputs, self._finished, self._failed = [], [], [], [], []
            self.sink(message)

    def pages(self, token: int) -> PagesReport:
        """The core's page accounting now (see :class:`~treedec.core.messages.PagesReport`), read between two of the
        engine thread's iterations; the tree's invariants are checked only when the scheduler is idle."""
        scheduler, engine = self.online.scheduler, self.llm.engine
        cache = scheduler.cache
        with self.online.between_iterations():   # (an idle scheduler's last iteration may still be freeing the tree)
            cache_pages = 0 if cache is None else cache.num_pages
            idle = scheduler.idle and not self.online.waiting_outputs
            broken = None
            if idle:
                try:
                    engine.tree.check_invariants(held=None if cache is None else cache.held())
                except Exception as e:   # (reported: the test or the soak asking fails on it)
                    broken = f"{type(e).__name__}: {e}"
            return PagesReport(token=token, idle=idle, num_nodes=engine.tree.num_nodes,
                               held_pages=pages_in_use(engine.pool) - cache_pages, cache_pages=cache_pages,
                               invariants=broken)

    def shutdown(self, timeout: float | None = None) -> bool:
        """Abort every request and join the engine's thread (see :meth:`OnlineEngine.shutdown`)."""
        return self.online.shutdown(timeout)


def _failure(rid: str, error: BaseException) -> RequestFailure:
    kind = type(error).__name__
    return RequestFailure(rid, kind if ERROR_KINDS.get(kind) is type(error) else f"engine:{kind}", str(error))


# ------------------------------------------------------------------ the core's own process

def run_core_process(recipe: Callable[[], Any], input_address: str, output_address: str,
                     max_step_tokens: int | None, seed: int, prefix_cache: bool) -> None:
    """The engine core's process (a ``multiprocessing`` spawn target): ``recipe()`` builds the LLM, then the core
    (:class:`EngineCore` with ``max_step_tokens``, ``seed``, ``prefix_cache``) serves the ZMQ sockets at
    ``input_address`` (PULL) and ``output_address`` (PUSH) until told to end, until its parent process is gone, or
    until its engine fails (exit code 1)."""
    import multiprocessing
    import signal

    import zmq

    signal.signal(signal.SIGINT, signal.SIG_IGN)   # (Ctrl-C reaches the frontend, which ends the core in order)

    context = zmq.Context()
    outputs = context.socket(zmq.PUSH)
    outputs.setsockopt(zmq.LINGER, 2000)
    outputs.connect(output_address)
    inputs = context.socket(zmq.PULL)
    inputs.setsockopt(zmq.LINGER, 0)
    inputs.connect(input_address)
    out_codec, in_codec = MessageCodec(CoreOutput), MessageCodec(CoreInput)
    send_lock = threading.Lock()

    def send(message) -> None:
        data = out_codec.encode(message)
        with send_lock:
            outputs.send(data, copy=False)

    try:
        llm = recipe()
        core = EngineCore(llm, send, max_step_tokens=max_step_tokens, seed=seed, prefix_cache=prefix_cache)
    except BaseException as e:   # (a bad model path, a pool too large: the user reads this line)
        # (the nearest built-in class: the frontend raises that one, a user's error staying one line)
        send(CoreStartupFailed(next(c.__name__ for c in type(e).__mro__ if c.__module__ == "builtins"), str(e)))
        outputs.close()
        context.term()
        os._exit(1)
    send(core.ready(os.getpid()))
    core.flush(0.0)   # (its pool's state at once: a core started again replaces its dead one's stats, /metrics too)
    parent = multiprocessing.parent_process()
    poller = zmq.Poller()
    poller.register(inputs, zmq.POLLIN)
    code = 0
    try:
        while True:
            if not core.online.alive:
                if core.online.error is not None:
                    code = 1
                    print(f"treedec engine core: the engine failed: {type(core.online.error).__name__}: "
                          f"{core.online.error}", flush=True)
                    traceback.print_exception(core.online.error)
                break
            if parent is not None and not parent.is_alive():
                break
            if not poller.poll(_POLL_SECONDS * 1000):
                continue
            batch = []
            while True:   # (every message waiting: one acknowledgement for the batch)
                try:
                    batch.append(in_codec.decode(inputs.recv(zmq.NOBLOCK, copy=False).buffer))
                except zmq.Again:
                    break
            answer = core.handle(batch)
            if answer is not None:
                send(answer)
            if any(isinstance(m, Shutdown) for m in batch):
                break
    finally:
        core.shutdown(timeout=10.0)
        core.flush(0.0)   # (the aborted requests' ends)
        time.sleep(0)
        outputs.close()
        inputs.close()
        context.term()
    os._exit(code)
