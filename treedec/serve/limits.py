"""What the server checks of every HTTP request before (and while) the app reads it: :class:`RequestLimits`.

An ASGI middleware, outermost in :func:`~treedec.serve.build_app`'s app:

- the ``Host`` header against ``allowed_hosts`` (a server on the loopback answers only its loopback names, so a web
  page that rebinds its own DNS name to 127.0.0.1 cannot use it: 400 ``invalid_host``);
- the body against ``max_body_bytes``: by its ``Content-Length`` before anything is read, and by the bytes received
  as they arrive (a chunked body has no length): 413 ``request_too_large`` the moment it is past the limit, the
  rest never read (the connection is closed);
- the body's arrival against ``read_timeout``: a body that stops arriving (a half-open or slow client) ends with
  408 ``request_timeout`` instead of holding its request forever;
- every answered request counted by route and status (:class:`~treedec.serve.metrics.ServeMetrics`).

Its errors are OpenAI's JSON, as the app's are; those of the body are raised inside the app (from ``receive``) as
:class:`BodyError`, which the app answers (:func:`body_error_response`) with ``connection: close``.
"""
from __future__ import annotations

import asyncio
from typing import Sequence

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from treedec.serve.metrics import ServeMetrics
from treedec.serve.protocol import ServeError

__all__ = ["LOOPBACK_HOSTS", "BodyError", "QueueLimits", "QueueSlots", "RequestLimits", "body_error_response",
           "host_name"]

#: The names a server bound to a loopback address answers by default (``treedec serve --allowed-hosts``).
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")

_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/tokenize",
                     "/detokenize", "/version"})


class BodyError(HTTPException):
    """The request's body broke a limit while the app read it (raised from ``receive``): ``error`` is the answer.
    An HTTPException, so FastAPI's body reading passes it on as it is."""

    def __init__(self, error: ServeError):
        super().__init__(status_code=error.status, detail=error.message)
        self.error = error


def body_error_response(error: ServeError) -> JSONResponse:
    """The answer to a body past a limit: the connection closes (the rest of the body is not read)."""
    return JSONResponse(error.body(), status_code=error.status, headers={"connection": "close"})


def host_name(header: str) -> str:
    """The host of a ``Host`` header, port dropped, lower case (``"[::1]:8000"`` -> ``"[::1]"``)."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[:header.find("]") + 1] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class RequestLimits:
    """The ASGI middleware (see the module docstring).

    Parameters
    ----------
    app : the app it wraps.
    metrics : where answered requests are counted.
    max_body_bytes : the largest request body.
    read_timeout : seconds the body may take between two of its chunks (None: no limit).
    allowed_hosts : the ``Host`` names answered (ports ignored, ``"*"`` for any); None: any.
    """

    def __init__(self, app, metrics: ServeMetrics, max_body_bytes: int, read_timeout: float | None = None,
                 allowed_hosts: Sequence[str] | None = None):
        self.app, self.metrics, self.max_body_bytes, self.read_timeout = app, metrics, max_body_bytes, read_timeout
        hosts = None if allowed_hosts is None else {host_name(h) for h in allowed_hosts}
        self.allowed_hosts = None if hosts is None or "*" in hosts else frozenset(hosts)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        route = path if path in _ROUTES else "other"
        headers = dict(scope.get("headers", ()))
        refused = self._refuse(headers)
        if refused is not None:
            self.metrics.requests.labels(route, str(refused.status)).inc()
            response = body_error_response(refused) if refused.status == 413 else \
                JSONResponse(refused.body(), status_code=refused.status)
            return await response(scope, receive, send)
        status = []
        received, complete = 0, False

        async def limited():
            nonlocal received, complete
            if complete or self.read_timeout is None:
                message = await receive()
            else:
                try:
                    message = await asyncio.wait_for(receive(), self.read_timeout)
                except asyncio.TimeoutError:
                    raise BodyError(ServeError(f"the request body stopped arriving: nothing came for "
                                               f"{self.read_timeout:g} s", 408, code="request_timeout")) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                complete = not message.get("more_body", False)
                if received > self.max_body_bytes:
                    raise BodyError(_too_large(f"more than {received} bytes", self.max_body_bytes))
            return message

        async def counted(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
                self.metrics.requests.labels(route, str(message["status"])).inc()
            await send(message)

        try:
            await self.app(scope, limited, counted)
        except Exception:
            if not status:
                self.metrics.requests.labels(route, "500").inc()
            raise

    def _refuse(self, headers: dict) -> ServeError | None:
        """What the request's headers alone are refused for: its host, or a Content-Length past the limit."""
        if self.allowed_hosts is not None:
            host = headers.get(b"host", b"").decode("latin-1")
            if host_name(host) not in self.allowed_hosts:
                return ServeError(f"the Host header {host[:100]!r} is not a name this server answers (it answers "
                                  f"{', '.join(sorted(self.allowed_hosts))}; treedec serve --allowed-hosts adds names)",
                                  code="invalid_host")
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return _too_large(f"{int(length)} bytes", self.max_body_bytes)
        return None


def _too_large(size: str, limit: int) -> ServeError:
    return ServeError(f"the request body has {size}, more than the server's limit of {limit} (max_body_bytes)", 413,
                      code="request_too_large")


class QueueLimits:
    """The request counts a server takes (:func:`~treedec.serve.build_app`'s)."""

    def __init__(self, max_queued: int, max_n: int, max_prompts: int):
        self.max_queued, self.max_n, self.max_prompts = max_queued, max_n, max_prompts


class QueueSlots:
    """A request's outputs held in its server's queue count (its ``reserved``: the app's server reserves them on
    arrival) until released (once)."""

    def __init__(self, server, outputs: int):
        self.server, self.outputs = server, outputs
        server.reserved += outputs

    def release(self) -> None:
        self.server.reserved -= self.outputs
        self.outputs = 0
