"""Structured outputs on the server: a request's constraint is compiled by the engine core when it takes the request
(:meth:`~treedec.core.online_engine.OnlineEngine.submit`, on the core's input thread: off its engine's thread and off
the frontend's event loop; xgrammar's compile of a large schema takes milliseconds to seconds), and one that cannot be
compiled refuses the request; :func:`grammar_error` is what the client is told then."""
from __future__ import annotations

from treedec.sampling.grammar import GrammarError
from treedec.serve.protocol import ServeError

__all__ = ["grammar_error"]


def grammar_error(error: BaseException, field: str | None) -> ServeError | None:
    """The 400 of a request whose constraint the core could not compile, naming ``field`` (the request's field that
    gave it) with the grammar engine's reason, or that needs a grammar engine the server lacks; None for any other
    error. It fails only this request."""
    if isinstance(error, ModuleNotFoundError):
        return ServeError(f"structured outputs are not available on this server: {error}", param=field)
    if isinstance(error, GrammarError):   # (the constraint's kind and xgrammar's reason)
        return ServeError(f"{field}: {error}" if field else str(error), param=field)
    return None
