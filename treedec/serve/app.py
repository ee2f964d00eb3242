"""The OpenAI-compatible HTTP app: :func:`build_app` over one :class:`~treedec.LLM`'s engine.

One :class:`~treedec.runtime.online.OnlineEngine` (one thread driving the engine) serves every request: started
when the app starts, shut down (every request aborted, its pages freed) when it stops. Routes: ``POST
/v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health``, ``GET /metrics``
(:mod:`treedec.serve.metrics`); ``/docs``, ``/redoc`` and ``/openapi.json`` only with ``enable_docs``.

No request can hurt the others: every size a client controls is bounded before the work it costs is done. The
headers and the body by :class:`~treedec.serve.limits.RequestLimits` (host, bytes, arrival); the counts (``n``,
prompts, outputs queued) on arrival; a text prompt's length before it is tokenized, and the tokenizer and the chat
template off the event loop (:class:`~treedec.serve.prompts.PromptEncoder`); the KV pages a request may need at
worst before it is queued (:meth:`OnlineEngine.submit`). A request's text streams back from the engine's thread.

Errors are OpenAI's JSON (``{"error": {"message", "type", "param", "code"}}``), never a traceback: 400 for a bad
parameter or body (FastAPI's 422 included; a body that is not UTF-8, nests too deeply or holds a too-long integer
says so), for a prompt past the model's positions (``code: "context_length_exceeded"``), for a request larger than
the server takes (``n``, prompts, outputs) or than its KV cache holds (``"kv_cache_exceeded"``), for a chat template
that fails or runs past its budget (``"chat_template_failed"``) and for a Host header a loopback server does not
answer (``"invalid_host"``); 404 for another model's name (``"model_not_found"``) or route; 408 for a body that stops
arriving (``"request_timeout"``); 413 for a body over ``max_body_bytes`` (``"request_too_large"``: by its
Content-Length, or as its bytes arrive); 503 when ``max_queued_requests`` outputs wait for admission
(``"overloaded"``), the engine failed (``"engine_failed"``), the server shuts down (``"server_shutdown"``), and from
``/health`` when the engine's iteration has run longer than ``engine_iteration_timeout`` (``"engine_stalled"``);
500 (logged here) for anything unexpected. A client that disconnects, streaming or not, aborts its requests (their
pages are freed at the engine's next iteration). A streamed request that fails after its first chunk ends with an
``error`` event, then ``[DONE]``.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from typing import AsyncIterator, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from treedec.errors import PoolExhaustedError
from treedec.llm import LLM
from treedec.runtime.online import ProgramAborted
from treedec.serve.engine import OnlineEngine
from treedec.runtime.request import position_limit
from treedec.runtime.requests import RequestResult, RequestSpec
from treedec.serve.limits import BodyError, RequestLimits, body_error_response
from treedec.serve.metrics import CONTENT_TYPE_LATEST, ServeMetrics
from treedec.serve.prompts import PromptEncoder, longest_token_chars
from treedec.serve.protocol import ChatCompletionRequest, CompletionRequest, ServeError
from treedec.serve.responses import Choices, chat_logprobs, completion_logprobs, usage

__all__ = ["build_app"]

logger = logging.getLogger("treedec.serve")

#: Seconds the app's end waits for the engine's thread (an iteration that hangs is left to die with the process).
_JOIN_SECONDS = 10.0


def build_app(llm: LLM, served_model_name: str | None = None, *, max_queued_requests: int = 1024, max_n: int = 128,
              max_prompts: int = 256, max_body_bytes: int = 8 * 2**20, read_timeout: float | None = 30.0,
              engine_iteration_timeout: float = 60.0, chat_template_timeout: float = 5.0,
              allowed_hosts: Sequence[str] | None = None, enable_docs: bool = False,
              max_step_tokens: int | None = None, seed: int = 0) -> FastAPI:
    """The FastAPI app serving ``llm`` (its model, tokenizer, engine and speculative config: with one, every request
    is decoded speculatively, and one it cannot take is answered 400).

    Parameters
    ----------
    served_model_name : the ``model`` requests must name (default ``llm.name``).
    max_queued_requests : the outputs (prompts x ``n`` of each request) that may wait for admission: a request that
        would make more wait is answered 503, one asking for more on its own 400.
    max_n : the largest ``n`` (vLLM caps it too: ``VLLM_MAX_N_SEQUENCES``, 16384; treedec steps a request's ``n``
        outputs together, ``n`` rows of logits a step, hence a smaller default).
    max_prompts : the most prompts one ``/v1/completions`` request may hold (vLLM: ``VLLM_MAX_COMPLETION_PROMPTS``).
    max_body_bytes : the largest request body (413 past it, counted as it arrives). The default, 8 MiB, holds a
        128k-token context several times over (about 0.5 MB as text, 1 MB as token ids).
    read_timeout : seconds a request's body may pause between two chunks (408 past it); None: no limit.
    engine_iteration_timeout : ``/health`` answers 503 ``engine_stalled`` while an engine iteration has run longer
        (vLLM's ``VLLM_ENGINE_ITERATION_TIMEOUT_S``, 60 s).
    chat_template_timeout : seconds the chat template may take to render a request's messages (400 past it; it
        runs in a worker process, killed then).
    allowed_hosts : the ``Host`` names answered (ports ignored; ``"*"`` any); None: any (``treedec serve`` on a
        loopback address answers only ``localhost``, ``127.0.0.1`` and ``[::1]`` unless told otherwise).
    enable_docs : serve FastAPI's ``/docs``, ``/redoc`` and ``/openapi.json`` (off by default).
    max_step_tokens : prompt tokens a step computes at most (:class:`~treedec.runtime.online.OnlineScheduler`).
    seed : the seeds of sampled requests without one.

    ``app.state.online`` is the :class:`~treedec.runtime.online.OnlineEngine` while the app runs, ``app.state.metrics``
    its :class:`~treedec.serve.metrics.ServeMetrics`.
    """
    if not isinstance(llm, LLM):
        raise TypeError(f"llm must be a treedec LLM, got {type(llm).__name__}")
    for name, value in (("max_queued_requests", max_queued_requests), ("max_n", max_n), ("max_prompts", max_prompts),
                        ("max_body_bytes", max_body_bytes)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    for name, value in (("read_timeout", read_timeout), ("engine_iteration_timeout", engine_iteration_timeout),
                        ("chat_template_timeout", chat_template_timeout)):
        if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
            raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
    if allowed_hosts is not None and (isinstance(allowed_hosts, str) or not all(
            isinstance(h, str) and h for h in allowed_hosts)):
        raise ValueError(f"allowed_hosts must be a list of host names (or None), got {allowed_hosts!r}")
    name = served_model_name or llm.name
    metrics = ServeMetrics()
    limits = _Limits(max_queued_requests, max_n, max_prompts)
    if llm.tokenizer is not None:
        longest_token_chars(llm.tokenizer)   # (a tokenizer the server cannot bound raises here, not at startup)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        encoder = None if llm.tokenizer is None else PromptEncoder(llm.tokenizer, position_limit(llm.model),
                                                                  template_timeout=chat_template_timeout)
        online = OnlineEngine(llm.engine, llm.tokenizer, max_step_tokens=max_step_tokens,
                              drafts=None if llm.drafts is None else llm.drafts.source, seed=seed,
                              on_iteration=metrics.iteration,   # (one cache per engine: the LLM's if it keeps one)
                              prefix_cache=True if llm.prefix_cache is None else llm.prefix_cache)
        metrics.watch(online.scheduler)
        app.state.online = online
        app.state.server = _Server(llm, online, metrics, name, limits, encoder)
        if encoder is not None:
            encoder.start()
        try:
            yield
        finally:
            if not online.shutdown(timeout=_JOIN_SECONDS):
                logger.warning("the engine's thread did not stop within %g s (an iteration hangs?)", _JOIN_SECONDS)
            if encoder is not None:
                encoder.close()

    docs = {} if enable_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="treedec", lifespan=lifespan, **docs)
    app.state.metrics = metrics
    app.add_middleware(RequestLimits, metrics=metrics, max_body_bytes=max_body_bytes, read_timeout=read_timeout,
                       allowed_hosts=allowed_hosts)

    @app.exception_handler(ServeError)
    async def serve_error(request: Request, e: ServeError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(BodyError)
    async def body_error(request: Request, e: BodyError):
        return body_error_response(e.error)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}"
        return JSONResponse(ServeError(message, param=loc[0] if loc else None).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        error = _body_parse_error(e) or ServeError(str(e.detail), status=e.status_code)
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception):
        logger.exception("unexpected error answering %s", request.url.path)
        return JSONResponse(ServeError("internal server error", 500, "server_error").body(), status_code=500)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await request.app.state.server.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await request.app.state.server.chat(body, request)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": int(time.time()),
                                            "owned_by": "treedec", "max_model_len": position_limit(llm.model)}]}

    @app.get("/health")
    async def health(request: Request):
        online = request.app.state.online
        if not online.alive:
            raise ServeError("the engine is not running", 503, "server_error", code="engine_failed")
        busy = online.iteration_seconds
        if busy > engine_iteration_timeout:
            raise ServeError(f"the engine is stalled: its current iteration has run for {busy:.1f} s, more than "
                             f"{engine_iteration_timeout:g} s (engine_iteration_timeout)", 503, "server_error",
                             code="engine_stalled")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics_route():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


class _Limits:
    """The request counts a server takes (:func:`build_app`'s)."""

    def __init__(self, max_queued: int, max_n: int, max_prompts: int):
        self.max_queued, self.max_n, self.max_prompts = max_queued, max_n, max_prompts


class _Server:
    """The two generation routes over one online engine."""

    def __init__(self, llm: LLM, online: OnlineEngine, metrics: ServeMetrics, name: str, limits: _Limits,
                 encoder: PromptEncoder | None):
        self.llm, self.online, self.metrics, self.name, self.limits = llm, online, metrics, name, limits
        self.encoder, self.limit = encoder, position_limit(llm.model)
        self.reserved = 0   # outputs of the requests checked on arrival and not yet submitted (being encoded)

    async def completions(self, body: CompletionRequest, request: Request):
        self._check_model(body.model)
        prompts = body.prompts()
        slots = self._reserve(len(prompts), body.n)
        try:
            budget = body.token_budget()
            params = body.sampling_params(budget or 1)   # (every value checked before a prompt is encoded)
            texts = [p for p in prompts if isinstance(p, str)]
            for text in texts:   # (all of them before any is tokenized)
                self._encoder("prompt").check_length(text, "prompt")
            encoded = iter(await asyncio.gather(*(self._encoder("prompt").encode(t, False, "prompt") for t in texts)))
            ids = [params.truncated(next(encoded) if isinstance(p, str) else p, self.limit) for p in prompts]
            params = params.replace(max_tokens=self._budget(ids, budget, "prompt", body.budget_field))
            return await self._respond(request, body, ids, params, "cmpl", False, slots)
        finally:
            slots.release()

    async def chat(self, body: ChatCompletionRequest, request: Request):
        self._check_model(body.model)
        messages = body.conversation()
        slots = self._reserve(1, body.n)
        try:
            budget = body.token_budget()
            params = body.sampling_params(budget or 1)
            ids = [params.truncated(await self._encoder("messages").encode(messages, True, "messages"), self.limit)]
            params = params.replace(max_tokens=self._budget(ids, budget, "messages", body.budget_field))
            return await self._respond(request, body, ids, params, "chatcmpl", True, slots)
        finally:
            slots.release()

    # ------------------------------------------------ checks

    def _check_model(self, model: str) -> None:
        if model != self.name:
            shown = model if len(model) <= 100 else f"{model[:100]}... ({len(model)} characters)"
            raise ServeError(f"The model `{shown}` does not exist; this server serves `{self.name}`", 404,
                             param="model", code="model_not_found")
        if not self.online.alive:
            if self.online.error is None:
                raise ServeError("the server is shutting down", 503, "server_error", code="server_shutdown")
            raise ServeError("the engine is not running", 503, "server_error", code="engine_failed")

    def _reserve(self, prompts: int, n: int) -> "_Slots":
        """Check a request's counts on arrival (before any work) and hold its outputs' places in the queue until it
        is submitted."""
        limits = self.limits
        if n > limits.max_n:
            raise ServeError(f"n must be at most {limits.max_n} (this server's max_n), got {n}", param="n")
        if prompts > limits.max_prompts:
            raise ServeError(f"a request may hold at most {limits.max_prompts} prompts (this server's max_prompts), "
                             f"got {prompts}", param="prompt")
        outputs = prompts * max(n, 1)
        if outputs > limits.max_queued:
            raise ServeError(f"the request asks for {outputs} outputs ({prompts} prompt(s) x n={n}), more than the "
                             f"{limits.max_queued} this server queues (max_queued_requests)", param="n")
        waiting = self.online.waiting_outputs + self.reserved
        if waiting + outputs > limits.max_queued:
            raise ServeError(f"the server is overloaded: {waiting} outputs wait for admission, at most "
                             f"{limits.max_queued} may (max_queued_requests); retry later", 503, "server_error",
                             code="overloaded")
        return _Slots(self, outputs)

    def _encoder(self, what: str) -> PromptEncoder:
        if self.encoder is None:
            raise ServeError("this server has no tokenizer: give the prompt as token ids", param=what)
        return self.encoder

    def _budget(self, ids: list[list[int]], max_tokens: int | None, what: str, field: str) -> int:
        longest = max(len(p) for p in ids)
        if max_tokens is None:
            max_tokens = self.limit - longest
        if longest + max(max_tokens, 0) > self.limit or max_tokens < 1:
            raise ServeError(f"This model's maximum context length is {self.limit} tokens. However, you requested "
                             f"{longest + max(max_tokens, 0)} tokens ({longest} in the {what}, {max_tokens} in the "
                             f"completion). Please reduce the length of the {what} or the completion.",
                             param=what if longest >= self.limit else field, code="context_length_exceeded")
        return max_tokens

    # ------------------------------------------------ running

    async def _respond(self, request: Request, body, ids: list[list[int]], params, prefix: str, chat: bool,
                       slots: "_Slots"):
        rid, arrival = f"{prefix}-{uuid.uuid4().hex}", time.perf_counter()
        streams, submitted = [], []
        try:
            for k, prompt_ids in enumerate(ids):
                spec = RequestSpec(f"{rid}-{k}", prompt_ids=prompt_ids, params=params)
                streams.append(self.online.submit(spec))
                submitted.append(spec.id)
        except BaseException as e:
            for spec_id in submitted:
                self.online.abort(spec_id)
            raise _request_error(e, "messages" if chat else "prompt") from None
        finally:
            slots.release()   # (the engine counts them now)
        choices = Choices(rid, self.name, params.n, chat, body.return_token_ids)
        run = _Run(self, streams, submitted, arrival)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(self._events(run, choices, include_usage), media_type="text/event-stream")
        task = asyncio.ensure_future(run.collect())
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.2)
            if done:
                break
            if await request.is_disconnected():
                run.abort()
                task.cancel()
                return Response(status_code=499)   # (nobody reads it)
        try:
            results = task.result()
        except Exception as e:
            raise _request_error(e) from None
        tokenizer = self.llm.tokenizer
        logprobs = (lambda r: chat_logprobs(r, tokenizer, params.logprobs)) if chat else \
            (lambda r: completion_logprobs(r, tokenizer, params.logprobs))
        return choices.response(results, None if params.logprobs is None else logprobs)

    async def _events(self, run: "_Run", choices: Choices, include_usage: bool) -> AsyncIterator[str]:
        try:
            if choices.chat:
                yield _event(choices.chunk([choices.delta(k * choices.n + j, {"role": "assistant", "content": ""})
                                            for k in range(len(run.streams)) for j in range(choices.n)]))
            async for k, item in run.items():
                if item.finished:
                    yield _event(choices.chunk([choices.finish(k * choices.n + r.index, r)
                                                for r in item.results]))
                elif item.text:
                    index = k * choices.n + item.index
                    yield _event(choices.chunk([choices.delta(index, {"content": item.text}) if choices.chat
                                                else choices.text(index, item.text)]))
            if include_usage:
                yield _event(choices.chunk([], usage(run.results)))
        except Exception as e:
            yield _event(_request_error(e).body())
        finally:   # (also when the client went away: the response's task is cancelled)
            run.abort()
        yield "data: [DONE]\n\n"


