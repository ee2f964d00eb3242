"""EAGLE speculative decoding: token trees drafted from the target's own hidden states.

:class:`EagleDraft` is a draft source (:mod:`treedec.programs.speculative.drafts`) over an
:class:`~treedec.models.eagle_drafter.EagleDrafter` (EAGLE-1/2 or EAGLE-3) running on an engine of its own.
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
   (:meth:`PagedKVPool.copy_slots`) inside it. One copy back at the end gives every layer's
   candidates, and the tree is the one :func:`~treedec.tree.token_tree.expand_by_logprob` grows from
   them (tested). With ``sample``, children are drawn without replacement layer by layer and their
   distributions go to the acceptance rule (:class:`~treedec.programs.speculative.tree_drafting.EngineTreeDraft`).

With ``tree="chains"`` the tree is fixed instead (:mod:`~treedec.programs.speculative.eagle_chains`: the root's ``top_k``
children, each extended by argmax) and drafted on the device (:meth:`EagleDraft.device_drafts`), so the
speculative loop runs pipelined.

EAGLE-3's draft vocabulary is mapped to the target's (``d2t``): its tokens and, when sampling, its
distributions (zero outside the draft vocabulary) are the target's.
"""
from __future__ import annotations

from typing import Sequence

import torch

from treedec.engine import Engine
from treedec.models.eagle_drafter import EagleDrafter
from treedec.programs.speculative.drafts import DeviceStep, TargetOutput
from treedec.programs.speculative.drafter_batch import DrafterGroup
from treedec.programs.speculative.eagle_chains import EagleChains, chains_tree
from treedec.sampling.params import SamplingParams
from treedec.programs.speculative.tree_drafting import EngineTreeDraft
from treedec.transfer import to_device
from treedec.tree.token_tree import TokenTree

__all__ = ["EagleDraft"]


