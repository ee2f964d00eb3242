"""A small draft model as the draft source: EAGLE-2-style dynamic token trees from its own tree steps.

The draft model (same vocabulary as the target) runs on its own :class:`~treedec.engine.Engine`.
Each :meth:`DraftModelDraft.propose` is ``depth`` draft engine steps:

1. *sync*: the tokens the target emitted since the last proposal, root included, that
   the draft has not computed yet, in one step (logits of the root);
2. one step per tree layer: the ``top_k`` nodes of the layer with the highest cumulative
   log-prob (the frontier) are appended to the draft's tree and computed together, each
   giving its ``top_k`` most likely children (:func:`~treedec.tree.token_tree.expand_by_logprob`).

Of every node made, the ``total_tokens`` with the highest cumulative log-prob form the
tree that the target verifies. At the next proposal the draft *keeps its own K/V of the
accepted path*: the accepted tokens that were frontier nodes (so computed by the draft)
are moved onto the draft's sequence node (no recompute) and the rest of its tree is
pruned; only the accepted tokens it never computed (a last-layer leaf) and the new root
are computed, in the sync step, which the proposal runs anyway.
"""
from __future__ import annotations

from typing import Sequence

import torch

from treedec.engine import Engine
from treedec.errors import PoolExhaustedError
from treedec.search.sampling import SamplingParams, sampling_probs
from treedec.tree.token_tree import TokenTree, expand_by_logprob


