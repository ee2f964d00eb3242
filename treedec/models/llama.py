"""The Llama-family decoder written for tree decoding.

A step's input is a flat batch of query tokens (the tree's pending tokens), each with its own
RoPE position (its depth in its token sequence, not its index in the batch). Attention is
injected: every layer hands its rotated q and its new k/v to an ``attend`` callable, which
stores k/v in the KV pool and runs tree attention (:class:`treedec.engine.Engine` builds it),
so the decoder itself holds no cache and knows nothing of the tree.

Numerics follow transformers' ``LlamaForCausalLM`` (RMSNorm in fp32 then cast, cos/sin in
fp32 then cast, residuals in the model dtype). The q/k/v projections are fused into one
GEMM (``qkv_proj``) and so are gate/up (``gate_up_proj``): one weight read and one launch
each, which matters when a step has few queries and streams all the weights.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from treedec.attention.variant import AttentionVariant
from treedec.checks import is_int
from treedec.models.config import ModelConfig
from treedec.models.rope import apply_rope, rope_cos_sin, rope_inv_freq


class Attend(Protocol):
    """``attend(layer, q, k, v) -> out``: store ``k, v`` [n, Hkv, D] and attend ``q`` [n, Hq, D] -> [n, Hq, D]."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalise in fp32, cast back, scale.

    In fp32 (nothing to cast) that is torch's ``rms_norm``, the same ops in one call (a CPU decode step spends
    most of its time outside the GEMMs in such small ops); in half precision transformers casts before it
    scales, which ``rms_norm`` does not."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then RMSNorm: returns ``(x + y, rms_norm(x + y))``."""
    s = x + y
    return s, rms_norm(s, weight, eps)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for the fused ``[n, 2 * intermediate]`` projection."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@dataclass(frozen=True)
class PointwiseOps:
    """The elementwise pieces of a layer; :meth:`Llama.compile_pointwise` swaps in fused (compiled) ones."""

    rms_norm: Callable = rms_norm
    add_rms_norm: Callable = add_rms_norm
    rope: Callable = apply_rope
    swiglu: Callable = swiglu


class RMSNorm(nn.Module):
    """The weight and eps of an RMSNorm; applied by :class:`PointwiseOps` (fused with residual adds)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.eps = eps


class DecoderLayer(nn.Module):
    """Attention (fused QKV, RoPE, injected tree attention, o_proj) then the SwiGLU MLP."""

    def __init__(self, config: ModelConfig, index: int, dtype: torch.dtype | None = None):
        super().__init__()
        c = config
        self.index = index
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.input_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.qkv_proj = nn.Linear(c.hidden_size, c.qkv_size, bias=c.qkv_bias, dtype=dtype)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=c.o_bias, dtype=dtype)
        self.post_attention_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.gate_up_proj = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=c.mlp_bias, dtype=dtype)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias, dtype=dtype)

    def forward(self, x: torch.Tensor, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend,
                next_norm: RMSNorm, ops: PointwiseOps) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` the residual stream, ``h`` its input-normed copy, both [n, hidden].

        Returns the new residual and its copy normed by ``next_norm`` (the next layer's input
        norm, or the final norm), so that each residual add is fused with the norm after it.
        """
        n, hq, hkv = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(h).view(n, hq + 2 * hkv, self.head_dim)
        qk = ops.rope(qkv[:, :hq + hkv], cos, sin)
        out = attend(self.index, qk[:, :hq], qk[:, hq:], qkv[:, hq + hkv:])
        x, h = ops.add_rms_norm(x, self.o_proj(out.reshape(n, hq * self.head_dim)),
                                self.post_attention_norm.weight, self.post_attention_norm.eps)
        mlp = self.down_proj(ops.swiglu(self.gate_up_proj(h)))
        return ops.add_rms_norm(x, mlp, next_norm.weight, next_norm.eps)


