"""The soak's load (``bench/soak.py``): seeded mixed requests against a ``treedec serve`` over loopback with httpx,
some of them cut off by their client, at a bounded concurrency.

:func:`draw` makes request ``k`` of a run from its seed (:class:`Spec`): ``/v1/completions`` or
``/v1/chat/completions``, streamed or not, ``n`` 1-3, a stop string or none, ``max_tokens`` from a small set, greedy
or sampled with a seed (the same few prompts and values again and again, so that every completed request can be
compared with the same request sent alone: :func:`reference`), and what its client does: reads it to its end, goes
away after a few chunks (``disconnect``: the stream closed) or drops it after a random delay (``abort``: the
request's task cancelled, its connection closed, streamed or not). :func:`run_one` sends one and checks what came
back as it comes (:class:`Outcome`: its texts and finish reasons per choice, and what was malformed: a choice twice,
text after a choice's end, a choice missing); :func:`drive` runs ``concurrency`` clients until a deadline or a count.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx

__all__ = ["Outcome", "Spec", "draw", "drive", "reference", "run_one"]

# (few values: a long run's keys stay ~1300, each sent once alone for its reference)
PROMPTS = ["The quick brown fox", "Hello world! hello there", "Stop here, then go on.", "café crème brûlée",
           "newlines and numbers 12345", "emoji party and naïve façade"]
MAX_TOKENS = (1, 4, 16, 40)
STOPS = (None, [" the"], ["o", "xyz"])

#: Seconds a client waits before sending again after ``engine_restarting`` (the core is being rebuilt).
RETRY_SECONDS = 0.2

#: Seconds after which a request that got no answer is recorded as lost (``client_timeout``), not waited for.
LOST_SECONDS = 180.0


@dataclass(frozen=True)
class Spec:
    """One request of the soak and what its client does with it (``action``: ``"complete"``, ``"disconnect"``
    after ``cut`` chunks, ``"abort"`` after ``abort_after`` seconds)."""

    k: int
    chat: bool
    prompt: str
    stream: bool
    n: int
    max_tokens: int
    stop: tuple[str, ...] | None
    temperature: float
    seed: int | None
    action: str
    cut: int = 0
    abort_after: float = 0.0

    @property
    def route(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"

    @property
    def key(self) -> tuple:
        """What its text depends on (greedy, or a seed): the requests of one key give the same texts."""
        return self.chat, self.prompt, self.n, self.max_tokens, self.stop, self.temperature, self.seed

    def body(self, model: str, stream: bool | None = None) -> dict:
        body = {"model": model, "n": self.n, "max_tokens": self.max_tokens, "temperature": self.temperature,
                "stream": self.stream if stream is None else stream}
        body.update({"messages": [{"role": "user", "content": self.prompt}]} if self.chat else {"prompt": self.prompt})
        if self.stop is not None:
            body["stop"] = list(self.stop)
        if self.seed is not None:
            body["seed"] = self.seed
        return body


def draw(rng: random.Random, k: int) -> Spec:
    """Request ``k`` of a run (``rng``: the run's, drawn in order)."""
    sampled = rng.random() < 0.4
    action = rng.choices(("complete", "disconnect", "abort"), (0.7, 0.15, 0.15))[0]
    stream = rng.random() < 0.6 or action == "disconnect"
    return Spec(k, rng.random() < 0.4, rng.choice(PROMPTS), stream, rng.choices((1, 2, 3), (0.6, 0.3, 0.1))[0],
                rng.choice(MAX_TOKENS), None if (s := rng.choice(STOPS)) is None else tuple(s),
                0.8 if sampled else 0.0, rng.randint(1, 2) if sampled else None, action, rng.randint(1, 6),
                rng.uniform(0.01, 0.5))


@dataclass
class Outcome:
    """What one request got: ``status`` ``"completed"``, ``"disconnected"``, ``"aborted"`` or ``"error"``
    (``code``: the OpenAI error's code, ``http``: the HTTP status), per choice its text and finish reason, the
    response's ``id``, and ``problems``: what was malformed (a completed request's choices must each be there once,
    with one finish reason, no text after it)."""

    spec: Spec
    started: float
    ended: float = 0.0
    status: str = "error"
    http: int | None = None
    code: str | None = None
    id: str | None = None
    texts: list[str] = field(default_factory=list)
    reasons: list[str | None] = field(default_factory=list)
    completion_tokens: int | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return self.ended - self.started


def _error_code(data: dict | None) -> str | None:
    error = data.get("error") if isinstance(data, dict) else None
    return error.get("code") if isinstance(error, dict) else None


async def run_one(client: httpx.AsyncClient, model: str, spec: Spec) -> Outcome:
    """Send ``spec`` and read its answer as its client would (see the module docstring)."""
    out = Outcome(spec, time.monotonic(), texts=[""] * spec.n, reasons=[None] * spec.n)
    try:
        if spec.action == "abort":
            await asyncio.wait_for(_exchange(client, model, spec, out), spec.abort_after)
        else:
            await _exchange(client, model, spec, out)
    except asyncio.TimeoutError:
        out.status = "aborted"
    except httpx.HTTPError as e:   # (a connection refused or reset: the server went away)
        out.status, out.code = "error", f"http:{type(e).__name__}"
    out.ended = time.monotonic()
    return out


async def _exchange(client: httpx.AsyncClient, model: str, spec: Spec, out: Outcome) -> None:
    if not spec.stream:
        reply = await client.post(spec.route, json=spec.body(model))
        out.http = reply.status_code
        data = reply.json()
        if reply.status_code != 200:
            out.code = _error_code(data) or f"http:{reply.status_code}"
            return
        _take_response(spec, data, out)
        out.status = "completed"
        return
    async with client.stream("POST", spec.route, json=spec.body(model)) as reply:
        out.http = reply.status_code
        if reply.status_code != 200:
            out.code = _error_code(json.loads(await reply.aread())) or f"http:{reply.status_code}"
            return
        chunks, done = 0, False
        async for line in reply.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            data = json.loads(line[6:])
            if "error" in data:   # (a streamed request that failed after its first chunk)
                out.code = _error_code(data) or "stream_error"
                return
            chunks += 1
            _take_chunk(spec, data, out)
            if spec.action == "disconnect" and chunks >= spec.cut:
                out.status = "disconnected"   # (the stream closed by leaving the block: the request is aborted)
                return
    if not done:
        out.problems.append("the stream ended without [DONE]")
    missing = [i for i, r in enumerate(out.reasons) if r is None]
    if missing:
        out.problems.append(f"choices {missing} never ended")
    out.status = "completed"


def _take_response(spec: Spec, data: dict, out: Outcome) -> None:
    seen = []
    out.id = data.get("id")
    for c in data.get("choices", []):
        i = c.get("index")
        if not isinstance(i, int) or not 0 <= i < spec.n:
            out.problems.append(f"a choice with index {i!r}")
            continue
        seen.append(i)
        out.texts[i] = c["message"]["content"] if spec.chat else c["text"]
        out.reasons[i] = c.get("finish_reason")
    if sorted(seen) != list(range(spec.n)):
        out.problems.append(f"choices {sorted(seen)} for n={spec.n}")
    out.completion_tokens = (data.get("usage") or {}).get("completion_tokens")
    _check_reasons(out)


def _take_chunk(spec: Spec, data: dict, out: Outcome) -> None:
    if out.id is None:
        out.id = data.get("id")
    elif data.get("id") != out.id:
        out.problems.append(f"a chunk of another response: {data.get('id')!r}")
    for c in data.get("choices", []):
        i = c.get("index")
        if not isinstance(i, int) or not 0 <= i < spec.n:
            out.problems.append(f"a chunk of choice {i!r}")
            continue
        text = (c.get("delta") or {}).get("content") if spec.chat else c.get("text")
        if out.reasons[i] is not None and (text or c.get("finish_reason")):
            out.problems.append(f"choice {i} got text or an end after its end")
        out.texts[i] += text or ""
        if c.get("finish_reason") is not None:
            out.reasons[i] = c["finish_reason"]
            _check_reasons(out, [i])


def _check_reasons(out: Outcome, indices=None) -> None:
    for i in range(len(out.reasons)) if indices is None else indices:
        if out.reasons[i] not in ("stop", "length"):
            out.problems.append(f"choice {i} ended with {out.reasons[i]!r}")


async def drive(url: str, model: str, *, seed: int, concurrency: int, deadline, max_requests: int | None = None,
                on_done=None) -> list[Outcome]:
    """``concurrency`` clients sending :func:`draw`'s requests one after another until ``deadline()``
    (``time.monotonic()``; read again before each request) or ``max_requests`` sent; every outcome, in the order
    they ended (``on_done`` called with each). A request refused with ``engine_restarting`` is recorded and its
    client waits a moment."""
    rng, counter, outcomes = random.Random(seed), iter(range(10**9)), []
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)

    async def send(client: httpx.AsyncClient, spec: Spec) -> Outcome:
        if spec.action != "abort":
            return await run_one(client, model, spec)
        # (a request cancelled mid-flight gets a connection pool of its own: cancellations inside httpx's shared
        # pool left its clients waiting for connections forever, 9 of them in CLOSE-WAIT, in the first 20-minute run)
        async with httpx.AsyncClient(base_url=url, timeout=120.0) as own:
            return await run_one(own, model, spec)

    async def client_loop(client: httpx.AsyncClient) -> None:
        while time.monotonic() < deadline():
            k = next(counter)
            if max_requests is not None and k >= max_requests:
                return
            spec = draw(rng, k)
            started = time.monotonic()
            try:
                out = await asyncio.wait_for(send(client, spec), LOST_SECONDS)
            except asyncio.TimeoutError:
                out = Outcome(spec, started, time.monotonic(), code="client_timeout")
            outcomes.append(out)
            if on_done is not None:
                on_done(out)
            if out.code in ("engine_restarting", "overloaded") or (out.code or "").startswith("http:"):
                await asyncio.sleep(RETRY_SECONDS)

    async with httpx.AsyncClient(base_url=url, timeout=120.0, limits=limits) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    return outcomes


async def reference(url: str, model: str, specs: list[Spec]) -> dict[tuple, list[str]]:
    """Each key's texts (:attr:`Spec.key`) from the same server, its request sent alone (not streamed), one after
    another."""
    answers = {}
    async with httpx.AsyncClient(base_url=url, timeout=120.0) as client:
        for spec in specs:
            reply = await client.post(spec.route, json=spec.body(model, stream=False))
            reply.raise_for_status()
            choices = sorted(reply.json()["choices"], key=lambda c: c["index"])
            answers[spec.key] = [c["message"]["content"] if spec.chat else c["text"] for c in choices]
    return answers
