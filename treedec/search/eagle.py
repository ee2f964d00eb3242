"""EAGLE speculative decoding: token trees drafted from the target's own hidden states.

:class:`EagleDraft` is a draft source (:mod:`treedec.search.drafts`) over an
:class:`~treedec.engine.eagle.EagleDrafter` (EAGLE-1/2 or EAGLE-3) running on an engine of its own.
The target hands it its states at every token it computes (its ``target_states``: the final-norm
hidden states for EAGLE-1, the three layers' inputs for EAGLE-3, returned from inside the
verification step's CUDA graph). The drafter's query at position ``t`` pairs the state at ``t``
with the token at ``t + 1``; each proposal is

1. *sync*, one drafter step: the queries of the tokens the target computed since the last
   proposal (the prompt, then the root and the accepted tokens), paired with the target's own
   states, up to the new root; its output at the root gives the root's children. As the EAGLE
   reference does, the drafter's K/V of accepted tokens are computed here from the target's
   states (exact), not kept from the drafting (made from the drafter's guesses of them); the step
   runs anyway for the root, so this costs rows, not a step. The last proposal's tree is freed
   through the tree's ``accept`` (no path kept);
2. ``depth - 1`` drafter steps, one per tree layer, as EAGLE-2: the ``top_k`` frontier nodes with
   the best cumulative log-prob are computed together, each query pairing its parent's *output*
   (the drafter runs ahead at the feature level) with its token, giving its ``top_k`` children;
   the ``total_tokens`` best nodes form the tree.

   Without ``sample`` these steps never wait for the device: the frontier lives in ``top_k``
   *chains*, each holding one frontier node's path in scratch KV slots of the draft's own (reserved
   at its first proposal, freed by :meth:`~EagleDraft.reset`), read under the drafter's sequence.
   Their shape does not depend on the values (each grows by one token a layer), so the steps form one
   :class:`~treedec.engine.step_chain.StepChain`: planned at once on the host and, on a graphed
   engine, replayed as ONE CUDA graph; which frontier node extends which path is chosen on the device
   (top-k of the cumulative scores), and the chains' K/V are regathered to match
   (:meth:`Engine.copy_kv`) inside it. One copy back at the end gives every layer's
   candidates, and the tree is the one :func:`~treedec.tree.token_tree.expand_by_logprob` grows from
   them (tested). With ``sample``, children are drawn without replacement layer by layer and their
   distributions go to the acceptance rule (:class:`~treedec.search.tree_drafting.EngineTreeDraft`).

EAGLE-3's draft vocabulary is mapped to the target's (``d2t``): its tokens and, when sampling, its
distributions (zero outside the draft vocabulary) are the target's.
"""
from __future__ import annotations

import torch

from typing import Sequence

import numpy as np

from treedec.engine import Engine
from treedec.engine.eagle import EagleDrafter
from treedec.engine.step_chain import ChainContext, ChainStep, StepChain
from treedec.errors import PoolExhaustedError
from treedec.search.drafts import TargetOutput
from treedec.search.sampling import SamplingParams
from treedec.search.tree_drafting import EngineTreeDraft
from treedec.transfer import to_device
from treedec.tree.layout import TreeLayout
from treedec.tree.token_tree import TokenTree

__all__ = ["EagleDraft"]


