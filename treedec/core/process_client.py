"""The engine core in a process of its own (:class:`ProcessClient`, one :class:`~treedec.core.client.CoreClient`
transport) and the one way to start one (:func:`launch_core`: ``treedec serve --engine-process`` and
``LLM(..., engine_process=True)`` both).

The process (``multiprocessing`` spawn: :func:`~treedec.core.engine_core.run_core_process`) is spoken to over ZMQ (IPC
sockets) with msgpack, as vLLM v1's ``AsyncMPClient`` (a reader thread hands each message to the loop, as the
in-process core's thread does). Its process is watched: when it ends unasked (killed, crashed) every request in flight
fails with :class:`~treedec.core.client.EngineDeadError` naming its exit code (503 ``engine_failed`` on a server),
:attr:`~treedec.core.client.CoreClient.dead` is set, and ``on_dead`` is called (``treedec serve`` then exits with code
1, for a supervisor to restart it). With ``max_restarts`` (``treedec serve --max-core-restarts``) the client starts a
crashed core again itself, that many times: the requests in flight still fail (``engine_failed``: their state died
with the core), a request sent while the new core is built is refused with
:class:`~treedec.core.client.EngineRestartingError` (503 ``engine_restarting``), and the new core (the same recipe and
options, a fresh KV pool and prefix cache) serves the next ones; a crash past the last restart ends it as above. A
core that fails to start raises
:class:`~treedec.core.client.EngineStartupError` with its reason from :meth:`ProcessClient.launch`.
"""
from __future__ import annotations

import asyncio
import builtins
import logging
import multiprocessing
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import treedec
from treedec.core.client import WATCH_SECONDS, CoreClient, EngineDeadError, EngineStartupError
from treedec.core.engine_core import run_core_process
from treedec.core.messages import CoreInput, CoreOutput, CoreReady, CoreStartupFailed, MessageCodec, Shutdown, loads

__all__ = ["USER_ERRORS", "ProcessClient", "launch_core"]

logger = logging.getLogger(__name__)

#: The core's startup errors that are a user's (a bad argument or model path, a pool too large, a path not built):
#: :func:`launch_core` raises them as their own class, as building the LLM in the caller's process would.
USER_ERRORS = (ValueError, TypeError, OSError, MemoryError, NotImplementedError)


def launch_core(recipe: Callable[[], Any], *, max_step_tokens: int | None = None, seed: int = 0,
                prefix_cache: bool = True, startup_timeout: float = 600.0, max_restarts: int = 0) -> "ProcessClient":
    """Start an engine core whose process builds its LLM with ``recipe()`` and wait until it is built: its
    :class:`ProcessClient`, launched (the options are its). A core whose build failed with one of
    :data:`USER_ERRORS` raises that built-in class (the nearest one of the core's error) with the core's message;
    any other failure raises :class:`~treedec.core.client.EngineStartupError`."""
    client = ProcessClient(recipe, max_step_tokens=max_step_tokens, seed=seed, prefix_cache=prefix_cache,
                           startup_timeout=startup_timeout, max_restarts=max_restarts)
    try:
        client.launch()
    except EngineStartupError as e:   # (the core's own error class, when it is a user's error)
        error = getattr(builtins, e.kind or "", None)
        if isinstance(error, type) and issubclass(error, USER_ERRORS):
            raise error(str(e)) from None
        raise
    return client


