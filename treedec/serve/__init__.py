"""``treedec serve``: an OpenAI-compatible HTTP server (FastAPI, uvicorn) over treedec's online engine.

- :func:`build_app` (:mod:`treedec.serve.app`): the app over one :class:`~treedec.LLM` (its engine driven by one
  :class:`~treedec.search.online.OnlineEngine` thread): ``/v1/completions``, ``/v1/chat/completions``,
  ``/v1/models``, ``/health``, ``/metrics``;
- :class:`CompletionRequest`, :class:`ChatCompletionRequest`, :class:`ServeError` (:mod:`treedec.serve.protocol`):
  the request bodies and the errors, in OpenAI's shapes;
- :class:`ServeMetrics` (:mod:`treedec.serve.metrics`): the Prometheus metrics (names in its module docstring).

Needs the ``serve`` extra: ``pip install 'treedec[serve]'``.
"""
from treedec.serve.app import build_app
from treedec.serve.metrics import ServeMetrics
from treedec.serve.protocol import ChatCompletionRequest, CompletionRequest, ServeError

__all__ = ["ChatCompletionRequest", "CompletionRequest", "ServeError", "ServeMetrics", "build_app"]
