"""EAGLE drafting in fixed chains: the same tree every step, drafted on the device, so the loop pipelines.

:class:`~treedec.programs.speculative.eagle.EagleDraft` with ``tree="chains"`` proposes the root's ``top_k`` best
children, each extended ``depth - 1`` tokens by the drafter's argmax: a tree of ``1 + top_k * depth`` tokens whose shape
never changes (:func:`chains_tree`; ``top_k=1`` is one chain, SGLang's ``--speculative-eagle-topk 1``). Only
the tokens depend on values, and they stay on the device, so a speculative loop over it runs pipelined
(:mod:`~treedec.programs.speculative.verify_table`): the drafter is synced with the target's states at the step's
root and accepted path while their count is still a device value, and its chains read that sync's slots
through :class:`~treedec.attention.dynamic_span.DynamicSpans` (the unaccepted ones masked, the chains'
positions moved back on the device). The ``depth - 1`` chain steps are one
:class:`~treedec.engine.step_chain.StepChain`: one CUDA graph on a graphed drafter engine.

Compared with EAGLE-2's dynamic tree (``tree="dynamic"``, chosen on the host from read-back candidates) a
chain tree accepts fewer tokens per step for the same number of draft tokens; it costs no host round trip.
"""
from __future__ import annotations

import numpy as np
import torch

from treedec.attention.dynamic_span import DynamicSpans
from treedec.engine import Engine
from treedec.engine.step_chain import ChainContext, StepChain
from treedec.programs.speculative.drafter_batch import PerEngine, chain_layout, sequence_slots, sync_drafter
from treedec.transfer import to_device
from treedec.tree.token_tree import TokenTree

__all__ = ["EagleChains", "chains_tree"]


def chains_tree(top_k: int, depth: int) -> TokenTree:
    """The tree of ``top_k`` chains of ``depth`` tokens under one root, chain-major: chain ``j``'s token at depth
    ``d`` (1-based) is node ``1 + j * depth + d - 1``."""
    parents = [-1]
    for _ in range(top_k):
        for d in range(depth):
            parents.append(0 if d == 0 else len(parents) - 1)
    return TokenTree(tuple(parents))


