"""A family's weight map: every checkpoint tensor, the treedec parameter (rows) it fills, how tensor parallelism
cuts it, and its GGUF name.

One map per family (:meth:`~treedec.models.registry.Family.weight_map`), read by everything that names a
tensor: checkpoint loading (:mod:`~treedec.models.hf_tensors`), the header checks
(:mod:`~treedec.models.checkpoint_headers`), tensor-parallel slicing (:mod:`~treedec.models.tensor_parallel`),
the GGUF names (:mod:`~treedec.models.gguf`) and the conversion back to transformers
(:func:`~treedec.models.loading.to_hf_state_dict`).

A map lists the model's global tensors and one layer's (names with ``{i}``, the layer index), so that a
config of a billion layers costs nothing until its tensors are walked that far.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterator

from treedec.models.config import ModelConfig

__all__ = ["Split", "VOCAB_SPLIT", "Weight", "WeightMap", "decoder_weights"]

_LAYER = re.compile(r"model\.layers\.(0|[1-9][0-9]*)\.(.+)")
_GGUF_LAYER = re.compile(r"blk\.(0|[1-9][0-9]*)\.(.+)")


@dataclass(frozen=True)
class Split:
    """How tensor parallelism cuts a checkpoint tensor.

    ``dim`` 0 (column-parallel: output rows) or 1 (row-parallel: input columns); ``parts``: the sizes along
    ``dim`` of the pieces fused in the tensor (``(q, kv, kv)`` for a fused q/k/v projection, one size for
    a plain one), each cut evenly: rank ``r`` of ``N`` holds the ``r``-th ``1 / N`` of every part,
    concatenated. ``vocab``: the LM head's rows, ``ceil(vocab / N)`` a rank (fewer on the last).
    """

    dim: int
    parts: tuple[int, ...] = ()
    vocab: bool = False


#: The LM head's split (vocabulary rows; see :class:`Split`).
VOCAB_SPLIT = Split(0, vocab=True)


@dataclass(frozen=True)
class Weight:
    """One checkpoint tensor (a layer's with ``{i}`` in its names).

    ``hf``: its Hugging Face name; ``param``: the treedec parameter it fills; ``rows``: ``(start, stop)``
    rows of that parameter (a part of a fused one), None for all of it; ``split``: how tensor parallelism
    cuts it (None: every rank holds it whole); ``gguf``: llama.cpp's name for it (None: no GGUF file holds
    it).
    """

    hf: str
    param: str
    rows: tuple[int, int] | None = None
    split: Split | None = None
    gguf: str | None = None

    def at(self, layer: int) -> "Weight":
        """The tensor of layer ``layer`` (a global tensor is itself)."""
        if "{i}" not in self.hf:
            return self
        return Weight(self.hf.format(i=layer), self.param.format(i=layer), self.rows, self.split,
                      None if self.gguf is None else self.gguf.format(i=layer))

    def row_slice(self) -> slice:
        """:attr:`rows` as a slice of the parameter."""
        return slice(None) if self.rows is None else slice(*self.rows)


class WeightMap:
    """The tensors of a model of ``num_layers`` layers: ``globals`` and each layer's (``layer``, with ``{i}``).

    Iterating gives every :class:`Weight` (the globals, then layer by layer), lazily.
    """

    def __init__(self, globals_: list[Weight], layer: list[Weight], num_layers: int):
        self.globals, self.layer, self.num_layers = tuple(globals_), tuple(layer), num_layers
        self._global = {w.hf: w for w in self.globals}
        self._layer = {w.hf[len("model.layers.{i}."):]: w for w in self.layer}
        self._gguf_global = {w.gguf: w for w in self.globals if w.gguf is not None}
        self._gguf_layer = {w.gguf[len("blk.{i}."):]: w for w in self.layer if w.gguf is not None}
        assert all(w.hf.startswith("model.layers.{i}.") for w in self.layer), [w.hf for w in self.layer]

    def __iter__(self) -> Iterator[Weight]:
        yield from self.globals
        for i in range(self.num_layers):
            for w in self.layer:
                yield w.at(i)

    def __len__(self) -> int:
        return len(self.globals) + self.num_layers * len(self.layer)

    def get(self, hf_name: str) -> Weight | None:
        """The weight named ``hf_name`` (its layer's, for a layer tensor), or None for a name the model lacks."""
        m = _LAYER.fullmatch(hf_name)
        if m is None:
            return self._global.get(hf_name)
        w = self._layer.get(m[2])
        return w.at(int(m[1])) if w is not None and int(m[1]) < self.num_layers else None

    def targets(self) -> dict[str, tuple[str, slice]]:
        """HF name -> (parameter, rows of it), every tensor."""
        return {w.hf: (w.param, w.row_slice()) for w in self}

    def from_gguf(self, gguf_name: str) -> str | None:
        """The HF name of the GGUF tensor ``gguf_name``, or None for one the model lacks."""
        m = _GGUF_LAYER.fullmatch(gguf_name)
        if m is None:
            w = self._gguf_global.get(gguf_name)
            return None if w is None else w.hf
        w = self._gguf_layer.get(m[2])
        return w.at(int(m[1])).hf if w is not None and int(m[1]) < self.num_layers else None

    def to_gguf(self, hf_name: str) -> str:
        """The GGUF name of the HF tensor ``hf_name`` (itself when it has none)."""
        w = self.get(hf_name)
        return hf_name if w is None or w.gguf is None else w.gguf


def decoder_weights(config: ModelConfig, fused_qkv: bool = False, fused_gate_up: bool = False) -> WeightMap:
    """The weight map of a decoder whose checkpoint names its tensors as transformers' Llama-like models do
    (``model.embed_tokens``, ``model.layers.{i}.self_attn.*``, ``mlp.*``, ``*_layernorm``, ``model.norm``,
    ``lm_head``), for the tensors ``config``'s block has (biases, per-head q/k norms, Gemma's four norms).

    ``fused_qkv`` / ``fused_gate_up``: the checkpoint holds ``self_attn.qkv_proj`` / ``mlp.gate_up_proj`` (Phi-3)
    rather than q/k/v and gate/up apart. GGUF names are llama.cpp's.
    """
    c = config
    q, kv, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    globals_ = [Weight("model.embed_tokens.weight", "embed_tokens.weight", gguf="token_embd.weight"),
                Weight("model.norm.weight", "norm.weight", gguf="output_norm.weight")]
    if not c.tie_word_embeddings:
        globals_.append(Weight("lm_head.weight", "lm_head.weight", split=VOCAB_SPLIT, gguf="output.weight"))
    layer = [_norm("input_layernorm", "input_norm", "attn_norm")]
    kinds = ("weight", "bias") if c.qkv_bias else ("weight",)
    if fused_qkv:
        layer += [_layer(f"self_attn.qkv_proj.{k}", f"qkv_proj.{k}", None, Split(0, (q, kv, kv)), f"attn_qkv.{k}")
                  for k in kinds]
    else:
        for proj, (start, stop), gguf in (("q", (0, q), "attn_q"), ("k", (q, q + kv), "attn_k"),
                                          ("v", (q + kv, q + 2 * kv), "attn_v")):
            layer += [_layer(f"self_attn.{proj}_proj.{k}", f"qkv_proj.{k}", (start, stop), Split(0, (stop - start,)),
                             f"{gguf}.{k}") for k in kinds]
    if c.qk_norm:
        layer += [_norm("self_attn.q_norm", "q_norm", "attn_q_norm"), _norm("self_attn.k_norm", "k_norm", "attn_k_norm")]
    layer.append(_layer("self_attn.o_proj.weight", "o_proj.weight", None, Split(1, (q,)), "attn_output.weight"))
    if c.o_bias:   # added once, after the all-reduce: whole on every rank
        layer.append(_layer("self_attn.o_proj.bias", "o_proj.bias", None, None, "attn_output.bias"))
    if c.sandwich_norms:
        layer += [_norm("post_attention_layernorm", "post_attention_norm", "post_attention_norm"),
                  _norm("pre_feedforward_layernorm", "pre_feedforward_norm", "ffn_norm"),
                  _norm("post_feedforward_layernorm", "post_feedforward_norm", "post_ffw_norm")]
    else:
        layer.append(_norm("post_attention_layernorm", "post_attention_norm", "ffn_norm"))
    kinds = ("weight", "bias") if c.mlp_bias else ("weight",)
    if fused_gate_up:
        layer += [_layer(f"mlp.gate_up_proj.{k}", f"gate_up_proj.{k}", None, Split(0, (inter, inter)), f"ffn_up.{k}")
                  for k in kinds]
    else:
        for proj, rows, gguf in (("gate", (0, inter), "ffn_gate"), ("up", (inter, 2 * inter), "ffn_up")):
            layer += [_layer(f"mlp.{proj}_proj.{k}", f"gate_up_proj.{k}", rows, Split(0, (inter,)), f"{gguf}.{k}")
                      for k in kinds]
    layer.append(_layer("mlp.down_proj.weight", "down_proj.weight", None, Split(1, (inter,)), "ffn_down.weight"))
    if c.mlp_bias:
        layer.append(_layer("mlp.down_proj.bias", "down_proj.bias", None, None, "ffn_down.bias"))
    return WeightMap(globals_, layer, c.num_layers)


def _layer(hf: str, param: str, rows: tuple[int, int] | None, split: Split | None, gguf: str) -> Weight:
    return Weight(f"model.layers.{{i}}.{hf}", f"layers.{{i}}.{param}", rows, split, f"blk.{{i}}.{gguf}")


def _norm(hf: str, param: str, gguf: str) -> Weight:
    return _layer(f"{hf}.weight", f"{param}.weight", None, None, f"{gguf}.weight")
