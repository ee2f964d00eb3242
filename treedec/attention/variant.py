"""AttentionVariant: what one attention layer computes beyond plain scaled softmax attention.

FlashInfer's idea (``include/flashinfer/attention/variants.cuh``): a variant is a small set of hooks on one
kernel template, not a new kernel. treedec splits a variant's fields by where they act:

- **mask fields** (``window``) go to the planner: a query's root-path intervals are clipped to the keys it may
  read, so chunks outside every query's window are never planned nor read;
- **logit fields** (``sm_scale``, ``logit_softcap``) go to the kernels as compile-time flags (a kernel is built
  for each variant key that is used, :meth:`AttentionVariant.kernel_key`);
- the **KV dtype field** (``kv_dtype``) is what the K/V caches hold: q's dtype, or fp8 e4m3 with a scale per KV
  head (FlashInfer's ``dtype_kv``): a kernel of its own too (its key names it), the scales run-time values that
  travel with the pool's layer (:meth:`TreeAttention.run`'s ``kv_scale``).

The methods here are the one Python definition of the semantics: the reference and torch backends call them,
and the kernels are tested against them.
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import torch

__all__ = ["FP8_KV", "AttentionVariant", "LogitArgs"]

_LOG2E = 1.4426950408889634
FP8_KV = "fp8_e4m3"
_KV_DTYPES = (None, FP8_KV)   # (their index is the op's value)


class LogitArgs(NamedTuple):
    """What a kernel of :meth:`AttentionVariant.kernel_key` multiplies a raw score ``s = q . k`` by (see
    :meth:`AttentionVariant.logit_args`): with the soft-cap hook, ``t = tanh(s * softcap_scale)``, else ``t = s``;
    then the base-2 logit is ``t * scale_log2`` (the kernels' softmax runs in base 2)."""

    scale_log2: float
    softcap_scale: float   # 0.0 where the variant has no soft-cap


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
    kv_dtype : what the K/V caches hold: None for q's dtype, ``"fp8_e4m3"`` (``"fp8"`` is read as it, vLLM's
        names) for e4m3 values whose stored ``k`` stands for ``k * k_scale`` (per KV head; see
        :mod:`treedec.tree.kv_cache_dtype`).
    """

    sm_scale: float | None = None
    logit_softcap: float | None = None
    window: int | None = None
    kv_dtype: str | None = None

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
        if self.kv_dtype == "fp8":
            object.__setattr__(self, "kv_dtype", FP8_KV)
        if self.kv_dtype not in _KV_DTYPES:
            raise ValueError(f"kv_dtype must be None (q's dtype) or {FP8_KV!r}, got {self.kv_dtype!r:.40}")

    @property
    def fp8_kv(self) -> bool:
        """Whether the caches hold fp8 e4m3 K/V (with scales)."""
        return self.kv_dtype == FP8_KV

    def cache_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype of the K/V caches beside q of ``dtype``."""
        return torch.float8_e4m3fn if self.fp8_kv else dtype

    def scale(self, head_dim: int) -> float:
        """The softmax scale for ``head_dim``."""
        return self.sm_scale if self.sm_scale is not None else 1.0 / math.sqrt(head_dim)

    def first_visible(self, query_positions):
        """The mask fields as a bound: the first key position each query may read (``[Q]`` ints, numpy or torch,
        in the type given): ``p - window + 1`` clipped at 0, or 0 without a window. The planners clip each query's
        root-path intervals there; :meth:`visible` is defined by it."""
        if self.window is None:
            return query_positions * 0
        lowest = query_positions - (self.window - 1)
        return lowest.clip(min=0) if hasattr(lowest, "clip") else max(lowest, 0)

    def logits(self, scores: torch.Tensor) -> torch.Tensor:
        """The logit hooks on ``scores`` (already scaled, any shape; computed in fp32 by the caller)."""
        if self.logit_softcap is None:
            return scores
        cap = self.logit_softcap
        return torch.tanh(scores / cap) * cap

    def visible(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        """The mask fields: ``[Q, T]`` bool, whether a query at ``query_positions[i]`` may read a key at
        ``key_positions[t]`` by position alone (the tree's ancestry is the caller's mask, and-ed with this)."""
        k = key_positions[None, :]
        return (k <= query_positions[:, None]) & (k >= self.first_visible(query_positions)[:, None])

    def mask_key(self) -> tuple:
        """The mask fields (what a plan depends on): layers whose variants share it share a step's plan."""
        return (self.window,)

    def kernel_key(self) -> tuple[str, ...]:
        """The hooks a kernel is built with, by name (``()``: the plain kernel, today's; ``("softcap",)``; an fp8
        KV cache adds ``"kv_fp8"``): compile-time flags, one kernel build per key used; the logit values are
        :meth:`logit_args`."""
        return (() if self.logit_softcap is None else ("softcap",)) + (("kv_fp8",) if self.fp8_kv else ())

    def logit_args(self, head_dim: int) -> LogitArgs:
        """The kernels' run-time values of the logit fields for ``head_dim`` (see :class:`LogitArgs`):
        ``c * tanh(s * scale / c)`` in base 2 is ``tanh(s * (scale / c)) * (c * log2(e))``."""
        scale = self.scale(head_dim)
        if self.logit_softcap is None:
            return LogitArgs(scale * _LOG2E, 0.0)
        return LogitArgs(self.logit_softcap * _LOG2E, scale / self.logit_softcap)

    def op_values(self) -> list[float]:
        """The fields as ``torch.ops.treedec.tree_attention`` carries them (a ``list[float]`` of its schema, in
        field order, None as 0.0: every field is > 0 when set; ``kv_dtype`` as its index in (None, ``"fp8_e4m3"``));
        :meth:`from_op_values` reads them back."""
        return [float(_KV_DTYPES.index(self.kv_dtype)) if f.name == "kv_dtype" else
                0.0 if getattr(self, f.name) is None else float(getattr(self, f.name))
                for f in dataclasses.fields(self)]

    @classmethod
    def from_op_values(cls, values) -> "AttentionVariant":
        """The variant of :meth:`op_values`' ``values``; ValueError unless there is one value per field."""
        names = [f.name for f in dataclasses.fields(cls)]
        if len(values) != len(names):
            raise ValueError(f"AttentionVariant takes {len(names)} values {names}, got {len(values)}: {list(values)}")
        fields = {name: None if value == 0 else value for name, value in zip(names, values)}
        if fields["window"] is not None:
            fields["window"] = int(fields["window"])
        fields["kv_dtype"] = _KV_DTYPES[int(values[names.index("kv_dtype")])]
        return cls(**fields)
