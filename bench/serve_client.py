"""The client side of ``bench/serve.py``: a ``treedec serve`` subprocess, and the replay of a workload against a
server with the official ``openai`` client (``AsyncOpenAI``, streamed, ``stream_options={"include_usage": True}``).

:class:`ServerProcess` starts ``python -m treedec serve ...`` on 127.0.0.1 and a free port, its output into a log
file, waits for ``/health`` to answer 200 and stops it (SIGINT, then SIGTERM, then SIGKILL, its own process group
only) when the ``with`` block ends. :func:`replay` sends a workload's sessions: batches at their arrival times, the
turns of a session one after another, at most ``max_concurrency`` requests in flight; a failed request is
recorded with its error (a conversation whose turn failed stops there) and never dropped.
"""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench.serve_stats import Record
from bench.serve_workloads import Session, arrival_times

__all__ = ["ServerProcess", "free_port", "read_metrics", "replay", "server_model"]

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port of 127.0.0.1 free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``treedec serve`` as a subprocess for a ``with`` block (``url``: its base URL, ``log``: its output).

    Parameters
    ----------
    server_args : the ``treedec serve`` arguments other than ``--host`` / ``--port`` (model, speculative, ...).
    log : the file its stdout and stderr go to.
    startup_timeout : seconds to wait for ``/health``.
    """

    def __init__(self, server_args: list[str], log: Path, startup_timeout: float = 600.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [sys.executable, "-m", "treedec", "serve", *server_args, "--host", "127.0.0.1",
                        "--port", str(self.port)]
        self.log, self.startup_timeout = Path(log), startup_timeout
        self.process: subprocess.Popen | None = None
        self.startup_seconds = 0.0

    def __enter__(self) -> "ServerProcess":
        self.log.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
        with open(self.log, "w") as log:
            log.write(" ".join(self.command) + "\n")
            log.flush()
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                            start_new_session=True)
        began = time.perf_counter()
        try:
            self._wait_healthy(began)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.perf_counter() - began
        return self

    def _wait_healthy(self, began: float) -> None:
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with status {self.process.returncode} before it was healthy: "
                                   f"{self.command}\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.perf_counter() - began > self.startup_timeout:
                raise TimeoutError(f"the server did not answer /health within {self.startup_timeout:.0f} s: "
                                   f"{self.command}\n{self.log_tail()}")
            time.sleep(0.5)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> int | None:
        """Stop the server (SIGINT, then SIGTERM, then SIGKILL to its own process group); its exit status."""
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        for sig, wait in ((signal.SIGINT, 30), (signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break
            try:
                return self.process.wait(wait)
            except subprocess.TimeoutExpired:
                continue
        return self.process.poll()

    def __exit__(self, *exc) -> None:
        self.stop()


def read_metrics(url: str) -> str | None:
    """The text of ``<url>/metrics``, or None when the server has none (a 404) or cannot be reached."""
    try:
        reply = httpx.get(f"{url}/metrics", timeout=10.0)
    except httpx.HTTPError:
        return None
    return reply.text if reply.status_code == 200 else None


async def server_model(client) -> str:
    """The first model ``/v1/models`` lists (the name requests carry)."""
    models = await client.models.list()
    if not models.data:
        raise RuntimeError("the server's /v1/models lists no model")
    return models.data[0].id


async def send(client, model: str, session: Session, turn: int, answers: list[str], clock_start: float,
               sampling: dict) -> Record:
    """Send one streamed request and record it (an exception becomes the record's error); ``clock_start``: the
    ``time.perf_counter()`` its ``sent`` counts from."""
    began = time.perf_counter()
    record = Record(session.workload, session.index, turn, began - clock_start)
    if session.token_ids:
        record.new_tokens = len(session.turns[turn].ids)
    prompt = session.prompt(turn, answers)
    pieces = []
    try:
        common = dict(model=model, max_tokens=session.turns[turn].max_tokens, stream=True,
                      stream_options={"include_usage": True}, **sampling)
        if session.chat:
            stream = await client.chat.completions.create(messages=prompt, **common)
        elif session.token_ids:   # (vLLM's return_token_ids: the last chunk holds the output's ids)
            common["extra_body"] = {**common.get("extra_body", {}), "return_token_ids": True}
            stream = await client.completions.create(prompt=prompt, **common)
        else:
            stream = await client.completions.create(prompt=prompt, **common)
        async for chunk in stream:
            now = time.perf_counter() - began
            if chunk.usage is not None:
                record.prompt_tokens, record.completion_tokens = chunk.usage.prompt_tokens, chunk.usage.completion_tokens
                details = getattr(chunk.usage, "prompt_tokens_details", None)
                record.cached_tokens = getattr(details, "cached_tokens", None)
            for choice in chunk.choices:
                piece = choice.delta.content if session.chat else choice.text
                if piece:
                    record.arrivals.append(now)
                    pieces.append(piece)
                if choice.finish_reason is not None:
                    record.finish_reason = choice.finish_reason
                    if session.token_ids:
                        record.token_ids = (choice.model_extra or {}).get("token_ids")
        if record.finish_reason is None:
            record.error = "IncompleteStream: the stream ended without a finish reason"
        elif session.token_ids and record.token_ids is None:
            record.error = "NoTokenIds: the server returned no token_ids (return_token_ids)"
    except Exception as e:  # recorded, counted and reported: a benchmark never loses a request
        record.error = f"{type(e).__name__}: {e}"[:500]
    record.end = time.perf_counter() - began
    record.text = "".join(pieces)
    return record


async def replay(client, model: str, sessions: list[Session], rate: float, max_concurrency: int, seed: int,
                 sampling: dict, on_done=None) -> tuple[list[Record], float]:
    """Send every session's turns (batches at Poisson times of ``rate`` batches a second, or all at once for
    ``inf``; at most ``max_concurrency`` requests in flight); the records in completion order and the wall time
    from the first send to the last answer. ``on_done(record)`` is called as each request ends."""
    batches = sorted({s.batch for s in sessions})
    times = dict(zip(batches, arrival_times(seed, len(batches), rate)))
    limit = asyncio.Semaphore(max_concurrency)
    records: list[Record] = []
    start = time.perf_counter()

    async def run(session: Session) -> None:
        await asyncio.sleep(max(0.0, start + times[session.batch] - time.perf_counter()))
        answers: list[str] = []
        for turn in range(len(session.turns)):
            async with limit:
                record = await send(client, model, session, turn, answers, start, sampling)
            records.append(record)
            if on_done is not None:
                on_done(record)
            if record.error is not None:
                return
            answers.append(record.token_ids if session.token_ids else record.text)

    await asyncio.gather(*(run(s) for s in sessions))
    return records, time.perf_counter() - start