class Llama(nn.Module):
    """Llama / Mistral / Qwen2 decoder over an injected attention.

    Build it with :func:`treedec.models.from_pretrained`, :func:`~treedec.models.from_hf_model`
    or :func:`~treedec.models.from_config`; run it through :class:`treedec.engine.Engine`.
    Parameter names: ``embed_tokens``, ``layers[i].{input_norm, qkv_proj, o_proj,
    post_attention_norm, gate_up_proj, down_proj}``, ``norm``, ``lm_head`` (the embedding
    when ``tie_word_embeddings``).

    ``eos_token_ids``: the token ids that end a generation by default (the search programs'
    ``eos_token_id="model"``); :func:`~treedec.models.from_pretrained` reads them from the
    checkpoint, other builders leave them empty.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype | None = None):
        super().__init__()
        self.config = config
        self.eos_token_ids: tuple[int, ...] = ()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(config, i, dtype) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        self.ops = PointwiseOps()
        self.tie_weights()

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def tie_weights(self) -> None:
        """Make ``lm_head`` share the embedding when the config ties them (again after ``to_empty``)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def attention_variants(self) -> tuple[AttentionVariant, ...]:
        """What each layer's attention computes, one :class:`~treedec.attention.AttentionVariant` a layer (the
        engine groups layers by them): the default softmax scale, and Mistral's sliding window where its config
        has one (``sliding_window``; Qwen2's applies to some layers only and stays a cap on the positions)."""
        window = self.config.sliding_window if self.config.model_type == "mistral" else None
        return (AttentionVariant(window=window),) * self.config.num_layers

    def weight_bytes(self) -> int:
        """Bytes of all parameters, each shared tensor once (what a full forward streams, embedding included)."""
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def compile_pointwise(self, **compile_kwargs) -> None:
        """Fuse the elementwise ops (norms with their residual adds, RoPE, SwiGLU) with ``torch.compile``.

        Cuts a layer from ~25 kernel launches to ~12 on a GPU. Each op is compiled once with
        a dynamic row count (``dynamic=True`` unless overridden) on its first call.
        """
        compile_kwargs.setdefault("dynamic", True)
        self.ops = PointwiseOps(*(torch.compile(f, **compile_kwargs)
                                  for f in (rms_norm, add_rms_norm, apply_rope, swiglu)))

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attend: Attend,
                logits_rows: torch.Tensor | None = None, aux_layers: tuple[int, ...] = (),
                features: torch.Tensor | None = None) -> ForwardOutput:
        """Logits of a step, the hidden states they came from, and (optionally) inner layers' inputs.

        Parameters
        ----------
        tokens : [n] int64
            Token ids of the step's queries.
        positions : [n] int64
            RoPE position of each (its index in its own token sequence).
        attend : Attend
            Stores each layer's k/v and attends its q (see :class:`Attend`).
        logits_rows : [r] int64, optional
            Rows whose logits to compute (default all n).
        aux_layers : layer indices
            Also return the residual stream entering each of these layers (what EAGLE-3
            drafters read: ``aux[:, j]`` is the input of layer ``aux_layers[j]``).
        features : must be None: per-row input features are for drafter models
            (:class:`~treedec.models.eagle_drafter.EagleDrafter`), which share this signature.

        Returns
        -------
        :class:`ForwardOutput`: ``logits [r, vocab_size]``, ``hidden [n, hidden_size]`` (every
        row's state after the final norm: the input of ``lm_head``, what Medusa heads read), and
        ``aux [n, len(aux_layers), hidden_size]`` (None without ``aux_layers``), in the model dtype.
        """
        return self.forward_graph(tokens, positions, attend, logits_rows, aux_layers, features)

    def forward_graph(self, tokens: torch.Tensor, positions: torch.Tensor, attend: Attend,
                      logits_rows: torch.Tensor | None = None, aux_layers: tuple[int, ...] = (),
                      features: torch.Tensor | None = None) -> ForwardOutput:
        """:meth:`forward` without its inference mode, for ``torch.compile`` to trace (under
        ``torch.no_grad``: AOTAutograd cannot take views of the caller's tensors made in inference mode)."""
        if features is not None:
            raise ValueError("a Llama target takes no per-row features (they are for EAGLE drafters)")
        cos, sin = rope_cos_sin(self.inv_freq, positions, self.dtype)
        x = self.embed_tokens(tokens)
        h = self.ops.rms_norm(x, self.layers[0].input_norm.weight, self.layers[0].input_norm.eps)
        aux = []
        for i, layer in enumerate(self.layers):
            if i in aux_layers:
                aux.append(x)
            next_norm = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.norm
            x, h = layer(x, h, cos, sin, attend, next_norm, self.ops)
        logits = self.lm_head(h if logits_rows is None else h[logits_rows])
        return ForwardOutput(logits, h, torch.stack([aux[sorted(aux_layers).index(i)] for i in aux_layers], dim=1)
                             if aux_layers else None)

    def check_aux_layers(self, layers) -> tuple[int, ...]:
        """``layers`` as a tuple of distinct layer indices of this model (ValueError naming the bad one)."""
        out = tuple(layers)
        bad = [i for i in out if not is_int(i) or not 0 <= i < len(self.layers)]
        if bad or len(set(out)) != len(out):
            raise ValueError(f"hidden-state layers must be distinct layer indices in [0, {len(self.layers)}), "
                             f"got {list(out)}")
        return tuple(int(i) for i in out)


class ForwardOutput(NamedTuple):
    """A step's outputs: ``logits [r, vocab]`` at the asked rows, ``hidden [n, hidden_size]`` at every
    row (the ``lm_head`` input), ``aux [n, k, hidden_size]`` (inner layers' inputs) or None."""

    logits: torch.Tensor
    hidden: torch.Tensor
    aux: torch.Tensor | None = None
