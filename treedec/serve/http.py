"""The app over HTTP: :func:`make_server`, the uvicorn server ``treedec serve`` (and the tests) run.

Two things differ from a plain ``uvicorn.Server(uvicorn.Config(app))``:

- a request uvicorn cannot parse (a bad ``Content-Length``, a malformed request line or header) is answered before
  the app sees it, by uvicorn's HTTP protocol: there as OpenAI's JSON (400 ``invalid_http_request``), not uvicorn's
  plain text ("Invalid HTTP request received."), through a subclass of uvicorn's protocol class (the ``http``
  setting of ``uvicorn.Config``);
- shutting down (the first Ctrl-C or SIGTERM) aborts every request first, so live streams end at once (each with an
  ``error`` event, then ``[DONE]``) instead of uvicorn waiting for their connections to close; what is still open
  after :data:`GRACEFUL_SECONDS` is cancelled (uvicorn's ``timeout_graceful_shutdown``);
- when the app's engine core is gone (its process killed or crashed, and no restart is left: ``--max-core-restarts``)
  the server stops, its ``engine_failed`` set (``treedec serve`` then exits with code 1, for a supervisor to restart
  it); a core its client starts again does not stop it.
"""
from __future__ import annotations

import json
import logging

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from treedec.serve.protocol import ServeError

__all__ = ["GRACEFUL_SECONDS", "make_server"]

logger = logging.getLogger("treedec.serve")

#: Seconds the server waits, once every request is aborted, for their connections to close before cancelling them.
GRACEFUL_SECONDS = 5.0


def make_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> uvicorn.Server:
    """A uvicorn server for ``app`` (a :func:`~treedec.serve.build_app` app) on ``host:port`` (see the module
    docstring); ``server.run()`` serves until a signal or ``server.should_exit``."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, http=_JSONErrors, lifespan="on",
                            timeout_graceful_shutdown=GRACEFUL_SECONDS)
    return _Server(config, app)


class _Server(uvicorn.Server):
    """uvicorn's server, ending when the app's engine core is gone (:attr:`engine_failed` then holds why: the
    command exits non-zero, for a supervisor to restart it)."""

    def __init__(self, config: uvicorn.Config, app: FastAPI):
        super().__init__(config)
        self.app = app
        self.engine_failed: str | None = None

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        online = getattr(self.app.state, "online", None)   # (None: the app did not start)
        if online is not None:
            if online.dead is not None:
                self._engine_died(online.dead)
            online.on_dead = self._engine_died

    def _engine_died(self, error: BaseException) -> None:
        logger.error("the engine core is gone (%s): every request in flight was answered 503 engine_failed; the "
                     "server stops", error)
        self.engine_failed = str(error)
        self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        online = getattr(self.app.state, "online", None)   # (None: the app never started)
        if online is not None:
            online.shutdown()   # every request aborted now; the lifespan's end stops the engine core
        await super().shutdown(sockets)


class _JSONErrors(AutoHTTPProtocol):
    """uvicorn's HTTP protocol, answering a request it cannot parse with OpenAI's JSON (then closing)."""

    def send_400_response(self, msg: str) -> None:
        body = json.dumps(ServeError(f"the HTTP request is malformed ({msg.rstrip('.')}): check its request line, "
                                     f"its headers and its Content-Length", code="invalid_http_request").body())
        head = (f"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
                f"connection: close\r\n\r\n")
        self.transport.write(head.encode("ascii") + body.encode("ascii"))
        self.transport.close()