class DraftModelDraft:
    """EAGLE-2-style token trees from a small draft model on its own engine.

    Parameters
    ----------
    engine : the draft model's Engine, used by this draft alone (its tree holds this
        draft's one request; a proposal commits every pending token of it).
    depth : tree layers (draft tokens per path), >= 1.
    top_k : nodes expanded per layer and children per expanded node, >= 1.
    total_tokens : draft tokens in the proposed tree (the best by cumulative log-prob), >= 1.
    sample : None (default): each expanded node's children are the draft's ``top_k`` most likely
        tokens, and the tree the ``total_tokens`` best nodes (EAGLE-2). A
        :class:`~treedec.search.sampling.SamplingParams`: the children are *sampled* without
        replacement from the draft's distribution processed by it (give the acceptance rule the
        same temperature, top-k and top-p), kept in draw order, and the tree is cut to
        ``total_tokens`` by dropping whole last draws, never by value (so verification by
        :class:`~treedec.search.acceptance.RejectionSampling` stays lossless); the
        distributions drawn from are :attr:`draft_probs` after each proposal.
    seed : of the sampling draws.

    A new sequence that does not extend the draft's own (a new request) is prefilled from
    scratch; :meth:`reset` frees the draft's request.
    """

    def __init__(self, engine: Engine, depth: int = 4, top_k: int = 4, total_tokens: int = 16,
                 sample: SamplingParams | None = None, seed: int = 0):
        if not isinstance(engine, Engine):
            raise TypeError(f"engine must be the draft model's Engine, got {type(engine).__name__}")
        for name, value in [("depth", depth), ("top_k", top_k), ("total_tokens", total_tokens)]:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if top_k > engine.model.config.vocab_size:
            raise ValueError(f"top_k ({top_k}) must be <= the draft vocabulary ({engine.model.config.vocab_size})")
        if sample is not None and (not isinstance(sample, SamplingParams) or sample.temperature == 0):
            raise ValueError(f"sample must be SamplingParams with a temperature > 0 (or None: top-k drafts), "
                             f"got {sample!r}")
        self.engine, self.depth, self.top_k, self.total_tokens = engine, depth, top_k, total_tokens
        self.sample, self.seed = sample, seed
        self.draft_probs: torch.Tensor | None = None     # with sample: [tree.size, vocab] of the last proposal
        self._generator: torch.Generator | None = None
        self._node: int | None = None                    # the draft's sequence node: computed tokens only
        self._computed: dict[tuple[int, ...], int] = {}  # token path after the root -> draft node (computed)

    def start(self, engine: Engine) -> None:
        """Check the draft shares the target's vocabulary; free the previous request."""
        target, draft = engine.model.config.vocab_size, self.engine.model.config.vocab_size
        if target != draft:
            raise ValueError(f"the draft model's vocabulary ({draft} tokens) must be the target's ({target} tokens)")
        if engine is self.engine:
            raise ValueError("the draft model needs its own Engine, not the target's")
        self.reset()

    def reset(self) -> None:
        """Free the draft's request (its KV pages)."""
        if self._node is not None:
            self.engine.tree.prune(self._node)
        self._node, self._computed = None, {}

    @property
    def node(self) -> int | None:
        """The draft engine's sequence node of the current request (None before the first proposal)."""
        return self._node

    def propose(self, sequence_tokens: Sequence[int]) -> tuple[TokenTree, list[int]]:
        seq = [int(x) for x in sequence_tokens]
        if not seq:
            raise ValueError("sequence_tokens must hold at least the root token, got none")
        root_logits = self._sync(seq)
        self._computed = {}
        if self.sample is not None:
            return self._sampled_tree(seq[-1], root_logits)
        return expand_by_logprob(seq[-1], lambda paths: self._layer(paths, root_logits), self.depth, self.top_k,
                                 self.total_tokens, batched=True)

    # ================================================================ private

    def _sampled_tree(self, root: int, root_logits: torch.Tensor) -> tuple[TokenTree, list[int]]:
        """Layer by layer: the ``top_k`` frontier nodes with the best cumulative log-prob (which nodes
        grow may depend on values) each draw ``top_k`` children without replacement from their
        processed distribution, all kept in draw order; the last draws past ``total_tokens`` are
        dropped. Sets :attr:`draft_probs`."""
        if self._generator is None or self._generator.device != root_logits.device:
            self._generator = torch.Generator(device=root_logits.device).manual_seed(self.seed)
        paths: list[tuple[int, ...]] = [()]                      # node i's token path (root: ())
        parents, scores = [-1], [0.0]
        probs = {(): sampling_probs(root_logits, self.sample)}   # path -> distribution of its children
        frontier = [0]
        for d in range(self.depth):
            new = []
            for i in frontier:
                q = probs[paths[i]]
                k = min(self.top_k, int((q > 0).sum()), self.total_tokens + 1 - len(paths))
                if k <= 0:
                    break
                drawn = torch.multinomial(q, k, replacement=False, generator=self._generator)
                for token, lp in zip(drawn.tolist(), torch.log(q[drawn]).tolist()):
                    paths.append(paths[i] + (token,))
                    parents.append(i)
                    scores.append(scores[i] + lp)
                    new.append(len(paths) - 1)
            frontier = sorted(new, key=lambda j: -scores[j])[:self.top_k]
            if d + 1 == self.depth or not frontier:
                break
            logits = self.engine.step(logits_rows=self.engine.pending_rows(self._add_frontier(
                [paths[j] for j in frontier])))
            probs.update(zip((paths[j] for j in frontier), sampling_probs(logits, self.sample)))
        vocab = root_logits.shape[-1]
        self.draft_probs = torch.stack([probs.get(p, torch.zeros(vocab, device=root_logits.device)) for p in paths])
        return TokenTree(tuple(parents)), [root] + [p[-1] for p in paths[1:]]

    def _sync(self, seq: list[int]) -> torch.Tensor:
        """Bring the draft's node to ``seq`` (the accepted path's K/V kept); the root's logits [vocab]."""
        e, t = self.engine, self.engine.tree
        base = t.sequence(self._node) if self._node is not None else []
        if not base or len(seq) <= len(base) or seq[:len(base)] != base:
            self.reset()
            self._node, logits = e.prefill(seq)
            return logits
        rest = seq[len(base):]
        keep = 0          # leading tokens of rest whose K/V the draft computed in its last tree
        while keep < len(rest) - 1 and tuple(rest[:keep + 1]) in self._computed:
            keep += 1
        ids = [self._computed[tuple(rest[:i + 1])] for i in range(keep)]
        t.accept(self._node, ids)   # their K/V move onto the node; the rest of the last tree is freed
        t.extend(self._node, rest[keep:])
        return e.step(logits_rows=e.pending_rows([self._node]))[0]

    def _layer(self, paths: list[tuple[int, ...]], root_logits: torch.Tensor) -> list[tuple[list[int], list[float]]]:
        """Candidates (top-k tokens, log-probs) of one layer's frontier ``paths``: one draft step."""
        if paths == [()]:
            logits = root_logits[None]
        else:
            logits = self.engine.step(logits_rows=self.engine.pending_rows(self._add_frontier(paths)))
        top = torch.log_softmax(logits.float(), dim=-1).topk(self.top_k, dim=-1)
        return list(zip(top.indices.tolist(), top.values.tolist()))

    def _add_frontier(self, paths: list[tuple[int, ...]]) -> list[int]:
        """Hang the frontier nodes under their (computed) parents, pending; their ids in ``paths`` order."""
        t = self.engine.tree
        groups: dict[int, list[int]] = {}
        for i, path in enumerate(paths):
            parent = self._node if len(path) == 1 else self._computed[path[:-1]]
            groups.setdefault(parent, []).append(i)
        need = sum(self.engine.pool.pages_for(len(g)) for g in groups.values())
        if need > self.engine.pool.num_free_pages:
            raise PoolExhaustedError(f"draft model KV pool exhausted: a tree layer needs {need} pages, "
                                     f"{self.engine.pool.num_free_pages} free")
        ids = [0] * len(paths)
        for parent, members in groups.items():
            for i, node in zip(members, t.add_token_tree(parent, [paths[i][-1] for i in members], [-1] * len(members))):
                ids[i] = node
                self._computed[paths[i]] = node
        return ids