class EagleDraft(EngineTreeDraft):
    """EAGLE-2 dynamic token trees (or fixed chains) from an EAGLE-1/2 or EAGLE-3 drafter.

    Parameters
    ----------
    engine : an Engine of the :class:`~treedec.models.eagle_drafter.EagleDrafter` (its own pool; graphs
        welcome: ``cuda_graphs=True``). The drafts of a batch's requests may share it: each keeps its
        own sequence in its tree, and greedy drafts draft together, one drafter step per tree layer for
        every request of a scheduler pass (:mod:`treedec.programs.speculative.drafter_batch`).
    depth : tree layers (draft tokens per path), >= 1 (EAGLE-2: 5).
    top_k : nodes expanded per layer and children per expanded node (EAGLE-2: 8).
    total_tokens : draft tokens in the proposed tree (default: EAGLE-2's 63, a 64-token tree with the root;
        with ``tree="chains"`` always ``top_k * depth``).
    sample, seed : as :class:`~treedec.programs.speculative.draft_model.DraftModelDraft` (sampled drafts for
        :class:`~treedec.programs.speculative.acceptance.RejectionSampling`; ``tree="dynamic"`` only).
    tree : ``"dynamic"`` (EAGLE-2's tree: the ``total_tokens`` best of the top-k expansion, chosen on the
        host) or ``"chains"`` (a fixed tree: the root's ``top_k`` best children, each extended ``depth - 1``
        tokens by argmax, drafted on the device; its speculative loop runs pipelined:
        :mod:`~treedec.programs.speculative.eagle_chains`).
    """

    def __init__(self, engine: Engine, depth: int = 5, top_k: int = 8, total_tokens: int | None = None,
                 sample: SamplingParams | None = None, seed: int = 0, tree: str = "dynamic"):
        if isinstance(engine, Engine) and not isinstance(engine.model, EagleDrafter):
            raise TypeError(f"engine must run an EagleDrafter, it runs a {type(engine.model).__name__}")
        if tree not in ("dynamic", "chains"):
            raise ValueError(f"tree must be 'dynamic' or 'chains', got {tree!r}")
        if tree == "chains":
            if sample is not None:
                raise ValueError("tree='chains' drafts by argmax (top-k at the root): sample must be None")
            chained = top_k * depth if isinstance(top_k, int) and isinstance(depth, int) else None
            if total_tokens not in (None, chained):
                raise ValueError(f"tree='chains' has top_k * depth = {chained} draft tokens; total_tokens must be "
                                 f"None or that, got {total_tokens!r}")
            total_tokens = chained
        super().__init__(engine, "the EAGLE drafter's", depth, top_k, 63 if total_tokens is None else total_tokens,
                         sample, seed)
        self.tree = tree
        self._fixed = chains_tree(top_k, depth) if tree == "chains" else None
        self._root = -1   # chains: the submitted sequence's root
        self.drafter: EagleDrafter = engine.model
        self._states: torch.Tensor | None = None          # fused target states not yet in the drafter
        self._observed: tuple[int, int] | None = None     # (length, last token) of the observed sequence

    @property
    def target_states(self) -> str | tuple[int, ...]:
        """What the drafter reads from the target at every token: ``"hidden"`` (EAGLE-1) or its layers (EAGLE-3)."""
        return self.drafter.aux_layers if self.drafter.kind == "eagle3" else "hidden"

    @property
    def fixed_tree(self):
        """With ``tree="chains"``, the chains' tree
        (:func:`~treedec.programs.speculative.eagle_chains.chains_tree`): every proposal's; else None."""
        return self._fixed

    def device_drafts(self, step: DeviceStep) -> torch.Tensor:
        """The chains' tokens (``tree="chains"``) after the drafter is synced with the target's states in
        ``step``, which may hold unaccepted rows (``step.count``), drafted alone: nothing waits for the device."""
        self.submit_step(step)
        return self.collect_step()

    def submit_step(self, step: DeviceStep) -> None:
        """Queue the chains of ``step`` (see :meth:`device_drafts`) with the other requests' on this drafter
        engine (:class:`~treedec.programs.speculative.eagle_chains.EagleChains`: one sync and one chain run for all)."""
        if self._fixed is None:
            raise NotImplementedError("EagleDraft drafts on the device with tree='chains' only (fixed_tree is None)")
        if step.states is None or step.tokens is None:
            raise ValueError("EagleDraft's chains need the target's states and their next tokens "
                             "(DeviceStep.states, DeviceStep.tokens)")
        if step.unused:   # the last sync's rows past its count: known by now, dropped
            t = self.engine.tree
            t.truncate(self._node, t.node_length(self._node) - step.unused)
        EagleChains.of(self.engine).submit(self, step.tokens, self.drafter.fuse(step.states), step.count)

    def collect_step(self) -> torch.Tensor:
        """The submitted step's chain tokens ``[top_k * depth]`` on the device."""
        return EagleChains.of(self.engine).collect(self)

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
        EagleChains.of(self.engine).drop(self)
        self._states, self._observed = None, None

    def observe(self, output: TargetOutput) -> None:
        """Take the target's states at the tokens it computed since the last observation."""
        if output.states is None:
            raise ValueError("EagleDraft needs the target's states (TargetOutput.states); run it through "
                             "speculative_generate / speculative_batch, which provide them")
        fused = self.drafter.fuse(output.states)
        self._states = fused if self._states is None else torch.cat([self._states, fused])
        self._observed = (len(output.tokens), int(output.tokens[-1]))

    def submit(self, sequence_tokens: Sequence[int]) -> None:
        """Queue this request's proposal with the other requests' on its drafter engine (see
        :attr:`drafts_together`; chains: :class:`~treedec.programs.speculative.eagle_chains.EagleChains`)."""
        if self._fixed is None:
            return super().submit(sequence_tokens)
        if not len(sequence_tokens):
            raise ValueError("sequence_tokens must hold at least the root token, got none")
        tokens, states = self.sync_inputs(sequence_tokens)
        self._root = int(sequence_tokens[-1])
        EagleChains.of(self.engine).submit(self, tokens, states, None)

    def collect(self) -> tuple[TokenTree, list[int]]:
        """The tree of the submitted sequence: drafted together with every request submitted since."""
        if self._fixed is None:
            return super().collect()
        return self._fixed, [self._root] + EagleChains.of(self.engine).collect(self).tolist()

    def sync_inputs(self, seq: Sequence[int]) -> tuple[list[int], torch.Tensor]:
        """The drafter's new queries for ``seq`` (its tokens ``seq[1:]``; query ``i`` pairs the target's state
        at ``i`` with ``seq[i + 1]``): the tokens past those it holds and the target's fused states at them.
        Frees the last proposal's tree (a sampled one's nodes)."""
        if self._observed != (len(seq), int(seq[-1])) or self._states is None:
            raise ValueError("EagleDraft.propose needs the target's states for this sequence: run it through "
                             "speculative_generate, or call observe(TargetOutput(...)) first")
        t = self.engine.tree
        have = t.sequence_length(self._node) if self._node is not None else 0
        states, self._states = self._states, None
        if have + len(states) != len(seq) - 1:
            raise ValueError(f"EagleDraft holds {have} tokens and was given the target's states at {len(states)} "
                             f"more, but the sequence has {len(seq)} (every token but the root needs one): observe "
                             f"each output of the target once")
        if self._node is not None and t.children(self._node):
            t.accept(self._node, [])   # the last sampled proposal's tree: freed
        return [int(x) for x in seq[have + 1:]], states

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> the target's (EAGLE-3's ``d2t``; EAGLE-1/2: the same ids)."""
        return self.drafter.to_target_ids(draft_ids)

    # ================================================================ private

    def _sync(self, seq: Sequence[int]) -> torch.Tensor:
        """Bring the drafter to ``seq`` alone (sampled drafts): the root's children's logits."""
        return DrafterGroup.of(self.engine).sync([(self, *self.sync_inputs(seq))])[0]

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

    def _target_probs(self, probs: torch.Tensor) -> torch.Tensor:
        d = self.drafter
        if d.kind == "eagle":
            return probs
        out = probs.new_zeros(*probs.shape[:-1], d.config.vocab_size)
        ids = d.to_target_ids(torch.arange(d.draft_vocab_size, device=probs.device))
        out[..., ids] = probs
        return out