class EagleChains(PerEngine):
    """The chain drafting of one drafter engine (:meth:`of`), for every request submitted in a scheduler pass
    at once: one drafter step syncs them all (per prompt chunk), then one :class:`StepChain` per
    ``(requests, depth, top_k)`` drafts all their chains (one CUDA graph on a graphed engine)."""

    def __init__(self, engine: Engine):
        super().__init__(engine)
        self._chains: dict[tuple[int, int, int], StepChain] = {}
        self._drafting: list[tuple[np.ndarray, np.ndarray]] = []   # per request drafted: (sequence, scratch)
        self._waiting: list[tuple] = []                            # (draft, tokens, fused states, count)
        self._results: dict[int, torch.Tensor] = {}
        self.stats = {"flushes": 0, "requests": 0}

    def submit(self, draft, tokens, states: torch.Tensor, count: torch.Tensor | None) -> None:
        """Queue ``draft``'s sync and chains: the drafter's new queries pair the fused target ``states`` ``[n,
        feature]`` with ``tokens`` ``[n]`` (host ids, or an int64 device tensor: :func:`sync_drafter`), of which
        the first ``count`` are real (a device value; None: all; else ``n`` must fit one drafter step). The draft
        has dropped its last sync's unreal rows."""
        if any(d is draft for d, *_ in self._waiting) or id(draft) in self._results:
            raise ValueError("this draft already submitted: collect() its chains first")
        n = len(tokens)
        if len(states) != n:
            raise ValueError(f"a sync pairs each target state with a token: {len(states)} states, {n} tokens")
        if count is not None and n > self.engine.prefill_chunk:
            raise ValueError(f"a sync with a device count of real rows must fit one drafter step "
                             f"({self.engine.prefill_chunk} tokens), got {n}")
        self._waiting.append((draft, tokens, states, count))

    def collect(self, draft) -> torch.Tensor:
        """``draft``'s chain tokens ``[top_k * depth]`` (target ids, chain-major as :func:`chains_tree`, on the
        device: nothing is read back), drafting for every submitted request first if not yet done."""
        if id(draft) not in self._results:
            if not any(d is draft for d, *_ in self._waiting):
                raise ValueError("collect() before submit(): this draft has no sync queued")
            self._flush()
        return self._results.pop(id(draft))

    def drop(self, draft) -> None:
        """Forget ``draft``'s queued sync or uncollected chains (its request ended)."""
        self._waiting = [job for job in self._waiting if job[0] is not draft]
        self._results.pop(id(draft), None)

    # ================================================================ private

    def _flush(self) -> None:
        jobs, self._waiting = self._waiting, []
        logits, hidden = sync_drafter(self.engine, jobs)
        by_shape: dict[tuple[int, int], list[int]] = {}
        for j, (draft, *_) in enumerate(jobs):
            by_shape.setdefault((draft.depth, draft.top_k), []).append(j)
        for (depth, k), members in by_shape.items():
            index = to_device(np.asarray(members, dtype=np.int64), self.engine.device)
            tokens = self._draft(depth, k, [jobs[j] for j in members], logits.index_select(0, index),
                                 hidden.index_select(0, index))
            for row, j in enumerate(members):
                self._results[id(jobs[j][0])] = tokens[row]
        self.stats["flushes"] += 1
        self.stats["requests"] += len(jobs)

    def _draft(self, depth: int, k: int, jobs: list[tuple], root_logits: torch.Tensor, root_hidden: torch.Tensor
               ) -> torch.Tensor:
        """The chain tokens ``[B, k * depth]`` of ``B`` requests of one (depth, top_k)."""
        e, b = self.engine, len(jobs)
        to_target = jobs[0][0].drafter.to_target_ids
        inputs = {"root_logits": root_logits, "root_hidden": root_hidden}
        if depth == 1:
            return _chains_body(None, inputs, 1, k, to_target)[0]
        slots, lengths, keeps, owners = [], [], [], []
        self._drafting = []
        for r, (draft, tokens, _, count) in enumerate(jobs):   # (each drafter's own sequence: a host call a request)
            sequence = sequence_slots(e, draft.node)
            self._drafting.append((sequence, draft.scratch_slots()))
            if count is not None:   # its newest rows past count: masked in every chain step, its queries moved back
                slots.append(sequence[len(sequence) - len(tokens):])
                lengths.append(len(tokens))
                keeps.append(count.reshape(1))
                owners.append(r)
        spans = None
        if owners:   # (one set of arrays for all of them; query rows r * k .. (r + 1) * k - 1 after span r's)
            owner = np.asarray(owners, dtype=np.int64)
            rows = (owner[:, None] * k + np.arange(k)[None, :]).reshape(-1)
            spans = DynamicSpans(np.concatenate(slots).astype(np.int64), np.asarray(lengths, dtype=np.int64),
                                 torch.cat(keeps), rows, np.repeat(np.arange(len(owners)), k))
        chain = self._chains.get((b, depth, k))
        if chain is None:
            specs = {name: (tuple(value.shape), value.dtype) for name, value in inputs.items()}
            chain = self._chains[(b, depth, k)] = StepChain(
                e, depth - 1, lambda i: chain_layout(self._drafting, i, k),
                lambda ctx, x: _chains_body(ctx, x, depth, k, to_target), specs)
        (tokens,) = chain.run(inputs, dynamic=spans)
        return tokens


def _chains_body(ctx: ChainContext | None, inputs: dict[str, torch.Tensor], depth: int, k: int, to_target
                 ) -> tuple[torch.Tensor]:
    """The device work of ``B`` requests' chains: each root's ``k`` best children (draft vocabulary top-k, mapped
    to the target's ids), then per chain step each chain's argmax child, each query pairing its parent's output
    feature with its token (query ``b * k + j``: request ``b``'s chain ``j``). ``[B, k * depth]`` int64,
    chain-major per request."""
    tokens = to_target(inputs["root_logits"].float().topk(k).indices)          # [B, k]
    b, width = tokens.shape[0], inputs["root_hidden"].shape[-1]
    features = inputs["root_hidden"][:, None, :].expand(b, k, width).reshape(b * k, width)
    layers = [tokens.reshape(b * k)]
    for i in range(depth - 1):
        out = ctx.forward(i, layers[-1], features)
        layers.append(to_target(out.logits.float().argmax(dim=-1)))
        features = out.hidden
    return (torch.stack(layers, dim=1).reshape(b, k * depth).to(torch.int64),)