class _Run:
    """One HTTP request's engine requests (one per prompt): their merged stream items, results and metrics."""

    def __init__(self, server: _Server, streams: list, ids: list[str], arrival: float):
        self.server, self.streams, self.ids, self.arrival = server, streams, ids, arrival
        self.first: list[float | None] = [None] * len(streams)
        self.results: list[list[RequestResult] | None] = [None] * len(streams)

    async def items(self):
        """``(prompt index, StreamOutput)`` of every stream as they come; raises a stream's error."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(k: int, stream) -> None:
            try:
                async for item in stream:
                    await queue.put((k, item, None))
            except Exception as e:
                await queue.put((k, None, e))
            else:
                await queue.put((k, None, None))

        tasks = [asyncio.ensure_future(pump(k, s)) for k, s in enumerate(self.streams)]
        try:
            left = len(tasks)
            while left:
                k, item, error = await queue.get()
                if error is not None:
                    raise error
                if item is None:
                    left -= 1
                    continue
                now = time.perf_counter()
                if item.text and self.first[k] is None:
                    self.first[k] = now
                if item.finished:
                    self.results[k] = item.results
                    self.server.metrics.finished(item.results, self.arrival, self.first[k], now)
                yield k, item
        finally:
            for task in tasks:
                task.cancel()

    async def collect(self) -> list[list[RequestResult]]:
        async for _ in self.items():
            pass
        return self.results

    def abort(self) -> None:
        """Abort the requests still running (their pages are freed at the engine's next iteration)."""
        for k, spec_id in enumerate(self.ids):
            if self.results[k] is None:
                self.server.online.abort(spec_id)


def _request_error(e: BaseException, param: str | None = None) -> ServeError:
    """What the client is told of a failed request (``param``: the field of its prompt)."""
    if isinstance(e, ServeError):
        return e
    if isinstance(e, PoolExhaustedError):
        return ServeError(f"the request does not fit the server's KV cache: {e}", code="kv_cache_exceeded")
    if isinstance(e, (ValueError, TypeError)):   # (the engine's checks start with the field they name)
        field = str(e).split(" ", 1)[0]
        return ServeError(str(e), param={"prompt_ids": param, "stop_token_ids": "stop_token_ids"}.get(field))
    if isinstance(e, ProgramAborted):   # (a client's own abort is never answered: it went away)
        return ServeError("the server is shutting down: the request was aborted", 503, "server_error",
                          code="server_shutdown")
    logger.error("request failed in the engine: %s: %s", type(e).__name__, e)   # (an engine step)
    return ServeError(f"the engine failed: {type(e).__name__}", 503, "server_error", code="engine_failed")


def _body_parse_error(e: HTTPException) -> ServeError | None:
    """What was wrong with a body FastAPI could not parse (it says only "There was an error parsing the body" and
    keeps the reason as the exception's cause); None for any other HTTPException."""
    cause = e.__cause__
    if e.status_code != 400 or cause is None:
        return None
    if isinstance(cause, UnicodeDecodeError):
        return ServeError(f"the request body is not UTF-8 text (JSON must be): {cause.reason} at byte {cause.start}")
    if isinstance(cause, RecursionError):
        return ServeError("the request body's JSON nests too deeply for the server's parser (about 1000 levels of "
                          "arrays and objects at most)")
    if isinstance(cause, ValueError) and "integer string conversion" in str(cause):
        return ServeError(f"the request body holds an integer of too many digits ({cause})")
    return None


def _event(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


class _Slots:
    """A request's outputs held in the queue's count (:meth:`_Server._reserve`) until released (once)."""

    def __init__(self, server: _Server, outputs: int):
        self.server, self.outputs = server, outputs
        server.reserved += outputs

    def release(self) -> None:
        self.server.reserved -= self.outputs
        self.outputs = 0
