"""``treedec serve``: an OpenAI-compatible HTTP server (FastAPI, uvicorn) over treedec's online engine.

- :func:`build_app` (:mod:`treedec.serve.app`): the app over one :class:`~treedec.LLM` (its engine driven by one
  :class:`~treedec.runtime.online.OnlineEngine` thread): ``/v1/completions``, ``/v1/chat/completions``,
  ``/v1/models``, ``/health``, ``/metrics``;
- :class:`CompletionRequest`, :class:`ChatCompletionRequest`, :class:`ServeError` (:mod:`treedec.serve.protocol`):
  the request bodies and the errors, in OpenAI's shapes;
- :class:`ServeMetrics` (:mod:`treedec.serve.metrics`): the Prometheus metrics (names in its module docstring);
- what bounds a request before its work (#48): :mod:`treedec.serve.limits` (host, body bytes and arrival),
  :mod:`treedec.serve.prompts` (a text's length, tokenizing off the event loop), :mod:`treedec.serve.templates` (chat
  templates in worker processes within a time, memory and size budget);
- :func:`treedec.serve.http.make_server`: the uvicorn server ``treedec serve`` runs (OpenAI JSON for requests uvicorn
  cannot parse; a shutdown that aborts every request first).

Needs the ``serve`` extra: ``pip install 'treedec[serve]'``.
"""
from treedec.serve.app import build_app
from treedec.serve.metrics import ServeMetrics
from treedec.serve.protocol import ChatCompletionRequest, CompletionRequest, ServeError

__all__ = ["ChatCompletionRequest", "CompletionRequest", "ServeError", "ServeMetrics", "build_app"]
