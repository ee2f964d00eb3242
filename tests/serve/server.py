"""A treedec server on the loopback in a background thread, for tests (uvicorn on a free port), and what the server
tests share: the tiny model's LLM (built here, or by its recipe in the engine core's own process), waiting, the page
accounting (asked of the core), a bystander request."""
from __future__ import annotations

import asyncio
import functools
import os
import signal
import socket
import threading
import time

import httpx
import openai

from tests.engines import tiny_model
from treedec import LLM, SamplingParams
from treedec.serve import build_app
from treedec.core.process_client import ProcessClient
from treedec.serve.http import make_server


class RunningServer:
    """``build_app(engine, name, **kwargs)`` served by ``treedec serve``'s uvicorn server (:func:`make_server`) on
    127.0.0.1 (a free port) until :meth:`stop`: ``engine`` an LLM (its core in this process) or a recipe of one
    (:func:`llm_recipe`: its core in a process of its own, ``treedec serve``'s default)."""

    def __init__(self, engine, name: str = "tiny", **kwargs):
        self.name = name
        self.llm = engine if isinstance(engine, LLM) else None
        if self.llm is None:
            core = {key: kwargs.pop(key) for key in ("max_step_tokens", "seed", "max_restarts") if key in kwargs}
            engine = ProcessClient(engine, **core)
        self.mode = "in-process" if self.llm is not None else "process"
        self.app = build_app(engine, name, **kwargs)
        self.server = make_server(self.app, "127.0.0.1", 0, log_level="warning")
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 120   # (a core of its own imports torch and builds the model first)
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        self.port = port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.base_url = f"{self.url}/v1"

    @property
    def online(self):
        """The app's CoreClient."""
        return self.app.state.online

    def stats(self):
        """The core's last IterationStats (all zero before its first message)."""
        stats = self.online.stats
        return stats if stats is not None else _NO_STATS

    def call(self, coroutine, timeout: float = 60.0):
        """Run ``coroutine`` on the server's loop (the client's methods) and return its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.online.loop).result(timeout)

    def pages(self):
        """The core's PagesReport, asked now."""
        return self.call(self.online.pages())

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def make_llm(tokenizer, **kwargs) -> LLM:
    """The tiny random Llama (4096 positions, 512 ids) with ``tokenizer``, a 4096-token pool of 4-token pages."""
    return LLM(tiny_model(), tokenizer, kv_tokens=kwargs.pop("kv_tokens", 4096), page_size=4, backend="torch",
               **kwargs)


def llm_recipe(tokenizer, **kwargs):
    """:func:`make_llm`'s LLM as a recipe (picklable): built in the engine core's own process."""
    return functools.partial(make_llm, tokenizer, **kwargs)


#: A server's engine, in each mode: its core in a process of its own (``treedec serve``'s default), or in the
#: server's process.
ENGINES = {"process": llm_recipe, "in-process": make_llm}


def wait_until(condition, timeout: float = 10.0) -> None:
    async def poll():
        while not condition():
            await asyncio.sleep(0.01)
    asyncio.run(asyncio.wait_for(poll(), timeout))


def kill_core_under_two_requests(running: RunningServer) -> tuple[httpx.Response, list[str]]:
    """Kill ``running``'s engine-core process (SIGKILL) while a plain and a streamed completion of 4000 tokens are in
    flight; both must end (no hang) as 503 ``engine_failed``. Returns the plain response and the streamed data lines."""
    answers, lines = {}, []

    def plain():
        answers["plain"] = httpx.post(f"{running.base_url}/completions", timeout=60, json={
            "model": "tiny", "prompt": "hello", "max_tokens": 4000, "temperature": 0, "ignore_eos": True})

    def streamed():
        body = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 4000, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{running.base_url}/completions", json=body, timeout=60) as response:
            lines.extend(line[6:] for line in response.iter_lines() if line.startswith("data: "))

    threads = [threading.Thread(target=f) for f in (plain, streamed)]
    for t in threads:
        t.start()
    wait_until(lambda: running.stats().num_running == 2 and len(lines) > 2, 60)
    os.kill(running.online.pid, signal.SIGKILL)
    for t in threads:
        t.join(30)
        assert not t.is_alive(), "a request in flight hangs after the core was killed"
    plain_answer = answers["plain"]
    assert plain_answer.status_code == 503 and plain_answer.json()["error"]["code"] == "engine_failed", \
        plain_answer.text
    assert lines[-1] == "[DONE]" and '"engine_failed"' in lines[-2], lines[-3:]
    return plain_answer, lines


