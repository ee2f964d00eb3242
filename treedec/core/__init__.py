"""The engine core: one model's online scheduler behind messages, and the one client interface to it (vLLM v1's
``EngineCore`` and ``EngineCoreClient``), below both of its users: ``treedec serve``'s frontend (:mod:`treedec.serve`)
and the offline :class:`~treedec.LLM` with ``engine_process=True``.

- :class:`OnlineEngine` (:mod:`treedec.core.online_engine`): a thread driving the online scheduler over one engine,
  requests turned into programs;
- :class:`EngineCore` (:mod:`treedec.core.engine_core`): it behind the messages of :mod:`treedec.core.messages` (one
  out per engine iteration), in the caller's process or in one of its own (:func:`run_core_process`);
- :class:`CoreClient` (:mod:`treedec.core.client`): the frontend's side, on an event loop: :class:`InProcessClient`,
  :class:`ProcessClient` (:mod:`treedec.core.process_client`: ZMQ to the core's own process, started by
  :func:`launch_core`); a generated request's tokens detokenized and its stop strings matched there
  (:mod:`treedec.core.output_processor`);
- :class:`SyncClient` (:mod:`treedec.core.sync_client`): a process client driven from blocking code (the offline
  ``LLM(..., engine_process=True)``'s, started by :func:`start_core`), as vLLM's ``SyncMPClient``.

The messages and the process client need ``pyzmq`` and ``msgspec`` (the ``serve`` extra); the names below are
imported when first used (PEP 562).
"""
from treedec.lazy import lazy_names

#: Each public name -> the module it is defined in.
_NAMES = {"OnlineEngine": "treedec.core.online_engine", "EngineCore": "treedec.core.engine_core",
          "run_core_process": "treedec.core.engine_core", "CoreClient": "treedec.core.client",
          "EngineDeadError": "treedec.core.client", "EngineError": "treedec.core.client",
          "EngineStartupError": "treedec.core.client", "InProcessClient": "treedec.core.client",
          "ProcessClient": "treedec.core.process_client", "launch_core": "treedec.core.process_client",
          "SyncClient": "treedec.core.sync_client", "start_core": "treedec.core.sync_client"}

__all__ = sorted(_NAMES)

__getattr__, __dir__ = lazy_names(globals(), _NAMES)