class ProcessClient(CoreClient):
    """The core in a process of its own, built there by ``recipe()`` (a picklable callable returning the
    :class:`~treedec.LLM`: ``functools.partial`` of a module-level function), over ZMQ IPC sockets in a private
    temporary folder (see the module docstring). :meth:`launch` starts it and waits until it is built (blocking: a
    command runs it before its server starts, to report a bad model at once); :meth:`start` (on the loop) launches
    it if that was not done and starts the thread that reads its messages, hands each one to the loop and watches
    the process. ``max_restarts``: the times a crashed core is started again (see the module docstring; 0: never)."""

    mode = "process"

    def __init__(self, recipe: Callable[[], Any], *, max_step_tokens: int | None = None, seed: int = 0,
                 prefix_cache: bool = True, startup_timeout: float = 600.0, max_restarts: int = 0):
        super().__init__()
        if not callable(recipe):
            raise TypeError(f"recipe must be a callable returning the LLM, got {type(recipe).__name__}")
        if not isinstance(max_restarts, int) or isinstance(max_restarts, bool) or max_restarts < 0:
            raise ValueError(f"max_restarts must be an int >= 0, got {max_restarts!r}")
        self.recipe, self.startup_timeout, self.max_restarts = recipe, startup_timeout, max_restarts
        self._restart: asyncio.Future | None = None
        self._options = (max_step_tokens, seed, prefix_cache)   # (run_core_process' and EngineCore's)
        self.process_handle: multiprocessing.process.BaseProcess | None = None
        self._folder = None
        self._context = self._inputs = self._outputs = None
        self._in_codec, self._out_codec = MessageCodec(CoreInput), MessageCodec(CoreOutput)
        self._reader: threading.Thread | None = None
        self._stop_reading = threading.Event()

    @property
    def pid(self) -> int | None:
        return None if self.process_handle is None else self.process_handle.pid

    def launch(self) -> CoreReady:
        """Start the core's process and wait until it is built (any thread); raises :class:`EngineStartupError`
        with its reason when it cannot be (or ends before it says)."""
        if self.ready is not None:
            return self.ready
        first = self._launch()
        self.tokenizer = None if first.tokenizer is None else loads(first.tokenizer)
        self.ready = first
        return first

    def _launch(self) -> CoreReady:
        """Start a core's process and its sockets, and wait for its first message (see :meth:`launch`)."""
        import zmq

        self._folder = tempfile.TemporaryDirectory(prefix="treedec-core-")
        input_address = f"ipc://{self._folder.name}/inputs"
        output_address = f"ipc://{self._folder.name}/outputs"
        self._context = zmq.Context()
        self._inputs = self._context.socket(zmq.PUSH)
        self._inputs.setsockopt(zmq.LINGER, 0)
        self._inputs.bind(input_address)
        self._outputs = self._context.socket(zmq.PULL)
        self._outputs.setsockopt(zmq.LINGER, 0)
        self._outputs.bind(output_address)
        root = str(Path(treedec.__file__).resolve().parents[1])
        if root not in sys.path:   # (the child imports this treedec: a checkout's, which python -m takes off the path)
            sys.path.append(root)   # (last: nothing in it shadows an installed module)
        spawn = multiprocessing.get_context("spawn")   # (CUDA cannot be forked; the core imports torch alone)
        self.process_handle = spawn.Process(target=run_core_process, name="treedec-engine-core", daemon=True,
                                            args=(self.recipe, input_address, output_address, *self._options))
        self.process_handle.start()
        deadline = time.monotonic() + self.startup_timeout
        try:
            while not self._outputs.poll(100):
                if not self.process_handle.is_alive():
                    raise EngineStartupError(f"the engine core's process ended while starting (exit code "
                                             f"{self.process_handle.exitcode}); its output says why")
                if time.monotonic() > deadline:
                    raise EngineStartupError(f"the engine core did not start within {self.startup_timeout:g} s")
            first = self._out_codec.decode(self._outputs.recv())
            if isinstance(first, CoreStartupFailed):
                raise EngineStartupError(first.message, first.kind)
            if not isinstance(first, CoreReady):
                raise EngineStartupError(f"the engine core's first message is a {type(first).__name__}")
        except BaseException:
            self._stop_process(10.0)
            raise
        return first

    async def start(self) -> None:
        self.loop = loop = asyncio.get_running_loop()
        if self.ready is None:
            await loop.run_in_executor(None, self.launch)
        self._start_reading()

    def _start_reading(self) -> None:
        self._last_message = time.monotonic()
        self._stop_reading.clear()
        self._reader = threading.Thread(target=self._read, args=(self.loop,), name="treedec-core-reader",
                                        daemon=True)
        self._reader.start()

    # ------------------------------------------------------------ a crashed core started again

    def _died(self, reason: str) -> None:
        if self.dead is not None or self._closing or self.restarting:
            return
        if self.restarts >= self.max_restarts:
            super()._died(reason if not self.max_restarts else f"{reason} (after {self.restarts} restart(s))")
            return
        self.restarting, self.restarts = True, self.restarts + 1
        self._fail_all(EngineDeadError(reason))   # (their state died with the core: 503 engine_failed)
        self.stats = None
        logger.warning("%s: starting it again (restart %d of %d)", reason, self.restarts, self.max_restarts)
        self._restart = asyncio.ensure_future(self._start_again(reason))

    async def _start_again(self, reason: str) -> None:
        try:
            ready = await asyncio.get_running_loop().run_in_executor(None, self._relaunch)
        except Exception as e:   # (it cannot be built again: gone for good)
            self.restarting = False
            super()._died(f"{reason}; starting it again failed: {e}")
            return
        self.ready, self.restarting = ready, False
        if self._closing:   # (the server stopped meanwhile: close() waits for this, then for the process)
            self._send(Shutdown())
            return
        self._start_reading()
        logger.warning("the engine core runs again (process %d, restart %d of %d)", ready.pid, self.restarts,
                       self.max_restarts)

    def _relaunch(self) -> CoreReady:
        """The old core's sockets and folder closed, a new core started (an executor's thread)."""
        self._stop_process(5.0)
        return self._launch()

    def _read(self, loop: asyncio.AbstractEventLoop) -> None:
        """The reader thread: each message to the loop, decoded; the process's end (unasked) to :meth:`_died`."""
        import zmq

        decode, sock, handle = self._out_codec.decode, self._outputs, self.process_handle

        def hand(f, *args) -> bool:
            try:
                loop.call_soon_threadsafe(f, *args)
                return True
            except RuntimeError:   # (the loop is closed)
                return False

        while not self._stop_reading.is_set():
            if sock.poll(int(WATCH_SECONDS * 1000)):
                try:
                    while True:
                        if not hand(self.process, decode(sock.recv(zmq.NOBLOCK, copy=False).buffer)):
                            return
                except zmq.Again:
                    pass
            elif not handle.is_alive():
                if not self._stop_reading.is_set():
                    hand(self._died, f"the engine core's process (pid {handle.pid}) ended with exit code "
                                     f"{handle.exitcode}")
                return

    def _send(self, message: CoreInput) -> None:
        import zmq

        try:
            self._inputs.send(self._in_codec.encode(message), flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:   # (the core is not reading: it is gone or stuck)
            raise EngineDeadError(f"the engine core does not take messages: {e}") from None

    async def close(self, timeout: float = 10.0) -> bool:
        """Shut the core down (every request aborted) and wait for its process (killed after ``timeout`` s);
        returns whether it ended by itself."""
        self.shutdown()
        if self._restart is not None and not self._restart.done():   # (a new core being built: it is told to end)
            await asyncio.shield(self._restart)
        return await asyncio.get_running_loop().run_in_executor(None, self._stop_process, timeout)

    def stop(self, timeout: float = 10.0) -> bool:
        """:meth:`close` without a loop (a command whose server never started): tell the core to end, wait for its
        process; returns whether it ended by itself."""
        if self.ready is not None and self.dead is None and not self._closing:
            self._closing = True
            self._send(Shutdown())
        return self._stop_process(timeout)

    def _stop_process(self, timeout: float) -> bool:
        handle, clean = self.process_handle, True
        if handle is not None:
            handle.join(timeout)
            if handle.is_alive():
                clean = False
                handle.kill()
                handle.join(5)
        self._stop_reading.set()
        if self._reader is not None:
            self._reader.join(5)
        for sock in (self._inputs, self._outputs):
            if sock is not None:
                sock.close(0)
        if self._context is not None:
            self._context.term()
            self._context = None
        if self._folder is not None:
            self._folder.cleanup()
            self._folder = None
        return clean
