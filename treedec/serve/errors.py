"""What a client is told of a failed request: :func:`request_error` (an exception of the engine or of a request's
checks, as OpenAI's error), :func:`not_running_error` (an engine core not running) and :func:`body_parse_error`
(a body FastAPI could not parse, with its reason)."""
from __future__ import annotations

import logging

from starlette.exceptions import HTTPException

from treedec.errors import PoolExhaustedError
from treedec.runtime.online import ProgramAborted
from treedec.core.client import EngineDeadError, EngineError, EngineRestartingError
from treedec.serve.protocol import ServeError

__all__ = ["body_parse_error", "not_running_error", "request_error"]

logger = logging.getLogger("treedec.serve")


def request_error(e: BaseException, param: str | None = None) -> ServeError:
    """What the client is told of a failed request (``param``: the field of its prompt)."""
    if isinstance(e, ServeError):
        return e
    if isinstance(e, PoolExhaustedError):
        return ServeError(f"the request does not fit the server's KV cache: {e}", code="kv_cache_exceeded")
    if isinstance(e, (ValueError, TypeError)):   # (the engine's checks start with the field they name)
        field = str(e).split(" ", 1)[0]
        return ServeError(str(e), param={"prompt_ids": param, "stop_token_ids": "stop_token_ids"}.get(field))
    if isinstance(e, EngineRestartingError):   # (a crashed core is being started again: a retry is answered)
        return ServeError(str(e), 503, "server_error", code="engine_restarting")
    if isinstance(e, EngineDeadError):   # (the core's process is gone: its reason, no traceback, no path)
        return ServeError(f"the engine failed: {e}", 503, "server_error", code="engine_failed")
    if isinstance(e, EngineError):
        logger.error("request failed in the engine core: %s", e)
        return ServeError(f"the engine failed: {str(e).split(':', 1)[0]}", 503, "server_error", code="engine_failed")
    if isinstance(e, ProgramAborted):   # (a client's own abort is never answered: it went away)
        return ServeError("the server is shutting down: the request was aborted", 503, "server_error",
                          code="server_shutdown")
    logger.error("request failed in the engine: %s: %s", type(e).__name__, e)   # (an engine step)
    return ServeError(f"the engine failed: {type(e).__name__}", 503, "server_error", code="engine_failed")


def not_running_error(online, health: bool = False) -> ServeError:
    """Why a request (``health``: ``/health``) is refused by an engine core that is not running (``online``: a
    CoreClient): started again after a crash, gone, or shutting down."""
    if online.restarting:   # (--max-core-restarts: a retry is answered once it runs)
        return request_error(EngineRestartingError("the engine core crashed and is being started again"))
    if online.dead is not None:
        return ServeError(f"the engine is not running: {online.dead}", 503, "server_error", code="engine_failed")
    if health:
        return ServeError("the engine is not running", 503, "server_error", code="engine_failed")
    return ServeError("the server is shutting down", 503, "server_error", code="server_shutdown")


def body_parse_error(e: HTTPException) -> ServeError | None:
    """What was wrong with a body FastAPI could not parse (it says only "There was an error parsing the body" and
    keeps the reason as the exception's cause); None for any other HTTPException."""
    cause = e.__cause__
    if e.status_code != 400 or cause is None:
        return None
    if isinstance(cause, UnicodeDecodeError):
        return ServeError(f"the request body is not UTF-8 text (JSON must be): {cause.reason} at byte {cause.start}")
    if isinstance(cause, RecursionError):
        return ServeError("the request body's JSON nests too deeply for the server's parser (about 1000 levels of "
                          "arrays and objects at most)")
    if isinstance(cause, ValueError) and "integer string conversion" in str(cause):
        return ServeError(f"the request body holds an integer of too many digits ({cause})")
    return None
