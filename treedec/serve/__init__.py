"""``treedec serve``: an OpenAI-compatible HTTP server (FastAPI, uvicorn) over treedec's online engine.

- the engine core it serves is :mod:`treedec.core` (the online scheduler behind messages, in a process of its own or
  in the server's, and the one client interface to it), which :class:`~treedec.LLM` uses too
  (``LLM(..., engine_process=True)``);
- :func:`build_app` (:mod:`treedec.serve.app`): the app (the frontend) over an engine core:
  ``/v1/completions``, ``/v1/chat/completions``,
  ``/v1/models``, ``/tokenize``, ``/detokenize``, ``/version``, ``/health``, ``/metrics``; with an API key
  (:mod:`treedec.serve.auth`) all but the last two need it;
- :class:`CompletionRequest`, :class:`ChatCompletionRequest`, :class:`ServeError` (:mod:`treedec.serve.protocol`):
  the request bodies and the errors, in OpenAI's shapes;
- :class:`ServeMetrics` (:mod:`treedec.serve.metrics`): the Prometheus metrics (names in its module docstring);
- what bounds a request before its work (#48): :mod:`treedec.serve.limits` (host, body bytes and arrival),
  :mod:`treedec.serve.prompts` (a text's length, tokenizing off the event loop), :mod:`treedec.serve.templates` (chat
  templates in worker processes within a time, memory and size budget);
- :func:`treedec.serve.http.make_server`: the uvicorn server ``treedec serve`` runs (OpenAI JSON for requests uvicorn
  cannot parse; a shutdown that aborts every request first).

Needs the ``serve`` extra: ``pip install 'treedec[serve]'``. The names below are imported when first used (PEP
562), so that ``import treedec.serve`` needs no FastAPI.
"""
from treedec.lazy import lazy_names

#: Each public name -> the module it is defined in.
_NAMES = {"build_app": "treedec.serve.app", "ServeMetrics": "treedec.serve.metrics",
          "ChatCompletionRequest": "treedec.serve.protocol", "CompletionRequest": "treedec.serve.protocol",
          "ServeError": "treedec.serve.protocol"}

__all__ = sorted(_NAMES)

__getattr__, __dir__ = lazy_names(globals(), _NAMES)
