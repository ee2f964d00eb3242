"""Tiny GGUF model files written with the ``gguf`` package (tests only): a 2-layer Llama (or Qwen2) with a
byte-level BPE tokenizer of 300 tokens, whose metadata keys and tensors a test may replace or remove.

The callers import ``gguf`` first (``pytest.importorskip("gguf")``): this module imports it when it writes.
"""
from __future__ import annotations

import numpy as np

HIDDEN, HEADS, KV_HEADS, INTER, VOCAB, LAYERS = 64, 4, 2, 128, 300, 2


def byte_level_tokens(count: int) -> list[str]:
    """GPT-2's byte alphabet, one merge ("ab"), then filler tokens."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    alphabet = bytes_to_unicode()
    return [alphabet[i] for i in range(256)] + ["ab"] + [f"<t{i}>" for i in range(257, count)]


def good_tensors(layers: int = LAYERS, qkv_bias: bool = False, heads: tuple[int, int] = (HEADS, KV_HEADS)
                 ) -> dict[str, np.ndarray]:
    """The tensors of the tiny model; ``heads``: (query, key/value) heads of ``HIDDEN // heads[0]`` dimensions."""
    rng = np.random.default_rng(0)
    (q_heads, kv_heads), head_dim = heads, HIDDEN // heads[0]

    def weight(*shape):
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    out = {"token_embd.weight": weight(VOCAB, HIDDEN), "output_norm.weight": 1 + weight(HIDDEN),
           "output.weight": weight(VOCAB, HIDDEN)}
    for i in range(layers):
        b = f"blk.{i}."
        out.update({b + "attn_norm.weight": 1 + weight(HIDDEN), b + "ffn_norm.weight": 1 + weight(HIDDEN),
                    b + "attn_q.weight": weight(q_heads * head_dim, HIDDEN),
                    b + "attn_k.weight": weight(kv_heads * head_dim, HIDDEN),
                    b + "attn_v.weight": weight(kv_heads * head_dim, HIDDEN),
                    b + "attn_output.weight": weight(HIDDEN, q_heads * head_dim),
                    b + "ffn_gate.weight": weight(INTER, HIDDEN), b + "ffn_up.weight": weight(INTER, HIDDEN),
                    b + "ffn_down.weight": weight(HIDDEN, INTER)})
        if qkv_bias:
            out.update({b + f"attn_{p}.bias": weight(n * head_dim) for p, n in (("q", q_heads), ("k", kv_heads),
                                                                                  ("v", kv_heads))})
    return out


def _value(value) -> "gguf.GGUFValue":
    import gguf

    T = gguf.GGUFValueType
    if isinstance(value, list):
        return gguf.GGUFValue(value, T.ARRAY, _value(value[0]).type)
    kind = T.BOOL if isinstance(value, bool) else T.INT64 if isinstance(value, int) else \
        T.FLOAT32 if isinstance(value, float) else T.STRING
    return gguf.GGUFValue(value, kind)


def write_gguf(path, meta=None, tensors=None, arch="llama", qkv_bias=False, heads=(HEADS, KV_HEADS)):
    """A tiny GGUF model. ``meta``: metadata keys to set (None: remove); ``tensors``: to replace (None: remove);
    ``heads``: see :func:`good_tensors` (the default's head dimension, 16, is one the engine does not run)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(heads[0])
    w.add_head_count_kv(heads[1])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(VOCAB)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(byte_level_tokens(VOCAB))
    w.add_token_types([1] * VOCAB)
    w.add_token_merges(["a b"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(0)
    for key, value in (meta or {}).items():
        if value is None:
            w.kv_data[0].pop(key, None)
        else:
            w.kv_data[0][key] = _value(value)
    for name, array in {**good_tensors(qkv_bias=qkv_bias, heads=heads), **(tensors or {})}.items():
        if array is not None:
            w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
