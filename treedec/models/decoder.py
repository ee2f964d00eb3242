"""The decoder every family builds (:class:`Decoder`), written for tree decoding.

A step's input is a flat batch of query tokens (the tree's pending tokens), each with its own
RoPE position (its depth in its token sequence, not its index in the batch). Attention is
injected: every layer hands its rotated q and its new k/v to an ``attend`` callable, which
stores k/v in the KV pool and runs tree attention with the layer's
:class:`~treedec.attention.variant.AttentionVariant` (:meth:`Decoder.attention_variants`;
:class:`treedec.engine.Engine` builds ``attend``), so the decoder holds no cache, knows nothing
of the tree, and never applies an attention soft-cap or window itself.

The family's block is its config's (:class:`~treedec.models.config.ModelConfig`; the layers of
:mod:`~treedec.models.layers`): Llama's, or with per-head q/k norms (Qwen3), or Gemma's (four
``(1 + w)`` norms a layer, GeLU-tanh, embeddings times ``sqrt(hidden_size)``, a final logit soft-cap,
its own RoPE on the sliding-window layers). Numerics follow transformers' models (norms in fp32
then cast, cos/sin in fp32 then cast, residuals in the model dtype).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from treedec.attention.variant import AttentionVariant
from treedec.checks import is_int
from treedec.models.base import Attend, ForwardOutput
from treedec.models.config import ModelConfig
from treedec.models.layers import DecoderLayer, PointwiseOps, RMSNorm, SoftCappedLinear
from treedec.models.linear import UNQUANTIZED, Linear
from treedec.models.rope import rope_attention_scale, rope_cos_sin, rope_inv_freq
from treedec.models.tensor_parallel import TensorParallel, VocabParallelHead, shard_config
from treedec.models.weights import WeightMap

if TYPE_CHECKING:   # (annotations only)
    from treedec.models.quantization import Quantization

__all__ = ["Decoder"]


class Decoder(nn.Module):
    """A decoder-only transformer of any family over an injected attention (a
    :class:`~treedec.models.base.DecoderModel`).

    Build it with :func:`treedec.models.from_pretrained`, :func:`~treedec.models.from_hf_model`
    or :func:`~treedec.models.from_config`; run it through :class:`treedec.engine.Engine`.
    Parameter names: ``embed_tokens``, ``layers[i].{input_norm, qkv_proj, q_norm, k_norm, o_proj,
    post_attention_norm, pre_feedforward_norm, post_feedforward_norm, gate_up_proj, down_proj}`` (the
    norms a family has), ``norm``, ``lm_head`` (the embedding when ``tie_word_embeddings``); the family's
    weight map names their checkpoint tensors (:mod:`~treedec.models.registry`).

    Parameters
    ----------
    config : the whole model's shape (:attr:`full_config`).
    dtype : the weights' dtype.
    tensor_parallel : build this rank's part of the model split over the group (see
        :mod:`~treedec.models.tensor_parallel`); :attr:`config` is then the shape this rank computes
        (its heads, KV heads and MLP columns: the engine sizes its attention and KV pool from it). The
        forward's inputs and outputs are the whole model's, the same on every rank.
    quantization : the :class:`~treedec.models.quantization.Quantization` of the projections (None: every
        :class:`~treedec.models.linear.Linear` unquantized), with ``weights`` the family's weight map of
        ``config`` (which checkpoint modules fill each projection: their methods).

    Attributes
    ----------
    eos_token_ids : the token ids that end a generation by default (the programs' ``eos_token_id="model"``);
        :func:`~treedec.models.from_pretrained` reads them from the checkpoint, other builders leave them empty.
    quantization : as given.
    feature_size : None (a decoder reads tokens only; EAGLE drafters read features).
    kv_scales : ``[num_layers, 2]`` float32 K and V scales of an fp8 KV cache, where the checkpoint has them
        (:func:`~treedec.models.from_pretrained` reads them: :mod:`~treedec.models.kv_scales`), else None.
    """

    feature_size = None
    kv_scales: torch.Tensor | None = None

    def __init__(self, config: ModelConfig, dtype: torch.dtype | None = None,
                 tensor_parallel: TensorParallel | None = None, quantization: Quantization | None = None,
                 weights: WeightMap | None = None):
        super().__init__()
        if tensor_parallel is not None and not isinstance(tensor_parallel, TensorParallel):
            raise TypeError(f"tensor_parallel must be a TensorParallel (e.g. init_tensor_parallel()) or None, got "
                            f"{tensor_parallel!r:.80}")
        tp = tensor_parallel
        self.full_config = config
        self.config = config if tp is None else shard_config(config, tp.size)
        self.tensor_parallel = tp
        self.eos_token_ids: tuple[int, ...] = ()
        self.quantization = quantization
        c = self.config
        methods: Callable = (lambda name: UNQUANTIZED) if quantization is None else quantization.methods(weights)
        methods("lm_head")   # the LM head stays unquantized (this raises for a scheme that quantizes it)
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(c, i, dtype, tp, lambda name, i=i: methods(f"layers.{i}.{name}"))
                                    for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, c.norm_offset)
        if tp is not None:
            self.lm_head = VocabParallelHead(c.hidden_size, c.vocab_size, tp, dtype, c.final_logit_softcap)
        elif c.final_logit_softcap is not None:
            self.lm_head = SoftCappedLinear(c.hidden_size, c.vocab_size, c.final_logit_softcap, dtype=dtype)
        else:
            self.lm_head = Linear(c.hidden_size, c.vocab_size, False, dtype)
        self._rope_of_layer = tuple(c.layer_rope(i) for i in range(c.num_layers))
        self.ops = PointwiseOps()
        self.init_buffers()
        self.tie_weights()

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def init_buffers(self) -> None:
        """(Re)compute the buffers derived from the config on the model's device: RoPE's inverse frequencies
        (``inv_freq``; ``inv_freq_local`` for a family whose sliding layers have their own RoPE) and the
        embedding scale (``embed_scale``, in the model dtype, as transformers rounds it). After ``to_empty``
        (a model built on the meta device) they must be made again."""
        c, device = self.config, self.device
        self.register_buffer("inv_freq", rope_inv_freq(c, device=device), persistent=False)
        if c.local_rope_theta is not None:
            self.register_buffer("inv_freq_local", rope_inv_freq(c, device=device, local=True), persistent=False)
        if c.embed_scale:
            self.register_buffer("embed_scale", torch.tensor(math.sqrt(c.hidden_size), dtype=self.dtype,
                                                             device=device), persistent=False)
        self._rope_scale = rope_attention_scale(c)

    def tie_weights(self) -> None:
        """Make ``lm_head`` share the embedding when the config ties them (again after ``to_empty``)."""
        if not self.config.tie_word_embeddings:
            return
        if isinstance(self.lm_head, VocabParallelHead):
            self.lm_head.tie(self.embed_tokens.weight)
        else:
            self.lm_head.weight = self.embed_tokens.weight

    def linear_paths(self) -> dict[str, int]:
        """How many projections run each compute path (:attr:`~treedec.models.linear.Linear.path`: ``F.linear``,
        ``torch._scaled_mm``, de-quantize), as loading chose them for the weights' device."""
        paths: dict[str, int] = {}
        for m in self.modules():
            if isinstance(m, Linear):
                paths[str(m.path)] = paths.get(str(m.path), 0) + 1
        return paths

    def weight_bytes(self) -> int:
        """Bytes of all parameters, each shared tensor once (what a full forward streams, embedding included)."""
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def attention_variants(self) -> tuple[AttentionVariant, ...]:
        """Each layer's :class:`~treedec.attention.variant.AttentionVariant`: the softmax scale
        (``query_pre_attn_scalar ** -0.5``, else the head dim's), the attention-logit soft-cap and the
        layer's sliding window (:meth:`~treedec.models.config.ModelConfig.layer_window`)."""
        c = self.config
        scale = None if c.query_pre_attn_scalar is None else c.query_pre_attn_scalar ** -0.5
        return tuple(AttentionVariant(sm_scale=scale, logit_softcap=c.attn_logit_softcap, window=c.layer_window(i))
                     for i in range(c.num_layers))

    def compile_pointwise(self, **compile_kwargs) -> None:
        """Fuse the elementwise ops (norms with their residual adds, RoPE, the gated activation) with
        ``torch.compile``.

        Cuts a layer from ~25 kernel launches to ~12 on a GPU. Each op is compiled once with
        a dynamic row count (``dynamic=True`` unless overridden) on its first call. In the batch-invariant mode
        (a model :func:`~treedec.models.batch_invariant.make_batch_invariant` switched) the mode's norms (with their
        residual adds) stay its custom ops inside: only RoPE and the activation are fused. A second call changes
        nothing.
        """
        if not self.ops.fused:
            self.ops = self.ops.compiled(**compile_kwargs)

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
            Stores each layer's k/v and attends its q with the layer's variant (see
            :class:`~treedec.models.base.Attend`).
        logits_rows : [r] int64, optional
            Rows whose logits to compute (default all n).
        aux_layers : layer indices
            Also return the residual stream entering each of these layers (what EAGLE-3
            drafters read: ``aux[:, j]`` is the input of layer ``aux_layers[j]``).
        features : must be None: per-row input features are for drafter models
            (:class:`~treedec.models.eagle_drafter.EagleDrafter`), which share this signature.

        Returns
        -------
        :class:`~treedec.models.base.ForwardOutput`: ``logits [r, vocab_size]`` (a final soft-cap applied),
        ``hidden [n, hidden_size]`` (every row's state after the final norm: the input of ``lm_head``, what
        Medusa heads read), and ``aux [n, len(aux_layers), hidden_size]`` (None without ``aux_layers``), in
        the model dtype.
        """
        return self.forward_graph(tokens, positions, attend, logits_rows, aux_layers, features)

    def forward_graph(self, tokens: torch.Tensor, positions: torch.Tensor, attend: Attend,
                      logits_rows: torch.Tensor | None = None, aux_layers: tuple[int, ...] = (),
                      features: torch.Tensor | None = None) -> ForwardOutput:
        """:meth:`forward` without its inference mode, for ``torch.compile`` to trace (under
        ``torch.no_grad``: AOTAutograd cannot take views of the caller's tensors made in inference mode)."""
        if features is not None:
            raise ValueError("a decoder takes no per-row features (they are for EAGLE drafters)")
        ropes = [rope_cos_sin(self.inv_freq, positions, self.dtype, self._rope_scale)]
        if self.config.local_rope_theta is not None:
            ropes.append(rope_cos_sin(self.inv_freq_local, positions, self.dtype))
        x = self.embed_tokens(tokens)
        if self.config.embed_scale:
            x = x * self.embed_scale
        h = self.layers[0].input_norm.apply(x, self.ops)
        aux = []
        for i, layer in enumerate(self.layers):
            if i in aux_layers:
                aux.append(x)
            next_norm = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.norm
            cos, sin = ropes[self._rope_of_layer[i]]
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
