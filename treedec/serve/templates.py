"""Chat templates rendered within a budget: :class:`ChatTemplateRenderer`, for ``treedec serve``.

A chat template is a Jinja program from the model's files (or ``--chat-template``). transformers renders it in
Jinja's ``ImmutableSandboxedEnvironment``, which blocks escapes but neither nested loops (``range(100000)`` in
``range(100000)``) nor ``'a' * 10**10``: rendered in the server's process, such a template would freeze or crash it
for every client. So the server renders in worker processes (:mod:`treedec.serve.template_worker`), each call with
transformers' own ``apply_chat_template`` on a copy of the tokenizer, within a time budget (past it the worker is
killed and replaced), a memory budget (the worker's address space is capped: a huge string is a MemoryError there)
and a size budget (a rendering longer than the model's context can hold as text is refused). Every failure is a
:class:`~treedec.models.text.ChatTemplateError` naming the chat template; the request fails alone.
"""
from __future__ import annotations

import json
import os
import pickle
import queue
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

from treedec.checks import positive_int
from treedec.models.text import ChatTemplateError

__all__ = ["ChatTemplateRenderer"]

_WORKER = Path(__file__).with_name("template_worker.py")
#: The time a worker may take to start (import transformers, unpickle the tokenizer): not the template's budget.
_START_SECONDS = 120.0