class EagleDraft(EngineTreeDraft):
    """EAGLE-2 dynamic token trees from an EAGLE-1/2 or EAGLE-3 drafter.

    Parameters
    ----------
    engine : an Engine of the :class:`~treedec.engine.eagle.EagleDrafter` (its own pool; graphs
        welcome: ``cuda_graphs=True``). The drafts of a batch's requests may share it: each keeps its
        own sequence in its tree, and proposals run one at a time.
    depth : tree layers (draft tokens per path), >= 1 (EAGLE-2: 5).
    top_k : nodes expanded per layer and children per expanded node (EAGLE-2: 8).
    total_tokens : draft tokens in the proposed tree (EAGLE-2: 63, a 64-token tree with the root).
    sample, seed : as :class:`~treedec.search.draft_model.DraftModelDraft` (sampled drafts for
        :class:`~treedec.search.acceptance.RejectionSampling`).
    """

    def __init__(self, engine: Engine, depth: int = 5, top_k: int = 8, total_tokens: int = 63,
                 sample: SamplingParams | None = None, seed: int = 0):
        if isinstance(engine, Engine) and not isinstance(engine.model, EagleDrafter):
            raise TypeError(f"engine must run an EagleDrafter, it runs a {type(engine.model).__name__}")
        super().__init__(engine, "the EAGLE drafter's", depth, top_k, total_tokens, sample, seed)
        self.drafter: EagleDrafter = engine.model
        self._states: torch.Tensor | None = None          # fused target states not yet in the drafter
        self._observed: tuple[int, int] | None = None     # (length, last token) of the observed sequence
        self._outputs: dict[tuple[int, ...], torch.Tensor] = {}   # token path -> the drafter's output feature
        self._chain: StepChain | None = None              # the drafting chain (its graph), made at the first proposal
        self._scratch: np.ndarray | None = None           # [top_k, depth - 1] the chains' KV slots (see reset)
        self._scratch_pages: np.ndarray | None = None
        self._scratch_device: torch.Tensor | None = None
        self._prefix_slots: np.ndarray | None = None      # the drafter sequence's slots, at this proposal

    @property
    def target_states(self) -> str | tuple[int, ...]:
        """What the drafter reads from the target at every token: ``"hidden"`` (EAGLE-1) or its layers (EAGLE-3)."""
        return self.drafter.aux_layers if self.drafter.kind == "eagle3" else "hidden"

    def start(self, engine: Engine) -> None:
        """Check the drafter fits the target; free the previous request."""
        if engine is self.engine:
            raise ValueError("the EAGLE drafter needs its own Engine, not the target's")
        t, d = engine.model.config, self.drafter
        if (t.vocab_size, t.hidden_size) != (d.config.vocab_size, d.target_hidden_size):
            raise ValueError(f"the EAGLE drafter is for a target of vocabulary {d.config.vocab_size} and hidden size "
                             f"{d.target_hidden_size}, this target has {t.vocab_size} and {t.hidden_size}")
        if d.kind == "eagle3" and max(d.aux_layers) >= t.num_layers:
            raise ValueError(f"the EAGLE-3 drafter reads target layers {list(d.aux_layers)}; the target has "
                             f"{t.num_layers}")
        self.reset()

    def reset(self) -> None:
        """Free the request: the drafter's sequence and the chains' scratch pages."""
        super().reset()
        if self._scratch_pages is not None:
            self.engine.pool.decref(self._scratch_pages)
        self._scratch = self._scratch_pages = self._scratch_device = self._prefix_slots = None
        self._states, self._observed, self._outputs = None, None, {}

    def observe(self, output: TargetOutput) -> None:
        """Take the target's states at the tokens it computed since the last observation."""
        if output.states is None:
            raise ValueError("EagleDraft needs the target's states (TargetOutput.states); run it through "
                             "speculative_generate / speculative_batch, which provide them")
        fused = self.drafter.fuse(output.states)
        self._states = fused if self._states is None else torch.cat([self._states, fused])
        self._observed = (len(output.tokens), int(output.tokens[-1]))

    def propose(self, sequence_tokens: Sequence[int]) -> tuple[TokenTree, list[int]]:
        if self.sample is not None:
            return super().propose(sequence_tokens)
        if not len(sequence_tokens):
            raise ValueError("sequence_tokens must hold at least the root token, got none")
        # (not a copy of the whole sequence: _sync reads its length and its new tail only)
        return self._chain_tree(int(sequence_tokens[-1]), self._sync(sequence_tokens))

    # ================================================================ private

    def _chain_tree(self, root: int, root_logits: torch.Tensor) -> tuple[TokenTree, list[int]]:
        """The EAGLE-2 tree from ``depth - 1`` chained drafter steps, run as one :class:`StepChain` (one CUDA
        graph on a graphed engine; see the module docstring)."""
        e = self.engine
        root_hidden = self._outputs[()]
        if self.depth == 1:
            (flat,) = self._chain_body(None, {"root_logits": root_logits, "root_hidden": root_hidden})
        else:
            if self._scratch is None:
                self._reserve_scratch()
            path = e.tree.path(self._node)
            self._prefix_slots = np.concatenate([e.tree.slots(n) for n in path]) if len(path) > 1 \
                else e.tree.slots(self._node)
            if self._chain is None:
                inputs = {"root_logits": (tuple(root_logits.shape), root_logits.dtype),
                          "root_hidden": (tuple(root_hidden.shape), root_hidden.dtype)}
                self._chain = StepChain(e, self.depth - 1, self._chain_layout, self._chain_body, inputs)
            (flat,) = self._chain.run({"root_logits": root_logits, "root_hidden": root_hidden})
        return _grown_tree(root, flat.tolist(), self.top_k, self.depth - 1, self.total_tokens)   # the one wait

    def _reserve_scratch(self) -> None:
        """The chains' KV slots, ``[top_k, depth - 1]``: pages of the drafter's pool held until :meth:`reset`."""
        e, k, n = self.engine, self.top_k, self.depth - 1
        pages = e.pool.pages_for(k * n)
        if pages > e.pool.num_free_pages:
            raise PoolExhaustedError(f"EAGLE drafter KV pool exhausted: {k} chains of {n} tokens need {pages} "
                                     f"pages, {e.pool.num_free_pages} free")
        self._scratch_pages = e.pool.allocate(pages)
        slots = (self._scratch_pages[:, None] * e.pool.page_size + np.arange(e.pool.page_size)).reshape(-1)
        self._scratch = slots[:k * n].reshape(k, n)
        self._scratch_device = to_device(self._scratch, e.device)

    def _chain_layout(self, i: int) -> ChainStep:
        """Step ``i`` of the chain: chain ``j``'s token ``i`` (its tokens ``0..i`` in its scratch slots) under the
        drafter's sequence."""
        k, prefix = self.top_k, self._prefix_slots
        lengths = np.full(k, i + 1, dtype=np.int64)
        kv_start = np.concatenate([[0], len(prefix) + np.cumsum(np.concatenate([[0], lengths]))])
        layout = TreeLayout(np.arange(k + 1, dtype=np.int64), np.array([-1] + [0] * k, dtype=np.int64), kv_start,
                            np.concatenate([prefix, self._scratch[:, :i + 1].reshape(-1)]),
                            np.arange(1, k + 1, dtype=np.int64), np.full(k, i, dtype=np.int64))
        return ChainStep(layout, np.arange(k))

    def _chain_body(self, ctx: ChainContext | None, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor]:
        """The chain's device work: layer 1's candidates from the root's logits, then per chain step the
        ``top_k`` chains' children; the next frontier (the ``top_k`` best children by cumulative log-prob) is
        picked on the device, each chain taking its new parent's path (tokens, features, K/V). One flat
        float64 tensor: layer 1's ids and log-probs, each deeper layer's ``[k, k]`` ids and log-probs, each
        frontier's candidate index (what :func:`_grown_tree` reads)."""
        k = self.top_k
        top = torch.log_softmax(inputs["root_logits"].float(), dim=-1).topk(k)
        tokens, scores = self._to_target(top.indices), top.values         # layer 1: every node is frontier
        parts, links = [tokens.double(), scores.double()], []
        features = inputs["root_hidden"].expand(k, -1)
        for i in range(self.depth - 1):
            out = ctx.forward(i, tokens, features)
            top = torch.log_softmax(out.logits.float(), dim=-1).topk(k)   # [k chains, k children]
            ids = self._to_target(top.indices)
            parts += [ids.double().flatten(), top.values.double().flatten()]
            if i == self.depth - 2:
                break
            pick = (scores[:, None] + top.values).flatten().topk(k).indices   # the next frontier, best first
            links.append(pick.double())
            parent = pick // k
            scores = scores[parent] + top.values.flatten()[pick]
            tokens, features = ids.flatten()[pick], out.hidden[parent]
            slots = self._scratch_device[:, :i + 1]
            ctx.copy_kv(slots[parent].flatten(), slots.flatten())          # chain j takes its new parent's path
        return (torch.cat(parts + links),)

    def _sync(self, seq: Sequence[int]) -> torch.Tensor:
        """Add the queries of the observed tokens to the drafter's sequence (tokens ``seq[1:]``, query ``i``
        pairing the target's state at ``i`` with ``seq[i + 1]``) in one step (chunked for long prompts);
        the root's children's logits."""
        if self._observed != (len(seq), int(seq[-1])) or self._states is None:
            raise ValueError("EagleDraft.propose needs the target's states for this sequence: run it through "
                             "speculative_generate, or call observe(TargetOutput(...)) first")
        e, t = self.engine, self.engine.tree
        have = t.sequence_length(self._node) if self._node is not None else 0
        states, self._states = self._states, None
        if have + len(states) != len(seq) - 1:
            raise ValueError(f"EagleDraft holds {have} tokens and was given the target's states at {len(states)} "
                             f"more, but the sequence has {len(seq)} (every token but the root needs one): observe "
                             f"each output of the target once")
        tokens = [int(x) for x in seq[have + 1:]]
        if self._node is not None:
            t.accept(self._node, [])   # the last proposal's tree: freed
        need = e.pool.pages_for(len(tokens) + (have % e.pool.page_size)) + 1
        if need > e.pool.num_free_pages:
            raise PoolExhaustedError(f"EAGLE drafter KV pool exhausted: {len(tokens)} tokens need up to {need} "
                                     f"pages, {e.pool.num_free_pages} free")
        chunk = e.prefill_chunk
        for at in range(0, len(tokens), chunk):
            piece = tokens[at:at + chunk]
            if self._node is None:
                self._node = t.add_prompt(piece)
            else:
                t.extend(self._node, piece)
            last = len(piece) - 1
            out = e.step(logits_rows=[last], return_hidden=True, features=states[at:at + chunk])
        self._outputs = {(): out.hidden[0]}
        return out.logits[0]

    def _frontier_logits(self, paths: list[tuple[int, ...]]) -> torch.Tensor:
        e = self.engine
        rows = e.pending_rows(self._add_frontier(paths))
        rows_t = to_device(rows, e.device)   # (pinned, in stream order: no wait for the queued steps)
        parents = torch.stack([self._outputs[p[:-1]] for p in paths])
        features = torch.empty_like(parents)
        features[rows_t] = parents            # query order
        out = e.step(logits_rows=rows, return_hidden=True, features=features)
        self._outputs.update(zip(paths, out.hidden))
        return out.logits

    def _to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.drafter.to_target_ids(draft_ids)

    def _target_probs(self, probs: torch.Tensor) -> torch.Tensor:
        d = self.drafter
        if d.kind == "eagle":
            return probs
        out = probs.new_zeros(*probs.shape[:-1], d.config.vocab_size)
        ids = d.to_target_ids(torch.arange(d.draft_vocab_size, device=probs.device))
        out[..., ids] = probs
        return out


