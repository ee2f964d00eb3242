"""EAGLE drafting in fixed chains: the same tree every step, drafted on the device, so the loop pipelines.

:class:`~treedec.search.eagle.EagleDraft` with ``tree="chains"`` proposes the root's ``top_k`` best children,
each extended ``depth - 1`` tokens by the drafter's argmax: a tree of ``1 + top_k * depth`` tokens whose shape
never changes (:func:`chains_tree`; ``top_k=1`` is one chain, SGLang's ``--speculative-eagle-topk 1``). Only
the tokens depend on values, and they stay on the device, so a speculative loop over it runs pipelined
(:mod:`~treedec.search.speculative_pipeline`): the drafter is synced with the target's states at the step's
root and accepted path while their count is still a device value, and its chains read that sync's slots
through a :class:`~treedec.attention.dynamic_span.DynamicSpan` (the unaccepted ones masked, the chains'
positions moved back on the device). The ``depth - 1`` chain steps are one
:class:`~treedec.engine.step_chain.StepChain`: one CUDA graph on a graphed drafter engine.

Compared with EAGLE-2's dynamic tree (``tree="dynamic"``, chosen on the host from read-back candidates) a
chain tree accepts fewer tokens per step for the same number of draft tokens; it costs no host round trip.
"""
from __future__ import annotations

import weakref

import numpy as np
import torch

from treedec.attention.dynamic_span import DynamicSpan
from treedec.engine import Engine
from treedec.engine.step_chain import ChainContext, StepChain
from treedec.search.eagle_batch import chain_layout, sequence_slots
from treedec.tree.token_tree import TokenTree

__all__ = ["EagleChains", "chains_tree"]

_CHAINS: "weakref.WeakKeyDictionary[Engine, EagleChains]" = weakref.WeakKeyDictionary()


def chains_tree(top_k: int, depth: int) -> TokenTree:
    """The tree of ``top_k`` chains of ``depth`` tokens under one root, chain-major: chain ``j``'s token at depth
    ``d`` (1-based) is node ``1 + j * depth + d - 1``."""
    parents = [-1]
    for _ in range(top_k):
        for d in range(depth):
            parents.append(0 if d == 0 else len(parents) - 1)
    return TokenTree(tuple(parents))


class EagleChains:
    """The chain drafting of one drafter engine (:meth:`of`): one :class:`StepChain` per ``(depth, top_k)``,
    run for one request at a time."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._chains: dict[tuple[int, int], StepChain] = {}
        self._drafting: list[tuple[np.ndarray, np.ndarray]] = []   # the request being drafted: (sequence, scratch)

    @classmethod
    def of(cls, engine: Engine) -> "EagleChains":
        """The chain drafting of ``engine`` (made at its first use, dropped with the engine)."""
        chains = _CHAINS.get(engine)
        if chains is None:
            chains = _CHAINS[engine] = cls(engine)
        return chains

    def draft(self, draft, root_logits: torch.Tensor, root_hidden: torch.Tensor, count: torch.Tensor | None,
              newest: int) -> torch.Tensor:
        """``draft``'s chain tokens ``[top_k * depth]`` (target ids, chain-major as :func:`chains_tree`) from its
        root's logits ``[draft vocab]`` and output feature ``[feature]``; ``count``: how many of the sequence's
        ``newest`` tokens are real (a device value; None: all). Nothing is read back."""
        e, k, depth = self.engine, draft.top_k, draft.depth
        to_target = draft.drafter.to_target_ids
        inputs = {"root_logits": root_logits[None], "root_hidden": root_hidden[None]}
        if depth == 1:
            return _chains_body(None, inputs, 1, k, to_target)[0].reshape(-1)
        if draft._scratch is None:
            draft._reserve_scratch()
        sequence = sequence_slots(e, draft.node)
        self._drafting = [(sequence, draft._scratch)]
        chain = self._chains.get((depth, k))
        if chain is None:
            specs = {name: (tuple(value.shape), value.dtype) for name, value in inputs.items()}
            chain = self._chains[(depth, k)] = StepChain(
                e, depth - 1, lambda i: chain_layout(self._drafting, i, k),
                lambda ctx, x: _chains_body(ctx, x, depth, k, to_target), specs)
        span = None if count is None else DynamicSpan(sequence[len(sequence) - newest:], count,
                                                      np.arange(k, dtype=np.int64))
        (tokens,) = chain.run(inputs, dynamic=span)
        return tokens.reshape(-1)


def _chains_body(ctx: ChainContext | None, inputs: dict[str, torch.Tensor], depth: int, k: int, to_target
                 ) -> tuple[torch.Tensor]:
    """The device work of one request's chains: the root's ``k`` best children (draft vocabulary top-k, mapped
    to the target's ids), then per chain step each chain's argmax child, each query pairing its parent's output
    feature with its token. ``[1, k * depth]`` int64, chain-major."""
    tokens = to_target(inputs["root_logits"].float().topk(k).indices)          # [1, k]
    width = inputs["root_hidden"].shape[-1]
    features = inputs["root_hidden"][:, None, :].expand(1, k, width).reshape(k, width)
    layers = [tokens.reshape(k)]
    for i in range(depth - 1):
        out = ctx.forward(i, layers[-1], features)
        layers.append(to_target(out.logits.float().argmax(dim=-1)))
        features = out.hidden
    return (torch.stack(layers, dim=1).reshape(1, k * depth).to(torch.int64),)
