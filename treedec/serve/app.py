"""The OpenAI-compatible HTTP app: :func:`build_app` over one engine core (:mod:`treedec.core.engine_core`).

The app is the server's frontend: HTTP, tokenization and chat templates, the responses and their streams, metrics.
One engine core serves every request, through a :class:`~treedec.core.client.CoreClient`: in a process of its
own (:class:`~treedec.core.process_client.ProcessClient`, ``treedec serve``'s default) or in this one, over an
:class:`~treedec.LLM` built here (:class:`~treedec.core.client.InProcessClient`); started when the app starts,
shut down (every request aborted, its pages freed) when it stops. Each engine iteration's news reaches the app as
one message, handled at once for every request it advanced. Routes: ``POST
/v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``, ``POST /tokenize``, ``POST /detokenize``
(:mod:`treedec.serve.tokenize`), ``GET /version``, ``GET /health``, ``GET /metrics`` (:mod:`treedec.serve.metrics`);
``/docs``, ``/redoc`` and ``/openapi.json`` only with ``enable_docs``. With ``api_key`` every route but ``/health``
and ``/metrics`` (those too with ``secure_metrics``) needs it as a bearer token (:mod:`treedec.serve.auth`).

A stream gives each choice's text as it comes and ends each choice with one chunk carrying its finish reason and its
last text, when that choice ends (with ``n > 1`` each choice its own, as vLLM's); a speculative request's text is
streamed before its end is known, so its ending chunk may have no text. ``stream_options.continuous_usage_stats``
(with ``include_usage``) gives every chunk its usage (the prompt's tokens and the choice's so far, vLLM's).

No request can hurt the others: every size a client controls is bounded before the work it costs is done. The
headers and the body by :class:`~treedec.serve.limits.RequestLimits` (host, bytes, arrival); the counts (``n``,
prompts, outputs queued) on arrival; a text prompt's length before it is tokenized, and the tokenizer and the chat
template off the event loop (:class:`~treedec.serve.prompts.PromptEncoder`); the KV pages a request may need at
worst before it is queued (:meth:`OnlineEngine.submit`, in the core). A generated request's token ids stream back
from the core and its text is made here (:mod:`treedec.core.output_processor`: stop strings matched here, the request
aborted in the core when they end it); a speculative request's and a beam search's text streams back from the core.

Errors are OpenAI's JSON (``{"error": {"message", "type", "param", "code"}}``), never a traceback: 401 without the
API key (``"invalid_api_key"``); 400 for a bad
parameter or body (FastAPI's 422 included; a body that is not UTF-8, nests too deeply or holds a too-long integer
says so), for a prompt past the model's positions (``code: "context_length_exceeded"``), for a request larger than
the server takes (``n``, prompts, outputs) or than its KV cache holds (``"kv_cache_exceeded"``), for a chat template
that fails or runs past its budget (``"chat_template_failed"``) and for a Host header a loopback server does not
answer (``"invalid_host"``); 404 for another model's name (``"model_not_found"``) or route; 408 for a body that stops
arriving (``"request_timeout"``); 413 for a body over ``max_body_bytes`` (``"request_too_large"``: by its
Content-Length, or as its bytes arrive); 503 when ``max_queued_requests`` outputs wait for admission
(``"overloaded"``), the engine failed or its core's process is gone (``"engine_failed"``: every request in flight
is answered so, and ``/health`` too from then on; a core started again, ``--max-core-restarts``: ``"engine_restarting"``
until it runs), the server shuts down (``"server_shutdown"``), and from ``/health`` when the engine's iteration has
run longer than ``engine_iteration_timeout`` (``"engine_stalled"``); 500 (logged here) for anything unexpected. A
client that disconnects, streaming or not, aborts its requests (their pages are freed at the engine's next
iteration). A streamed request that fails after its first chunk ends with an ``error`` event, then ``[DONE]``.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from typing import AsyncIterator, Sequence, Sized

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

import treedec
from treedec.llm import LLM
from treedec.serve.auth import APIKeyAuth, check_api_key
from treedec.core.client import CoreClient, InProcessClient
from treedec.serve.errors import body_parse_error, not_running_error, request_error
from treedec.runtime.requests import RequestResult
from treedec.serve.limits import BodyError, QueueLimits, QueueSlots, RequestLimits, body_error_response
from treedec.serve.metrics import CONTENT_TYPE_LATEST, ServeMetrics
from treedec.serve.prompts import PromptEncoder, longest_token_chars
from treedec.serve.protocol import (BODY_TAGS, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                   ServeError, TokenizeCompletionRequest, TokenizeRequest)
from treedec.serve.structured import grammar_error
from treedec.serve.tokenize import detokenize, tokenize
from treedec.serve.responses import Choices, chat_logprobs, completion_logprobs, prompt_logprobs, usage

__all__ = ["build_app"]

logger = logging.getLogger("treedec.serve")

#: Seconds the app's end waits for the engine's thread (an iteration that hangs is left to die with the process).
_JOIN_SECONDS = 10.0


def build_app(engine: LLM | CoreClient, served_model_name: str | None = None, *, max_queued_requests: int = 1024,
              max_n: int = 128, max_prompts: int = 256, max_body_bytes: int = 8 * 2**20,
              read_timeout: float | None = 30.0, engine_iteration_timeout: float = 60.0,
              chat_template_timeout: float = 5.0,
              allowed_hosts: Sequence[str] | None = None, enable_docs: bool = False,
              max_step_tokens: int | None = None, seed: int = 0, api_key: str | None = None,
              secure_metrics: bool = False) -> FastAPI:
    """The FastAPI app serving ``engine``: an :class:`~treedec.LLM` (its model, tokenizer, engine and speculative
    config: with one, every request is decoded speculatively, and one it cannot take is answered 400), served by an
    engine core in this process; or a :class:`~treedec.core.client.CoreClient` (a
    :class:`~treedec.core.process_client.ProcessClient`: the core in its own process), started with the app if it was
    not.

    Parameters
    ----------
    served_model_name : the ``model`` requests must name (default the LLM's name).
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
    max_step_tokens : prompt tokens a step computes at most (:class:`~treedec.runtime.online.OnlineScheduler`);
        an LLM's core only (a ProcessClient is given its own).
    seed : the seeds of sampled requests without one (the same).
    api_key : every route but ``/health`` and ``/metrics`` needs ``Authorization: Bearer <api_key>`` (401
        otherwise: :class:`~treedec.serve.auth.APIKeyAuth`); None: no key.
    secure_metrics : with ``api_key``, ``/health`` and ``/metrics`` need it too.

    ``app.state.online`` is the :class:`~treedec.core.client.CoreClient` while the app runs,
    ``app.state.metrics`` its :class:`~treedec.serve.metrics.ServeMetrics`.
    """
    if isinstance(engine, LLM) and engine.engine_process:   # (its engine is in its own core's process)
        raise ValueError("build_app serves an LLM built in this process (engine_process=False), or a CoreClient "
                         "(a ProcessClient of its own core); an LLM(engine_process=True)'s core is its own client's")
    if isinstance(engine, LLM):
        client: CoreClient = InProcessClient(engine, max_step_tokens=max_step_tokens, seed=seed)
    elif isinstance(engine, CoreClient):
        client = engine
    else:
        raise TypeError(f"engine must be a treedec LLM or a CoreClient, got {type(engine).__name__}")
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
    if api_key is not None:
        check_api_key(api_key)
    if secure_metrics and api_key is None:
        raise ValueError("secure_metrics puts /health and /metrics behind the API key: give api_key too")
    metrics = ServeMetrics()
    limits = QueueLimits(max_queued_requests, max_n, max_prompts)
    if isinstance(engine, LLM) and engine.tokenizer is not None:
        longest_token_chars(engine.tokenizer)   # (a tokenizer the server cannot bound raises here, not at startup)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        client.on_iteration = metrics.iteration
        metrics.watch(client)
        app.state.online = client
        await client.start()
        try:
            ready, tokenizer = client.ready, client.tokenizer
            metrics.batch_invariant.set(int(ready.batch_invariant))
            if tokenizer is not None:
                longest_token_chars(tokenizer)
            encoder = None if tokenizer is None else PromptEncoder(tokenizer, ready.max_model_len,
                                                                   template_timeout=chat_template_timeout)
            app.state.server = _Server(client, metrics, served_model_name or ready.name, limits, encoder)
            if encoder is not None:
                encoder.start()
            try:
                yield
            finally:
                if encoder is not None:
                    encoder.close()
        finally:
            if not await client.close(timeout=_JOIN_SECONDS):
                logger.warning("the engine core did not stop within %g s (an iteration hangs?)", _JOIN_SECONDS)

    docs = {} if enable_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="treedec", lifespan=lifespan, **docs)
    app.state.metrics = metrics
    if api_key is not None:   # (inside RequestLimits: a refused request's Host and size are checked, it is counted)
        app.add_middleware(APIKeyAuth, api_key=api_key, secure_metrics=secure_metrics)
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
        loc = [str(x) for x in first.get("loc", ()) if x != "body" and x not in BODY_TAGS]
        message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}"
        return JSONResponse(ServeError(message, param=loc[0] if loc else None).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        error = body_parse_error(e) or ServeError(str(e.detail), status=e.status_code)
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
    async def models(request: Request):
        server = request.app.state.server
        return {"object": "list", "data": [{"id": server.name, "object": "model", "created": int(time.time()),
                                            "owned_by": "treedec", "max_model_len": server.limit}]}

    @app.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest, request: Request):
        server = request.app.state.server
        server.check_name(body.model)
        return await tokenize(server.encoder_for("prompt" if isinstance(body, TokenizeCompletionRequest)
                                                 else "messages"), body, server.limit)

    @app.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest, request: Request):
        server = request.app.state.server
        server.check_name(body.model)
        return await detokenize(server.encoder_for("tokens"), body, server.vocab)

    @app.get("/version")
    async def version():
        return {"version": treedec.__version__}

    @app.get("/health")
    async def health(request: Request):
        online = request.app.state.online
        if not online.alive:
            raise not_running_error(online, health=True)
        busy = online.iteration_seconds
        if busy > engine_iteration_timeout:
            raise ServeError(f"the engine is stalled: its current iteration has run for {busy:.1f} s, more than "
                             f"{engine_iteration_timeout:g} s (engine_iteration_timeout)", 503, "server_error",
                             code="engine_stalled")
        return {"status": "ok", "engine_restarts": online.restarts}

    @app.get("/metrics")
    async def metrics_route():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


class _Server:
    """The two generation routes over one engine core."""

    def __init__(self, online: CoreClient, metrics: ServeMetrics, name: str, limits: QueueLimits,
                 encoder: PromptEncoder | None):
        self.online, self.metrics, self.name, self.limits = online, metrics, name, limits
        self.tokenizer, self.speculative = online.tokenizer, online.ready.speculative
        self.encoder, self.limit = encoder, online.ready.max_model_len
        vocab = online.ready.vocab_size   # (a padded embedding's ids past the tokenizer have no text)
        self.vocab = min(vocab, len(self.tokenizer)) if isinstance(self.tokenizer, Sized) else vocab
        self.reserved = 0   # outputs of the requests checked on arrival and not yet submitted (being encoded)

    async def completions(self, body: CompletionRequest, request: Request):
        self._check_model(body.model)
        prompts = body.prompts()
        slots = self._reserve(len(prompts), body.n)
        try:
            budget = body.token_budget()
            params = body.sampling_params(budget or 1)   # (every value checked before a prompt is encoded)
            body.beam_params(budget or 1)
            texts = [p for p in prompts if isinstance(p, str)]
            for text in texts:   # (all of them before any is tokenized)
                self.encoder_for("prompt").check_length(text, "prompt")
            encoder = self.encoder_for("prompt") if texts else None
            encoded = iter(await asyncio.gather(*(encoder.encode(t, False, "prompt") for t in texts)))
            ids = [params.truncated(next(encoded) if isinstance(p, str) else p, self.limit) for p in prompts]
            params = params.replace(max_tokens=self._budget(ids, budget, "prompt", body.budget_field))
            echo = None
            if body.echo:   # (a text as given, token ids or a truncated text as their text)
                encoder = self.encoder_for("echo")
                echo = [p if isinstance(p, str) and params.truncate_prompt_tokens is None else
                        await encoder.decode(i, "prompt", self.vocab, params.skip_special_tokens)
                        for p, i in zip(prompts, ids)]
            return await self._respond(request, body, ids, params, "cmpl", False, slots, echo)
        finally:
            slots.release()

    async def chat(self, body: ChatCompletionRequest, request: Request):
        self._check_model(body.model)
        messages = body.conversation()
        slots = self._reserve(1, body.n)
        try:
            budget = body.token_budget()
            params = body.sampling_params(budget or 1)
            body.beam_params(budget or 1)
            ids = [params.truncated(await self.encoder_for("messages").encode(messages, True, "messages"), self.limit)]
            params = params.replace(max_tokens=self._budget(ids, budget, "messages", body.budget_field))
            return await self._respond(request, body, ids, params, "chatcmpl", True, slots)
        finally:
            slots.release()

    # ------------------------------------------------ checks

    def check_name(self, model: str | None) -> None:
        """A request's ``model``: the served name (None: left out, where a route allows it), else 404."""
        if model is not None and model != self.name:
            shown = model if len(model) <= 100 else f"{model[:100]}... ({len(model)} characters)"
            raise ServeError(f"The model `{shown}` does not exist; this server serves `{self.name}`", 404,
                             param="model", code="model_not_found")

    def _check_model(self, model: str) -> None:
        self.check_name(model)
        if not self.online.alive:
            raise not_running_error(self.online)

    def _reserve(self, prompts: int, n: int) -> QueueSlots:
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
        return QueueSlots(self, outputs)

    def encoder_for(self, what: str) -> PromptEncoder:
        """The prompt encoder (ServeError naming ``what`` on a server without a tokenizer)."""
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
                       slots: QueueSlots, echo: list[str] | None = None):
        rid, arrival = f"{prefix}-{uuid.uuid4().hex}", time.perf_counter()
        beam = body.beam_params(params.max_tokens)
        if beam is not None:   # (greedy: no seed is drawn for it)
            params = params.replace(temperature=0.0)
        submitted = [f"{rid}-{k}" for k in range(len(ids))]
        try:   # (every prompt sent at once; each accepted or refused by the core's next message)
            streams = await asyncio.gather(*(self.online.submit(spec_id, prompt_ids, params, beam)
                                             for spec_id, prompt_ids in zip(submitted, ids)), return_exceptions=True)
        finally:
            slots.release()   # (the engine counts them now)
        errors = [s for s in streams if isinstance(s, BaseException)]
        if errors:
            for spec_id, stream in zip(submitted, streams):
                if not isinstance(stream, BaseException):
                    self.online.abort(spec_id)
            error = grammar_error(errors[0], body.structured_field) if params.structured_outputs is not None \
                else None   # (compiled by the core as it takes the request, off its engine's thread: refused there)
            raise (error or request_error(errors[0], "messages" if chat else "prompt")) from None
        choices = Choices(rid, self.name, params.n, chat, body.return_token_ids, ids, echo)
        run = _Run(self, streams, submitted, arrival)
        if body.stream:
            options = body.stream_options
            return StreamingResponse(self._events(run, choices, options is not None and options.include_usage,
                                                  options is not None and options.continuous_usage_stats),
                                     media_type="text/event-stream")
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
            raise request_error(e) from None
        tokenizer = self.tokenizer
        logprobs = (lambda r: chat_logprobs(r, tokenizer, params.logprobs)) if chat else \
            (lambda r: completion_logprobs(r, tokenizer, params.logprobs, echo is not None))
        return choices.response(results, None if params.logprobs is None else logprobs,
                                None if body.prompt_logprobs is None else (lambda r: prompt_logprobs(r, tokenizer)))

    async def _events(self, run: "_Run", choices: Choices, include_usage: bool,
                      continuous: bool) -> AsyncIterator[str]:
        """The stream's events: text deltas; a choice's end (its finish reason with its last text) when it ends,
        each choice its own; with ``continuous`` (``continuous_usage_stats``) every chunk's usage."""
        try:
            if choices.chat:
                yield _event(choices.first_chunk(choices.running_usage(0, 0) if continuous else None))
            for k, text in enumerate(choices.echo or ()):   # (echo: each choice's first chunk is its prompt's text)
                for j in range(choices.n):
                    yield _event(choices.chunk([choices.text(k * choices.n + j, text)],
                                               choices.running_usage(k, 0) if continuous else None))
            async for k, item in run.items():
                index = k * choices.n + (item.index or 0)
                if item.ended:
                    choice = choices.end(index, k, item.text, item.stop_reason, item.token_ids)
                elif item.text:
                    choice = choices.delta(index, {"content": item.text}) if choices.chat else \
                        choices.text(index, item.text)
                else:   # (the final item: every choice has ended)
                    continue
                yield _event(choices.chunk([choice], choices.running_usage(k, item.tokens) if continuous else None))
            if include_usage:
                yield _event(choices.chunk([], usage(run.results)))
        except Exception as e:
            yield _event(request_error(e).body())
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


def _event(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"
