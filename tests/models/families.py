"""Helpers of the per-family tests: tiny random transformers models of each family, a dense attention that runs
each layer's :class:`~treedec.attention.variant.AttentionVariant` (scale, soft-cap, window) over one sequence,
and the comparisons every family's test makes (logits == transformers within 1e-4 in fp32, greedy tokens equal,
tree steps on an :class:`~treedec.engine.Engine` == transformers on each path)."""
from __future__ import annotations

import numpy as np
import torch

from tests.models.test_llama import randomize
from treedec.models import from_hf_model

ATOL = 1e-4
# the tiny shape every family's test starts from (head dim 64: one the engine's attention runs)
TINY = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=512)


def tiny(config_class, model_class, seed: int = 0, **fields):
    """A tiny random transformers model (eager attention, fp32) of ``config_class`` with ``fields``."""
    config = config_class(**{**TINY, **fields})
    config._attn_implementation = "eager"
    return randomize(model_class(config), seed)


class DenseAttend:
    """``attend(layer, q, k, v)`` over the forward's own rows, one sequence at positions 0..n-1, with the layer's
    variant (the one Python definition of its semantics: ``scale``, ``logits``, ``visible``); no cache."""

    def __init__(self, variants):
        self.variants = variants

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        variant, n, group = self.variants[layer], q.shape[0], q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1).float(), v.repeat_interleave(group, 1).float()
        scores = variant.logits(torch.einsum("qhd,khd->hqk", q.float(), k) * variant.scale(q.shape[-1]))
        positions = torch.arange(n)
        scores = scores.masked_fill(~variant.visible(positions, positions), float("-inf"))
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)


def dense_logits(model, tokens: list[int]) -> torch.Tensor:
    """treedec's logits ``[n, vocab]`` of ``tokens`` run as one sequence through :class:`DenseAttend`."""
    t = torch.tensor(tokens)
    return model(t, torch.arange(len(t)), DenseAttend(model.attention_variants())).logits


def hf_all_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    """transformers' logits ``[n, vocab]`` of ``tokens`` (positions 0..n-1)."""
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0]


def check_against_transformers(hf_model, tokens: list[int], new_tokens: int = 8) -> None:
    """The family's model from ``hf_model``: every position's logits within :data:`ATOL` of transformers', and
    ``new_tokens`` greedy tokens (each step a whole forward) equal to transformers' greedy ``generate``."""
    model = from_hf_model(hf_model)
    torch.testing.assert_close(dense_logits(model, tokens), hf_all_logits(hf_model, tokens), atol=ATOL, rtol=0)
    ours = list(tokens)
    for _ in range(new_tokens):
        ours.append(int(dense_logits(model, ours)[-1].argmax()))
    with torch.no_grad():
        theirs = hf_model.generate(torch.tensor([tokens]), max_new_tokens=new_tokens, do_sample=False,
                                   min_new_tokens=new_tokens, pad_token_id=0)[0].tolist()
    assert ours == theirs, (ours, theirs)


def check_tree_steps(engine, hf_model, seed: int = 0) -> None:
    """A prompt, a branching step and a speculative token tree on ``engine``: every query's logits equal
    transformers' run on its own root-to-query path (within :data:`ATOL`)."""
    rng = np.random.default_rng(seed)
    vocab = hf_model.config.vocab_size
    prompt = rng.integers(0, vocab, 13).tolist()
    root = engine.prefill(prompt)
    torch.testing.assert_close(root.logits, hf_all_logits(hf_model, prompt)[-1], atol=ATOL, rtol=0)
    engine.tree.branch(root.node, [[int(t)] for t in rng.integers(0, vocab, 3)] + [rng.integers(0, vocab, 4).tolist()])
    _check_step(engine, hf_model)
    leaf = engine.tree.live_leaves()[0]
    engine.tree.add_token_tree(leaf, rng.integers(0, vocab, 6).tolist(), [-1, 0, 0, 1, 1, 3])
    _check_step(engine, hf_model)


def _check_step(engine, hf_model) -> None:
    layout = engine.tree.layout()
    nodes, positions = layout.node_ids[layout.query_node], layout.query_position
    paths = [engine.tree.sequence(int(nodes[r]))[: positions[r] + 1] for r in range(layout.num_queries)]
    logits = engine.step().logits
    for row, path in enumerate(paths):
        torch.testing.assert_close(logits[row], hf_all_logits(hf_model, path)[-1], atol=ATOL, rtol=0)
