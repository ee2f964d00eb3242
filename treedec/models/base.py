"""The model seam: what the engine and the programs use of a model, declared (:class:`DecoderModel`).

Every network an :class:`~treedec.engine.Engine` runs — a family's decoder
(:class:`~treedec.models.decoder.Decoder`, built by :mod:`~treedec.models.registry`), a tensor-parallel rank's
part of one, an EAGLE drafter — has these members, so the engine and the programs read them and never probe a
model with ``getattr``. Attention is injected (:class:`Attend`): a model hands each layer's rotated q and new
k/v to the engine, which runs that layer's :class:`~treedec.attention.variant.AttentionVariant` (scale,
soft-cap, window) over the tree; a model never applies a soft-cap or a window itself.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch
from torch import nn

from treedec.attention.variant import AttentionVariant
from treedec.models.config import ModelConfig

if TYPE_CHECKING:   # (annotations only)
    from treedec.models.tensor_parallel import TensorParallel

__all__ = ["Attend", "DecoderModel", "ForwardOutput"]


class Attend(Protocol):
    """``attend(layer, q, k, v) -> out``: store ``k, v`` [n, Hkv, D] of layer ``layer`` and attend ``q``
    [n, Hq, D] with that layer's attention variant (:meth:`DecoderModel.attention_variants`) -> [n, Hq, D]."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


class ForwardOutput(NamedTuple):
    """A step's outputs: ``logits [r, vocab]`` at the asked rows, ``hidden [n, hidden_size]`` at every
    row (the ``lm_head`` input), ``aux [n, k, hidden_size]`` (inner layers' inputs) or None."""

    logits: torch.Tensor
    hidden: torch.Tensor
    aux: torch.Tensor | None = None


class DecoderModel(Protocol):
    """What an :class:`~treedec.engine.Engine` and the programs use of a model.

    Attributes
    ----------
    config : the shape this process computes (a tensor-parallel rank's: its heads and MLP columns), which
        sizes the engine's attention and KV pool; ``config.vocab_size`` is the logits' width.
    eos_token_ids : the ids that end a generation by default (the checkpoint's; () for random weights).
    tensor_parallel : the :class:`~treedec.models.tensor_parallel.TensorParallel` group this model is split
        over, or None (the whole model in this process).
    feature_size : the width of the per-query input features the model reads (:meth:`forward`'s
        ``features``: EAGLE drafters), or None for a model that reads tokens only.
    lm_head : the LM head, ``hidden [.., hidden_size] -> logits [.., vocab]`` (a final logit soft-cap
        included: Gemma 2), what Medusa heads copy and prompt logprobs read; ``lm_head.weight``
        ``[vocab, hidden_size]`` is the whole head.
    kv_scales : ``[num_layers, 2]`` float32, the K and V scales of an fp8 KV cache an FP8 checkpoint holds
        (``k_scale`` / ``v_scale``; :mod:`~treedec.models.kv_scales`), or None: an engine with
        ``kv_cache_dtype="fp8"`` stores K/V with them.
    """

    config: ModelConfig
    eos_token_ids: tuple[int, ...]
    tensor_parallel: TensorParallel | None
    feature_size: int | None
    lm_head: nn.Module
    kv_scales: torch.Tensor | None

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype (the KV pool's and the activations')."""

    @property
    def device(self) -> torch.device:
        """Where the weights are."""

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attend: Attend,
                logits_rows: torch.Tensor | None = None, aux_layers: tuple[int, ...] = (),
                features: torch.Tensor | None = None) -> ForwardOutput:
        """One step over ``tokens [n]`` int64 at RoPE ``positions [n]`` int64 (each query's index on its own
        root path), in inference mode: logits at ``logits_rows [r]`` (default all), every row's hidden
        state, and the residual stream entering each layer of ``aux_layers`` (:class:`ForwardOutput`).
        ``features [n, feature_size]``: the per-row inputs of a model that reads them."""

    def forward_graph(self, tokens: torch.Tensor, positions: torch.Tensor, attend: Attend,
                      logits_rows: torch.Tensor | None = None, aux_layers: tuple[int, ...] = (),
                      features: torch.Tensor | None = None) -> ForwardOutput:
        """:meth:`forward` without its inference mode: what ``torch.compile`` traces and CUDA graphs capture."""

    def weight_bytes(self) -> int:
        """Bytes of the weights one full step streams (each shared tensor once)."""

    def attention_variants(self) -> tuple[AttentionVariant, ...]:
        """Each layer's attention variant, one per layer in layer order (what :class:`Attend` runs for it):
        the softmax scale, the logit soft-cap and the sliding window the checkpoint's config declares."""

    def check_aux_layers(self, layers) -> tuple[int, ...]:
        """``layers`` as a tuple of distinct layer indices whose inputs :meth:`forward` can return as ``aux``
        (ValueError naming the bad ones)."""