def free_again(server: RunningServer, timeout: float = 10.0) -> int:
    """The pages of the server's pool held by anything but the prefix cache, once its engine is idle and its tree
    empty (0: every request's pages are free; the invariants hold with the cache's holds), as its core reports them
    (:class:`~treedec.core.messages.PagesReport`)."""
    deadline = time.monotonic() + timeout
    while True:
        report = server.pages()
        if report.idle and report.num_nodes == 0:
            break
        assert time.monotonic() < deadline, f"the engine is not idle after {timeout} s: {report}"
        time.sleep(0.02)
    assert report.invariants is None, report.invariants
    return report.held_pages


class _NoStats:
    seconds = steps = num_running = num_waiting = waiting_outputs = prompt_tokens = cached_tokens = 0
    preemptions = free_pages = num_pages = queries = 0


_NO_STATS = _NoStats()

BYSTANDER_PROMPT = "The quick brown fox"


class Bystander:
    """Another client's normal request (streamed, greedy), running in a thread while a test sends a bad one: it must
    be answered meanwhile with the text it gets alone (:func:`alone`)."""

    def __init__(self, server: RunningServer, max_tokens: int = 24):
        self.max_tokens, self.text, self.reason, self.error = max_tokens, "", None, None
        self.thread = threading.Thread(target=self._run, args=(server,), daemon=True)
        self.thread.start()

    def _run(self, server: RunningServer) -> None:
        try:
            with openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=120) as client:
                for chunk in client.completions.create(model=server.name, prompt=BYSTANDER_PROMPT, stream=True,
                                                       max_tokens=self.max_tokens, temperature=0,
                                                       extra_body={"ignore_eos": True}):
                    for c in chunk.choices:
                        self.text += c.text
                        self.reason = c.finish_reason or self.reason
        except Exception as e:   # (the test reads it)
            self.error = e

    def result(self, timeout: float = 120) -> tuple[str, str | None]:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the bystander's request was not answered in time"
        assert self.error is None, f"the bystander's request failed: {self.error!r}"
        return self.text, self.reason


def alone(reference: LLM, max_tokens: int = 24) -> tuple[str, str]:
    """What :class:`Bystander` gets: its request run by ``reference`` alone."""
    [out] = reference.generate(BYSTANDER_PROMPT, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                ignore_eos=True), use_tqdm=False)
    return out.outputs[0].text, "length"


def send_chunked(port: int, chunk: bytes, first: bytes = b"", limit: int = 200 * 2**20) -> tuple[int, bytes]:
    """POST /v1/completions with a chunked body (no Content-Length): ``first`` as its first chunk, then ``chunk``
    again and again until the server answers or ``limit`` bytes went; returns the bytes sent and the answer."""
    head = (f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n"
            f"transfer-encoding: chunked\r\n\r\n").encode()
    sent, answer = 0, b""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head + (b"%x\r\n%s\r\n" % (len(first), first) if first else b""))
        try:
            while sent < limit and not answer:
                sock.setblocking(True)
                sock.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
                sent += len(chunk)
                sock.setblocking(False)
                try:
                    answer = sock.recv(65536)
                except BlockingIOError:
                    pass
        except (BrokenPipeError, ConnectionResetError):
            pass
        sock.setblocking(True)
        try:
            while part := sock.recv(65536):
                answer += part
        except ConnectionResetError:   # (the server closed with the rest of the body unread: its answer came first)
            pass
    return sent, answer
