"""A small draft model as the draft source: EAGLE-2-style dynamic token trees from its own tree steps.

The draft model (same vocabulary as the target) runs on its own :class:`~treedec.engine.Engine`.
Each proposal is ``depth`` draft engine steps:

1. *sync*: the tokens the target emitted since the last proposal, root included, that
   the draft has not computed yet, in one step (logits of the root);
2. one step per tree layer: the ``top_k`` nodes of the layer with the highest cumulative
   log-prob (the frontier) are computed together, each giving its ``top_k`` most likely
   children (the tree :func:`~treedec.tree.token_tree.expand_by_logprob` grows).

Of every node made, the ``total_tokens`` with the highest cumulative log-prob form the
tree that the target verifies.

Greedy (top-k) drafts of a batch that share the draft engine draft *together*, as EAGLE's do
(:class:`~treedec.programs.speculative.drafter_batch.DrafterGroup`): one sync step for every request's new
tokens, then the ``depth - 1`` layer steps of every request's frontier in one
:class:`~treedec.engine.step_chain.StepChain` (one CUDA graph on a graphed engine), the frontier
held in ``top_k`` chains of scratch KV slots and picked on the device, one copy back at the end.
The accepted tokens are computed again in the next sync (a few rows of a step that runs anyway).

Sampled drafts (``sample``) propose alone, with the frontier nodes in the draft's tree; at the
next proposal such a draft *keeps its own K/V of the accepted path*: the accepted tokens that
were frontier nodes are moved onto the draft's sequence node (no recompute) and the rest of its
tree is pruned; only the accepted tokens it never computed and the new root are computed.
"""
from __future__ import annotations

from typing import Sequence

import torch

from treedec.engine import Engine
from treedec.sampling.params import SamplingParams
from treedec.programs.speculative.tree_drafting import EngineTreeDraft


class DraftModelDraft(EngineTreeDraft):
    """EAGLE-2-style token trees from a small draft model on its own engine.

    Parameters
    ----------
    engine : the draft model's Engine. The drafts of a batch's requests may share it (each keeps
        its own sequence in its tree; greedy drafts draft together, one draft step per tree layer
        for every request of a scheduler pass); a proposal commits every pending token of it.
    depth : tree layers (draft tokens per path), >= 1.
    top_k : nodes expanded per layer and children per expanded node, >= 1.
    total_tokens : draft tokens in the proposed tree (the best by cumulative log-prob), >= 1.
    sample : None (default): each expanded node's children are the draft's ``top_k`` most likely
        tokens, and the tree the ``total_tokens`` best nodes (EAGLE-2). A
        :class:`~treedec.sampling.params.SamplingParams`: the children are *sampled* without
        replacement from the draft's distribution processed by it (give the acceptance rule the
        same temperature, top-k and top-p), kept in draw order, and the tree is cut to
        ``total_tokens`` by dropping whole last draws, never by value (so verification by
        :class:`~treedec.programs.speculative.acceptance.RejectionSampling` stays lossless); the
        distributions drawn from are :attr:`draft_probs` after each proposal.
    seed : of the sampling draws.

    A new sequence that does not extend the draft's own (a new request) is prefilled from
    scratch; :meth:`reset` frees the draft's request.
    """

    def __init__(self, engine: Engine, depth: int = 4, top_k: int = 4, total_tokens: int = 16,
                 sample: SamplingParams | None = None, seed: int = 0):
        super().__init__(engine, "the draft model's", depth, top_k, total_tokens, sample, seed)

    def start(self, engine: Engine) -> None:
        """Check the draft shares the target's vocabulary; free the previous request."""
        target, draft = engine.model.config.vocab_size, self.engine.model.config.vocab_size
        if target != draft:
            raise ValueError(f"the draft model's vocabulary ({draft} tokens) must be the target's ({target} tokens)")
        if engine is self.engine:
            raise ValueError("the draft model needs its own Engine, not the target's")
        self.reset()

    def sync_inputs(self, seq: Sequence[int]) -> tuple[list[int], None]:
        """The tokens of ``seq`` the draft has not computed (all of it when ``seq`` does not extend the draft's
        sequence: a new request, whose old sequence is freed)."""
        t = self.engine.tree
        base = t.sequence(self._node) if self._node is not None else []
        if not base or len(seq) <= len(base) or list(seq[:len(base)]) != base:
            if self._node is not None:
                t.prune(self._node)
            self._node = None
            return [int(x) for x in seq], None
        return [int(x) for x in seq[len(base):]], None

    # ================================================================ private

    def _sync(self, seq: list[int]) -> torch.Tensor:
        """Bring the draft's node to ``seq`` (the accepted path's K/V kept); the root's logits [vocab]."""
        e, t = self.engine, self.engine.tree
        base = t.sequence(self._node) if self._node is not None else []
        if not base or len(seq) <= len(base) or seq[:len(base)] != base:
            self.reset()
            prefilled = e.prefill(seq)
            self._node = prefilled.node
            return prefilled.logits
        rest = seq[len(base):]
        keep = 0          # leading tokens of rest whose K/V the draft computed in its last tree
        while keep < len(rest) - 1 and tuple(rest[:keep + 1]) in self._computed:
            keep += 1
        ids = [self._computed[tuple(rest[:i + 1])] for i in range(keep)]
        t.accept(self._node, ids)   # their K/V move onto the node; the rest of the last tree is freed
        t.extend(self._node, rest[keep:])
        return e.step(logits_rows=e.pending_rows([self._node])).logits[0]

    def _frontier_logits(self, paths: list[tuple[int, ...]]) -> torch.Tensor:
        return self.engine.step(logits_rows=self.engine.pending_rows(self._add_frontier(paths))).logits
