"""The server's API key: :class:`APIKeyAuth`, an ASGI middleware (``treedec serve --api-key`` / ``TREEDEC_API_KEY``).

Every request but ``/health`` and ``/metrics`` (those too with ``secure_metrics``) must carry
``Authorization: Bearer <key>``; one that does not is answered 401 in OpenAI's error shape (``code:
"invalid_api_key"``, with ``WWW-Authenticate: Bearer``) before its body is read. The key is compared with
:func:`hmac.compare_digest` (its time does not depend on where a guess first differs) and is never written to a log
or an error.

vLLM guards the routes under ``/v1`` only (``--api-key`` / ``VLLM_API_KEY``): its ``/tokenize``, ``/detokenize``,
``/version`` and ``/docs`` stay open. treedec guards every route but the two probes, so a route added later is not
open by default; an unknown path is answered 401, not 404, without the key.
"""
from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse

from treedec.serve.protocol import ServeError

__all__ = ["OPEN_ROUTES", "APIKeyAuth", "check_api_key"]

#: The routes answered without the key (unless ``secure_metrics``): a load balancer's and a scraper's probes.
OPEN_ROUTES = frozenset({"/health", "/metrics"})


class APIKeyAuth:
    """The ASGI middleware (see the module docstring).

    Parameters
    ----------
    app : the app it wraps.
    api_key : the key (a non-empty string without whitespace; it is a bearer token).
    secure_metrics : ``/health`` and ``/metrics`` need the key too.
    """

    def __init__(self, app, api_key: str, secure_metrics: bool = False):
        check_api_key(api_key)
        self.app, self._key = app, api_key.encode("utf-8")
        self.open = frozenset() if secure_metrics else OPEN_ROUTES

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path", "") in self.open or self._authorized(scope):
            return await self.app(scope, receive, send)
        error = ServeError("Incorrect or missing API key: send it as the header 'Authorization: Bearer <key>'", 401,
                           code="invalid_api_key")
        response = JSONResponse(error.body(), status_code=401, headers={"www-authenticate": "Bearer"})
        await response(scope, receive, send)

    def _authorized(self, scope) -> bool:
        given = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                given = value
                break
        scheme, _, token = given.strip().partition(b" ")
        # (compare_digest on the token alone: its time depends on the lengths only, never on the key's bytes)
        return hmac.compare_digest(token.strip(), self._key) and scheme.lower() == b"bearer"


def check_api_key(api_key) -> str:
    """``api_key`` if it is a usable bearer token (a non-empty string without whitespace); ValueError otherwise
    (the message never shows the key)."""
    if not isinstance(api_key, str) or not api_key:
        shown = "an empty string" if isinstance(api_key, str) else type(api_key).__name__
        raise ValueError(f"api_key must be a non-empty string, got {shown}")
    if any(c.isspace() for c in api_key) or not api_key.isprintable():
        raise ValueError("api_key must not hold whitespace or unprintable characters (it is sent as a bearer token)")
    try:
        api_key.encode("ascii")
    except UnicodeEncodeError:
        raise ValueError("api_key must be ASCII text (HTTP headers are)") from None
    return api_key
