"""AttentionVariant: what one attention layer computes beyond plain scaled softmax attention.

FlashInfer's idea (``include/flashinfer/attention/variants.cuh``): a variant is a small set of hooks on one
kernel template, not a new kernel. treedec splits a variant's fields by where they act:

- **mask fields** (``window``) go to the planner: a query's root-path intervals are clipped to the keys it may
  read, so chunks outside every query's window are never planned nor read;
- **logit fields** (``sm_scale``, ``logit_softcap``) go to the kernels as compile-time flags (a kernel is built
  for each variant key that is used, :meth:`AttentionVariant.kernel_key`).

The methods here are the one Python definition of the semantics: the reference and torch backends call them,
and the kernels are tested against them.
"""
from __future__ import annotations

import dataclasses
import math

import torch

__all__ = ["AttentionVariant"]


@dataclasses.dataclass(frozen=True)
class AttentionVariant:
    """What one attention layer computes (hashable: plans and kernels are keyed by it).

    Parameters
    ----------
    sm_scale : the softmax scale; None means ``1 / sqrt(head_dim)`` (:meth:`scale`).
    logit_softcap : Gemma 2's attention-logit soft-cap ``c``: a scaled logit ``s`` becomes ``c * tanh(s / c)``;
        None for none.
    window : a sliding window of ``window`` keys: a query at position ``p`` (its index on its root path) reads
        the keys at positions ``k`` with ``p - window < k <= p`` (transformers' ``sliding_window``, Mistral,
        Gemma 2/3 local layers); None for the whole root path.
    """

    sm_scale: float | None = None
    logit_softcap: float | None = None
    window: int | None = None

    def __post_init__(self):
        for name in ("sm_scale", "logit_softcap"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value <= 0):
                raise ValueError(f"{name} must be a finite number > 0 or None, got {value!r}")
            if value is not None:
                object.__setattr__(self, name, float(value))
        if self.window is not None and (type(self.window) is not int or self.window < 1):
            raise ValueError(f"window must be an int >= 1 or None, got {self.window!r}")

    def scale(self, head_dim: int) -> float:
        """The softmax scale for ``head_dim``."""
        return self.sm_scale if self.sm_scale is not None else 1.0 / math.sqrt(head_dim)

    def logits(self, scores: torch.Tensor) -> torch.Tensor:
        """The logit hooks on ``scores`` (already scaled, any shape; computed in fp32 by the caller)."""
        if self.logit_softcap is None:
            return scores
        cap = self.logit_softcap
        return torch.tanh(scores / cap) * cap

    def visible(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        """The mask fields: ``[Q, T]`` bool, whether a query at ``query_positions[i]`` may read a key at
        ``key_positions[t]`` by position alone (the tree's ancestry is the caller's mask, and-ed with this)."""
        q, k = query_positions[:, None], key_positions[None, :]
        seen = k <= q
        if self.window is not None:
            seen = seen & (k > q - self.window)
        return seen

    def kernel_key(self) -> tuple:
        """The compile-time flags a kernel is built for (the logit fields' presence; the values are arguments)."""
        return (self.logit_softcap is not None,)
