"""The blocks every family's decoder is made of, as transformers computes them.

- RMSNorm with an optional offset: Llama's ``w * cast(norm(x))`` (Llama, Mistral, Qwen2/3, Phi-3), or Gemma's
  ``cast(norm(x) * (1 + w))`` in float32; fused with the residual add before it (:func:`add_rms_norm`).
- :class:`DecoderLayer`'s attention: one fused q/k/v GEMM (``qkv_proj``), optional per-head q/k RMSNorms
  (Qwen3, Gemma 3) before RoPE, the injected tree attention, ``o_proj``; its gated MLP: one fused gate/up GEMM
  (``gate_up_proj``), ``act(gate) * up`` with SiLU (SwiGLU) or GeLU-tanh (Gemma), ``down_proj``; pre-norm
  (two norms a layer) or Gemma's sandwich (four: after attention and after the MLP too).

The fused GEMMs read each weight once and launch once, which matters when a step has few queries and streams
all the weights. The elementwise pieces are :class:`PointwiseOps`, which ``compile_pointwise`` swaps for fused
(compiled) ones.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch import nn

from treedec.models.base import Attend
from treedec.models.config import ModelConfig
from treedec.models.linear import UNQUANTIZED, Linear, LinearMethod
from treedec.models.rope import apply_rope

if TYPE_CHECKING:   # (annotations only)
    from treedec.models.tensor_parallel import TensorParallel

__all__ = ["DecoderLayer", "PointwiseOps", "RMSNorm", "SoftCappedLinear", "add_rms_norm", "gated_activation",
           "rms_norm"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """RMSNorm over the last dim, as transformers computes it.

    ``offset`` 0 (LlamaRMSNorm): normalise in fp32, cast back, scale by ``weight``; in fp32 that is torch's
    ``rms_norm``, the same ops in one call (a CPU decode step spends most of its time outside the GEMMs in such
    small ops). ``offset`` 1 (Gemma's RMSNorm): scale by ``1 + weight`` in fp32, then cast.
    """
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight + offset if offset else weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (h * (offset + weight.float())).to(x.dtype)
    return weight * h.to(x.dtype)


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then RMSNorm: returns ``(x + y, rms_norm(x + y))``."""
    s = x + y
    return s, rms_norm(s, weight, eps, offset)


def gated_activation(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(gate) * up`` for the fused ``[n, 2 * intermediate]`` projection; ``activation`` "silu" (SwiGLU)
    or "gelu_tanh" (Gemma's ``gelu_pytorch_tanh``)."""
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    return F.gelu(gate, approximate="tanh") * up


@dataclass(frozen=True)
class PointwiseOps:
    """The elementwise pieces of a layer; a decoder's ``compile_pointwise`` swaps in fused (compiled) ones.

    ``batch_invariant``: the batch-invariant kernel whose norms these are (one of
    :data:`~treedec.models.batch_invariant.BATCH_INVARIANT_KERNELS`: custom ops that ``torch.compile`` keeps
    whole), None for the default ones; ``fused``: compiled by :meth:`compiled`."""

    rms_norm: Callable = rms_norm
    add_rms_norm: Callable = add_rms_norm
    rope: Callable = apply_rope
    gated: Callable = gated_activation
    batch_invariant: str | None = None
    fused: bool = False

    def compiled(self, **compile_kwargs) -> "PointwiseOps":
        """These ops, each compiled with ``torch.compile`` (on its first call; ``dynamic=True`` unless overridden);
        the batch-invariant norms stay their custom ops inside (Inductor fuses only the code around them)."""
        compile_kwargs.setdefault("dynamic", True)
        return dataclasses.replace(self, fused=True, **{name: torch.compile(getattr(self, name), **compile_kwargs)
                                                        for name in ("rms_norm", "add_rms_norm", "rope", "gated")})


class RMSNorm(nn.Module):
    """The weight, eps and offset of an RMSNorm (``offset`` 1.0: it scales by ``1 + weight``); applied by
    :class:`PointwiseOps` (fused with residual adds)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.eps, self.offset = eps, offset

    def apply(self, x: torch.Tensor, ops: PointwiseOps) -> torch.Tensor:
        """``rms_norm(x)`` through ``ops``."""
        return ops.rms_norm(x, self.weight, self.eps, self.offset)

    def add_apply(self, x: torch.Tensor, y: torch.Tensor, ops: PointwiseOps) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + y, rms_norm(x + y))`` through ``ops``."""
        return ops.add_rms_norm(x, y, self.weight, self.eps, self.offset)


class SoftCappedLinear(Linear):
    """A (replicated) :class:`~treedec.models.linear.Linear` whose outputs are soft-capped: ``c * tanh(y / c)``
    (Gemma 2's final logits), in the output dtype as transformers computes it."""

    def __init__(self, in_features: int, out_features: int, softcap: float, bias: bool = False,
                 dtype: torch.dtype | None = None, method: LinearMethod = UNQUANTIZED):
        super().__init__(in_features, out_features, bias=bias, dtype=dtype, method=method)
        self.softcap = softcap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(super().forward(x) / self.softcap) * self.softcap


class DecoderLayer(nn.Module):
    """Attention then the gated MLP, each behind a residual add (parameters named as the Llama layer's were).

    Attention: ``qkv_proj`` (one fused GEMM, ``[q | k | v]`` rows), optional per-head ``q_norm`` / ``k_norm``
    over head_dim before RoPE (``config.qk_norm``: Qwen3, Gemma 3), the injected tree attention, ``o_proj``.
    MLP: ``gate_up_proj`` (``[gate | up]`` rows), ``act(gate) * up`` (``config.activation``), ``down_proj``.
    Each projection is a :class:`~treedec.models.linear.Linear`: ``qkv_proj`` and ``gate_up_proj``
    column-parallel (shards ``(q, kv, kv)`` and ``(inter, inter)`` of this rank's ``config``), ``o_proj`` and
    ``down_proj`` row-parallel over ``tensor_parallel`` (None: one process); ``methods(name)`` gives the
    quantization method of the projection ``name`` (``"qkv_proj"``, ...; default unquantized).

    Norms (named as in the Hugging Face checkpoints): ``input_norm`` before attention, then for a pre-norm
    layer ``post_attention_norm`` before the MLP; for a sandwich layer (``config.sandwich_norms``: Gemma)
    ``post_attention_norm`` on attention's output, ``pre_feedforward_norm`` before the MLP and
    ``post_feedforward_norm`` on its output.
    """

    def __init__(self, config: ModelConfig, index: int, dtype: torch.dtype | None = None,
                 tensor_parallel: TensorParallel | None = None,
                 methods: Callable[[str], LinearMethod] = lambda name: UNQUANTIZED):
        super().__init__()
        c, tp = config, tensor_parallel
        q, kv, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
        self.index, self.activation = index, c.activation
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.input_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, c.norm_offset)
        self.qkv_proj = Linear(c.hidden_size, c.qkv_size, c.qkv_bias, dtype, mode="column", shards=(q, kv, kv),
                               method=methods("qkv_proj"))
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype, c.norm_offset)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype, c.norm_offset)
        else:
            self.q_norm = self.k_norm = None
        self.o_proj = Linear(q, c.hidden_size, c.o_bias, dtype, mode="row", tensor_parallel=tp,
                             method=methods("o_proj"))
        self.post_attention_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, c.norm_offset)
        if c.sandwich_norms:
            self.pre_feedforward_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, c.norm_offset)
            self.post_feedforward_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, c.norm_offset)
        else:
            self.pre_feedforward_norm = self.post_feedforward_norm = None
        self.gate_up_proj = Linear(c.hidden_size, 2 * inter, c.mlp_bias, dtype, mode="column", shards=(inter, inter),
                                   method=methods("gate_up_proj"))
        self.down_proj = Linear(inter, c.hidden_size, c.mlp_bias, dtype, mode="row", tensor_parallel=tp,
                                method=methods("down_proj"))

    def forward(self, x: torch.Tensor, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend,
                next_norm: RMSNorm, ops: PointwiseOps) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` the residual stream, ``h`` its input-normed copy, both [n, hidden]; ``cos, sin`` [n, head_dim]
        this layer's RoPE.

        Returns the new residual and its copy normed by ``next_norm`` (the next layer's input
        norm, or the final norm), so that each residual add is fused with the norm after it.
        """
        attn = self.attention(h, cos, sin, attend, ops)
        if self.pre_feedforward_norm is None:
            x, h = self.post_attention_norm.add_apply(x, attn, ops)
            return next_norm.add_apply(x, self.mlp(h, ops), ops)
        x, h = self.pre_feedforward_norm.add_apply(x, self.post_attention_norm.apply(attn, ops), ops)
        return next_norm.add_apply(x, self.post_feedforward_norm.apply(self.mlp(h, ops), ops), ops)

    def attention(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend, ops: PointwiseOps
                  ) -> torch.Tensor:
        """``h`` [n, hidden] (normed) -> the attention output projected back, [n, hidden]."""
        n, hq, hkv = h.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(h).view(n, hq + 2 * hkv, self.head_dim)
        if self.q_norm is None:
            qk = ops.rope(qkv[:, :hq + hkv], cos, sin)
        else:   # each head normed over head_dim, then rotated (q and k in one rotation)
            qk = ops.rope(torch.cat([self.q_norm.apply(qkv[:, :hq], ops),
                                     self.k_norm.apply(qkv[:, hq:hq + hkv], ops)], dim=1), cos, sin)
        out = attend(self.index, qk[:, :hq], qk[:, hq:], qkv[:, hq + hkv:])
        return self.o_proj(out.reshape(n, hq * self.head_dim))

    def mlp(self, h: torch.Tensor, ops: PointwiseOps) -> torch.Tensor:
        """``down_proj(act(gate) * up)`` of ``h`` [n, hidden] (normed)."""
        return self.down_proj(ops.gated(self.gate_up_proj(h), self.activation))