class ChatTemplateRenderer:
    """Renders chat messages through ``tokenizer``'s chat template in worker processes, each render within a budget
    (see the module docstring). Thread-safe: :meth:`render` blocks its caller (a worker thread of the server) and
    runs at most ``workers`` renders at once.

    Parameters
    ----------
    tokenizer : a picklable transformers tokenizer with a chat template (copied into each worker as it is now).
    timeout : seconds a render may take.
    max_chars : the longest rendering (characters); longer is refused.
    memory_bytes : the memory (address space) a worker may take for a render beyond what it holds at start.
    workers : worker processes (each started on first need, and again after one is killed).
    """

    def __init__(self, tokenizer, timeout: float = 5.0, max_chars: int = 2**22, memory_bytes: int = 2**30,
                 workers: int = 2):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template to render")
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
        for name, value in (("max_chars", max_chars), ("memory_bytes", memory_bytes), ("workers", workers)):
            positive_int(name, value)
        try:
            setup = pickle.dumps({"tokenizer": tokenizer, "max_chars": max_chars, "memory_bytes": memory_bytes})
        except Exception as e:
            raise TypeError(f"the tokenizer ({type(tokenizer).__name__}) cannot be copied into a chat-template worker "
                            f"({type(e).__name__}: {e})") from e
        path = [p for p in sys.path if p not in ("", ".", os.getcwd())]   # (the working directory is no source)
        self._setup = [json.dumps({"path": path}).encode(), setup]
        self.timeout, self.max_chars = float(timeout), max_chars
        self._idle: queue.Queue[_Worker | None] = queue.Queue()
        for _ in range(workers):
            self._idle.put(None)   # (a slot whose worker starts on first need)
        self._workers: set[_Worker] = set()
        self._lock = threading.Lock()
        self._closed = False

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The template's text for ``messages`` (with the generation prompt unless ``add_generation_prompt`` is
        False), as ``apply_chat_template(messages, add_generation_prompt=..., tokenize=False)`` gives it;
        :class:`~treedec.models.text.ChatTemplateError` when the template raises, runs past ``timeout``, outgrows
        its memory or its text exceeds ``max_chars``."""
        request = json.dumps({"messages": messages, "add_generation_prompt": bool(add_generation_prompt)},
                             ensure_ascii=False).encode("utf-8", "surrogatepass")
        worker = self._idle.get()
        try:
            if self._closed:
                raise RuntimeError("the chat-template renderer is closed")
            if worker is None:
                worker = self._start()
            reply = worker.call(request, self.timeout, self.max_chars)
            if reply.get("error") == "memory":   # (its heap may be left fragmented: a new one starts)
                self._retire(worker, kill=True)
                worker = None
        except BaseException:   # (stopped past its time, died, or interrupted: killed, a new one starts)
            self._retire(worker, kill=True)
            worker = None
            raise
        finally:
            self._idle.put(worker)
        if "text" in reply:
            return reply["text"]
        raise ChatTemplateError(f"the chat template failed on the messages: {reply['message']}")

    def warm(self) -> None:
        """Start one worker now (a server does it at startup, in the background), so the first render does not wait."""
        worker = self._idle.get()
        try:
            if worker is None and not self._closed:
                worker = self._start()
        finally:
            self._idle.put(worker)

    def close(self) -> None:
        """Stop every worker (their input closed, then killed if they do not end)."""
        with self._lock:
            self._closed, workers = True, list(self._workers)
        for worker in workers:
            self._retire(worker)

    @property
    def closed(self) -> bool:
        return self._closed

    def _start(self) -> _Worker:
        worker = _Worker()
        with self._lock:   # (known from now on: close() stops a worker still starting too)
            self._workers.add(worker)
            closed = self._closed
        if closed:
            self._retire(worker, kill=True)
            raise RuntimeError("the chat-template renderer is closed")
        try:
            worker.begin(self._setup)
        except BaseException:
            self._retire(worker, kill=True)
            raise
        return worker

    def _retire(self, worker: _Worker | None, kill: bool = False) -> None:
        if worker is not None:
            with self._lock:
                self._workers.discard(worker)
            worker.stop(kill)


class _Worker:
    """One worker process: frames in on its stdin, out on its stdout (:mod:`treedec.serve.template_worker`)."""

    def __init__(self):
        self.process = subprocess.Popen([sys.executable, "-I", str(_WORKER)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, bufsize=0)

    def begin(self, setup: list[bytes]) -> None:
        """Send it its setup and wait until it is ready (RuntimeError if it does not get there)."""
        try:
            for frame in setup:
                self._write(frame)
            reply = self._read(time.monotonic() + _START_SECONDS, 64)
        except (OSError, TimeoutError, EOFError, ValueError) as e:
            raise RuntimeError(f"the chat-template worker did not start ({type(e).__name__}: {e}; exit code "
                               f"{self.process.poll()})") from None
        if reply != {"ready": True}:
            raise RuntimeError(f"the chat-template worker did not start: it answered {reply!r:.200}")

    def call(self, request: bytes, timeout: float, max_chars: int) -> dict:
        """Send one render and wait for its reply; ChatTemplateError (the worker killed) past ``timeout``."""
        self._write(request)
        try:   # (a reply holds at most max_chars characters, JSON-escaped)
            return self._read(time.monotonic() + timeout, 12 * max_chars + 4096)
        except TimeoutError:
            raise ChatTemplateError(f"the chat template took more than {timeout:g} s to render the messages: it was "
                                    f"stopped (a template looping over a huge range?)") from None
        except EOFError:
            raise ChatTemplateError(f"the chat template's worker died rendering the messages (exit code "
                                    f"{self.process.wait(5)})") from None

    def stop(self, kill: bool = False) -> None:
        """End it: its input closed (it exits), killed if ``kill`` or if it does not exit at once."""
        try:
            if kill:
                self.process.kill()
            self.process.stdin.close()
            self.process.wait(0.5)
        except (OSError, subprocess.TimeoutExpired):
            self.process.kill()
            self.process.wait()

    def _write(self, payload: bytes) -> None:
        self.process.stdin.write(len(payload).to_bytes(8, "big") + payload)

    def _read(self, deadline: float, limit: int) -> dict:
        size = int.from_bytes(self._exactly(8, deadline), "big")
        if size > limit:
            raise EOFError(f"a reply of {size} bytes, more than {limit}")
        return json.loads(self._exactly(size, deadline).decode("utf-8", "surrogatepass"))

    def _exactly(self, count: int, deadline: float) -> bytes:
        fd, parts = self.process.stdout.fileno(), []
        while count:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError("no reply in time")
            part = os.read(fd, min(count, 2**20))
            if not part:
                raise EOFError("its output ended")
            parts.append(part)
            count -= len(part)
        return b"".join(parts)
