"""Structured outputs on the server: a request's constraint compiled off the event loop (xgrammar's compile of a
large schema takes milliseconds to seconds), before the request is submitted; the engine's thread then finds it in
the compiler's cache (:meth:`~treedec.serve.engine.OnlineEngine.grammar`)."""
from __future__ import annotations

import asyncio

from treedec.sampling.params import SamplingParams
from treedec.serve.engine import OnlineEngine
from treedec.serve.protocol import ServeError

__all__ = ["compile_grammar"]


async def compile_grammar(online: OnlineEngine, params: SamplingParams, field: str | None) -> None:
    """Compile ``params.structured_outputs`` in a worker thread (cached by the engine's compiler). A constraint that
    cannot be compiled is a ServeError (400) naming ``field`` (the request's field that gave it) with the grammar
    engine's reason; it fails only this request."""
    try:
        await asyncio.to_thread(online.grammar, params)
    except ModuleNotFoundError as e:
        raise ServeError(f"structured outputs are not available on this server: {e}", param=field) from None
    except ValueError as e:   # (GrammarError: the constraint's kind and xgrammar's reason)
        raise ServeError(f"{field}: {e}" if field else str(e), param=field) from None