def _grown_tree(root: int, flat: list[float], k: int, deeper: int, total_tokens: int) -> tuple[TokenTree, list[int]]:
    """The tree of :meth:`EagleDraft._chain_tree`'s candidates (read back as ``flat``: layer 1's ids and
    log-probs, each deeper layer's ``[k, k]`` ids and log-probs, each frontier's candidate index), kept as
    :func:`~treedec.tree.token_tree.expand_by_logprob` keeps them: the ``total_tokens`` best by cumulative
    log-prob (ties: shallower, then made first), ordered by depth then score."""
    at = 0

    def take(n: int) -> list[float]:
        nonlocal at
        at += n
        return flat[at - n:at]

    ids, lps = take(k), take(k)
    # node: (score, depth, made, parent node index or -1 for the root, token)
    nodes = [(lp, 1, i, -1, int(t)) for i, (t, lp) in enumerate(zip(ids, lps))]
    frontier = list(range(k))
    grids = [(take(k * k), take(k * k)) for _ in range(deeper)]
    picks = [take(k) for _ in range(deeper - 1)] if deeper else []
    for d, (ids, lps) in enumerate(grids):
        base = len(nodes)
        for j, node in enumerate(frontier):
            for c in range(k):
                nodes.append((nodes[node][0] + lps[j * k + c], d + 2, len(nodes), node, int(ids[j * k + c])))
        if d < len(picks):
            frontier = [base + int(p) for p in picks[d]]
    kept = sorted(nodes, key=lambda n: (-n[0], n[1], n[2]))[:total_tokens]
    kept.sort(key=lambda n: (n[1], -n[0], n[2]))
    index = {-1: 0}
    parents, tokens = [-1], [root]
    for _, _, made, parent, token in kept:
        assert parent in index, f"kept node {made} without its parent {parent}"
        parents.append(index[parent])
        tokens.append(token)
        index[made] = len(index)
    return TokenTree(tuple(parents)), tokens
