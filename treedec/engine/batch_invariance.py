"""The engine's batch-invariant mode (``Engine(..., batch_invariant=True)``): a request's logits are the same bits
alone or beside any other requests, whatever the batch's size, lengths or trees.

Every kernel of a step computes a row in an order that does not depend on the other rows:

- GEMMs and norms: the model switched by :func:`~treedec.models.batch_invariant.make_batch_invariant` (CUDA: the
  Triton matmul and RMSNorm; CPU: ``F.linear`` row by row);
- attention: the ``path`` planner with a fixed chunk (:data:`BATCH_INVARIANT_CHUNK` tokens unless the caller's
  :class:`~treedec.attention.PlanConfig` gives one): each query's keys cut at absolute positions (windows of that
  many tokens of its root path), merged in window order, each window's chunk shared by the queries that read all
  its keys (:mod:`~treedec.attention.position_windows`), on a backend that computes each row of a chunk alike in
  any forest (triton on CUDA, torch's rows form on the CPU; ``auto`` chooses among them, an explicit ``cuda`` or
  ``reference`` is refused). A shared prefix's whole windows are read once a step; the window holding a query's own
  tokens is its own copy: the mode's cost on trees.

``compile_model`` compiles the graphed forward as in the default mode: the GEMMs, norms, attention and K/V store
are custom ops Inductor keeps whole, so it fuses only the elementwise code between them (RoPE, the activation, the
embedding's gather, the soft-cap), whose per-element math does not follow the row count.

Refused (ValueError naming the option): a planner config that is not ``path`` with a fixed chunk, and what the
model's switch refuses (quantized weights, tensor parallelism over several ranks, pointwise ops fused before the
switch).
"""
from __future__ import annotations

import dataclasses
import logging

from treedec.attention import PlanConfig, TreeAttention
from treedec.models.batch_invariant import BatchInvariance, BatchInvariantUnquantized, make_batch_invariant
from treedec.models.linear import Linear

__all__ = ["BATCH_INVARIANT_CHUNK", "engine_plan_config", "switch_model"]

logger = logging.getLogger("treedec")

#: The mode's attention chunk (tokens of a query's path per partial) where the caller gives none.
BATCH_INVARIANT_CHUNK = 256


def engine_plan_config(plan_config: PlanConfig | None, batch_invariant: bool) -> PlanConfig:
    """The plan config of an engine's attention: ``plan_config`` (None: ``PlanConfig()``), or in the mode (after
    checking its options) the ``path`` planner with the given chunk (None: :data:`BATCH_INVARIANT_CHUNK`)."""
    if not isinstance(batch_invariant, bool):
        raise TypeError(f"batch_invariant must be a bool, got {batch_invariant!r}")
    if plan_config is not None and not isinstance(plan_config, PlanConfig):
        raise TypeError(f"plan_config must be a PlanConfig or None, got {type(plan_config).__name__}")
    if not batch_invariant:
        return PlanConfig() if plan_config is None else plan_config
    if plan_config is None:
        return PlanConfig("path", BATCH_INVARIANT_CHUNK, batch_invariant=True)
    if plan_config.planner != "path" or plan_config.chunk_size is None:
        raise ValueError(f"batch_invariant=True plans attention with planner='path' and a fixed chunk_size (a "
                         f"query's chunks then follow its own path only): give plan_config=PlanConfig('path', "
                         f"chunk_size=N) or None, got planner={plan_config.planner!r}, "
                         f"chunk_size={plan_config.chunk_size!r}")
    return dataclasses.replace(plan_config, batch_invariant=True)


def switch_model(model, attention: TreeAttention) -> BatchInvariance:
    """Switch ``model``'s GEMMs and norms over (:func:`~treedec.models.batch_invariant.make_batch_invariant`) once
    the engine's ``attention`` is built, and log what the mode runs."""
    switched = make_batch_invariant(model)
    logger.info("batch-invariant mode: GEMMs and norms %s; attention %s on the %s backend (%s)", switched.summary,
                attention.plan_config, attention.backend, attention.backend_reason)
    return switched


def refuse_switched_model(model) -> None:
    """An engine outside the mode refuses a model an engine in the mode switched (its projections run the
    batch-invariant kernels in place): it would run them while reporting the default mode."""
    if any(isinstance(m, Linear) and isinstance(m.method, BatchInvariantUnquantized) for m in model.modules()):
        raise ValueError("this model was switched to batch-invariant GEMMs by an Engine(batch_invariant=True) (in "
                         "place); an engine on it runs them: pass batch_invariant=True, or load the model again for "
                         "the default mode")
