"""The OpenAI-compatible HTTP app: :func:`build_app` over one :class:`~treedec.LLM`'s engine.

One :class:`~treedec.search.online.OnlineEngine` (one thread driving the engine) serves every request: started
when the app starts, shut down (every request aborted, its pages freed) when it stops. A request's prompts are
encoded and checked on the event loop, then submitted; its text streams back from the engine's thread. Routes:
``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health``, ``GET /metrics``
(:mod:`treedec.serve.metrics`).

Errors are OpenAI's JSON (``{"error": {"message", "type", "param", "code"}}``), never a traceback: 400 for a bad
parameter or body (FastAPI's 422 included) and for a prompt past the model's positions (``code:
"context_length_exceeded"``), 404 for another model's name (``code: "model_not_found"``) or route, 413 for a body
over ``max_body_bytes`` (by its Content-Length), 503 when ``max_queued_requests`` requests wait for admission or the
engine failed, 500 (logged here) for anything unexpected. A client that disconnects, streaming or not, aborts its
requests (their pages are freed at the engine's next iteration). A streamed request that fails after its first
chunk ends with an ``error`` event, then ``[DONE]``.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from treedec.errors import PoolExhaustedError
from treedec.llm import LLM
from treedec.models.text import encode_prompt
from treedec.search.online import OnlineEngine
from treedec.search.request import position_limit
from treedec.search.requests_file import RequestResult, RequestSpec
from treedec.serve.metrics import CONTENT_TYPE_LATEST, ServeMetrics
from treedec.serve.protocol import ChatCompletionRequest, CompletionRequest, ServeError
from treedec.serve.responses import Choices, chat_logprobs, completion_logprobs, usage

__all__ = ["build_app"]

logger = logging.getLogger("treedec.serve")


def build_app(llm: LLM, served_model_name: str | None = None, *, max_queued_requests: int = 1024,
              max_body_bytes: int = 32 * 2**20, max_step_tokens: int | None = None, seed: int = 0) -> FastAPI:
    """The FastAPI app serving ``llm`` (its model, tokenizer, engine and speculative config: with one, every request
    is decoded speculatively, and one it cannot take is answered 400).

    Parameters
    ----------
    served_model_name : the ``model`` requests must name (default ``llm.name``).
    max_queued_requests : requests that may wait for admission; one more is answered 503.
    max_body_bytes : the largest request body (413 past it).
    max_step_tokens : prompt tokens a step computes at most (:class:`~treedec.search.online.OnlineScheduler`).
    seed : the seeds of sampled requests without one.

    ``app.state.online`` is the :class:`~treedec.search.online.OnlineEngine` while the app runs, ``app.state.metrics``
    its :class:`~treedec.serve.metrics.ServeMetrics`.
    """
    if not isinstance(llm, LLM):
        raise TypeError(f"llm must be a treedec LLM, got {type(llm).__name__}")
    for name, value in (("max_queued_requests", max_queued_requests), ("max_body_bytes", max_body_bytes)):
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    name = served_model_name or llm.name
    metrics = ServeMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        online = OnlineEngine(llm.engine, llm.tokenizer, max_step_tokens=max_step_tokens,
                              drafts=None if llm.drafts is None else llm.drafts.source, seed=seed,
                              on_iteration=metrics.iteration,   # (one cache per engine: the LLM's if it keeps one)
                              prefix_cache=True if llm.prefix_cache is None else llm.prefix_cache)
        metrics.watch(online.scheduler)
        app.state.online = online
        app.state.server = _Server(llm, online, metrics, name, max_queued_requests)
        try:
            yield
        finally:
            online.shutdown()

    app = FastAPI(title="treedec", lifespan=lifespan)
    app.state.metrics = metrics
    app.add_middleware(_Limits, metrics=metrics, max_body_bytes=max_body_bytes)

    @app.exception_handler(ServeError)
    async def serve_error(request: Request, e: ServeError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}"
        return JSONResponse(ServeError(message, param=loc[0] if loc else None).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        return JSONResponse(ServeError(str(e.detail), status=e.status_code).body(), status_code=e.status_code)

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
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics_route():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


class _Server:
    """The two generation routes over one online engine."""

    def __init__(self, llm: LLM, online: OnlineEngine, metrics: ServeMetrics, name: str, max_queued: int):
        self.llm, self.online, self.metrics, self.name, self.max_queued = llm, online, metrics, name, max_queued
        self.limit = position_limit(llm.model)

    async def completions(self, body: CompletionRequest, request: Request):
        self._check_model(body.model)
        prompts = body.prompts()
        ids = body.truncate([self._encode(p, False) if isinstance(p, str) else list(p) for p in prompts], self.limit)
        params = body.sampling_params(self._budget(ids, body.max_tokens, "prompt"))
        return await self._respond(request, body, ids, params, "cmpl", chat=False)

    async def chat(self, body: ChatCompletionRequest, request: Request):
        self._check_model(body.model)
        ids = body.truncate([self._encode(body.conversation(), True)], self.limit)
        params = body.sampling_params(self._budget(ids, body.token_budget(), "messages"))
        return await self._respond(request, body, ids, params, "chatcmpl", chat=True)

    # ------------------------------------------------ checks

    def _check_model(self, model: str) -> None:
        if model != self.name:
            raise ServeError(f"The model `{model}` does not exist; this server serves `{self.name}`", 404,
                             param="model", code="model_not_found")
        if not self.online.alive:
            raise ServeError("the engine is not running", 503, "server_error", code="engine_failed")
        if self.online.scheduler.num_waiting >= self.max_queued:
            raise ServeError(f"the server is overloaded: {self.max_queued} requests wait for admission; retry later",
                             503, "server_error", code="overloaded")

    def _encode(self, prompt, chat: bool) -> list[int]:
        if self.llm.tokenizer is None:
            raise ServeError("this server has no tokenizer: give the prompt as token ids", param="prompt")
        try:
            return encode_prompt(self.llm.tokenizer, prompt, chat)
        except (ValueError, TypeError) as e:
            raise ServeError(str(e), param="messages" if chat else "prompt") from None

    def _budget(self, ids: list[list[int]], max_tokens: int | None, what: str) -> int:
        longest = max(len(p) for p in ids)
        if max_tokens is None:
            max_tokens = self.limit - longest
        if longest + max(max_tokens, 0) > self.limit or max_tokens < 1 and longest >= self.limit:
            raise ServeError(f"This model's maximum context length is {self.limit} tokens. However, you requested "
                             f"{longest + max(max_tokens, 0)} tokens ({longest} in the {what}, {max_tokens} in the "
                             f"completion). Please reduce the length of the {what} or the completion.",
                             param=what, code="context_length_exceeded")
        return max_tokens

    # ------------------------------------------------ running

    async def _respond(self, request: Request, body, ids: list[list[int]], params, prefix: str, chat: bool):
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
            raise _request_error(e) from None
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


def _request_error(e: BaseException) -> ServeError:
    """What the client is told of a failed request."""
    if isinstance(e, ServeError):
        return e
    if isinstance(e, PoolExhaustedError):
        return ServeError(f"the request does not fit the server's KV cache: {e}", code="kv_cache_exceeded")
    if isinstance(e, (ValueError, TypeError)):
        return ServeError(str(e))
    logger.error("request failed in the engine: %s: %s", type(e).__name__, e)   # (an engine step, or shut down)
    return ServeError(f"the engine failed: {type(e).__name__}", 503, "server_error", code="engine_failed")


def _event(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


class _Limits:
    """ASGI middleware: 413 for a body over ``max_body_bytes`` (by its Content-Length), and every answered
    request counted by route and status."""

    def __init__(self, app, metrics: ServeMetrics, max_body_bytes: int):
        self.app, self.metrics, self.max_body_bytes = app, metrics, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        route = path if path in _ROUTES else "other"
        length = dict(scope.get("headers", ())).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            error = ServeError(f"the request body has {int(length)} bytes, more than the server's limit of "
                               f"{self.max_body_bytes}", 413, code="request_too_large")
            self.metrics.requests.labels(route, "413").inc()
            return await JSONResponse(error.body(), status_code=413)(scope, receive, send)
        status = []

        async def counted(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
                self.metrics.requests.labels(route, str(message["status"])).inc()
            await send(message)

        try:
            await self.app(scope, receive, counted)
        except Exception:
            if not status:
                self.metrics.requests.labels(route, "500").inc()
            raise


_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"})
