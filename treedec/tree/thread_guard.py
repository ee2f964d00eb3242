"""Detecting two threads in one engine (or one tree) at once.

treedec's engine, its tree and its KV pool are not thread-safe: one thread drives one engine
(a server runs one engine loop and hands it requests). Two threads editing one tree interleave
refcount updates and corrupt the pool, so instead of corrupting state the second thread's entry
raises :class:`~treedec.errors.ConcurrentUseError` naming both threads. The same thread may
re-enter (``run_programs`` calls ``Engine.step``, which edits the tree). The check costs a lock
acquire and two attribute writes per entry.
"""
from __future__ import annotations

import threading

from treedec.errors import ConcurrentUseError

__all__ = ["ThreadGuard"]


class ThreadGuard:
    """A re-entrant marker of the thread inside an object; another thread's entry raises.

    >>> guard = ThreadGuard("this engine")
    >>> with guard:          # held by this thread (nested entries of the same thread are fine)
    ...     pass
    """

    __slots__ = ("what", "_lock", "_owner", "_depth")

    def __init__(self, what: str):
        self.what = what
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._depth = 0

    def __enter__(self) -> "ThreadGuard":
        me = threading.get_ident()
        with self._lock:
            if self._owner is not None and self._owner != me:
                owner = _thread_name(self._owner)
                raise ConcurrentUseError(
                    f"{self.what} is in use by thread {owner!r}, entered again from thread "
                    f"{threading.current_thread().name!r}: an engine, its tree and its KV pool serve one thread at a "
                    f"time (use one engine per thread, or hand requests to the thread that runs the engine)")
            self._owner = me
            self._depth += 1
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                self._owner = None


def _thread_name(ident: int) -> str:
    for thread in threading.enumerate():
        if thread.ident == ident:
            return thread.name
    return f"id {ident}"
