"""Tree drafting for many requests at once: one drafter step per tree layer for every live request.

The drafts of a batch that grow EAGLE-2 trees on a drafter engine of their own
(:class:`~treedec.programs.speculative.eagle.EagleDraft`,
:class:`~treedec.programs.speculative.draft_model.DraftModelDraft`: both
:class:`~treedec.programs.speculative.tree_drafting.EngineTreeDraft`) share that engine; their :class:`DrafterGroup`
(one per drafter engine, :meth:`DrafterGroup.of`) drafts for all of them together. In a scheduler pass
every speculative program submits its sequence (``draft.submit``), waits for the pass to end
(:meth:`~treedec.runtime.program.ProgramContext.together`), and collects its tree (``draft.collect``);
the first collect drafts for every submitted request:

1. *sync*: one drafter step (per prompt chunk) over every request's new queries (the tokens the
   target computed since its last proposal; for EAGLE each paired with the target's state), the
   root's output of each read at its last row;
2. the *chains*: for the ``B`` requests of one (depth, top-k), ``depth - 1`` steps of ``B * top_k``
   chain queries, one :class:`~treedec.engine.step_chain.StepChain` (one CUDA graph on a graphed
   engine, one per batch size ``B``), the frontier of every request picked on the device;
3. one copy back of every request's candidates; each tree grown on the host (:func:`grown_tree`).

A single request (``speculative_generate``) is a group of one: the same code.
"""
from __future__ import annotations

import weakref
from typing import Sequence

import numpy as np
import torch

from treedec.engine import Engine
from treedec.engine.step_chain import ChainContext, ChainStep, StepChain
from treedec.errors import PoolExhaustedError
from treedec.transfer import to_device
from treedec.tree.layout import TreeLayout
from treedec.tree.token_tree import TokenTree

__all__ = ["DrafterGroup", "PerEngine", "chain_layout", "grown_tree", "sequence_slots", "sync_drafter"]

class PerEngine:
    """A drafter engine's one instance of a subclass (:meth:`of`: made at its first use, dropped with the
    engine)."""

    _instances: "weakref.WeakKeyDictionary[Engine, PerEngine]"

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._instances = weakref.WeakKeyDictionary()

    def __init__(self, engine: Engine):
        self.engine = engine

    @classmethod
    def of(cls, engine: Engine):
        """The instance of ``engine`` (made at its first use, dropped with the engine)."""
        found = cls._instances.get(engine)
        if found is None:
            found = cls._instances[engine] = cls(engine)
        return found


class DrafterGroup(PerEngine):
    """The tree drafts of one drafter engine, drafting together (see the module docstring)."""

    def __init__(self, engine: Engine):
        super().__init__(engine)
        self._waiting: list = []                              # drafts submitted, not yet drafted for
        self._sequences: dict[int, Sequence[int]] = {}        # id(draft) -> its submitted sequence
        self._results: dict[int, tuple[TokenTree, list[int]]] = {}
        self._chains: dict[tuple[int, int, int], StepChain] = {}   # (requests, depth, top_k) -> chain
        self._drafting: list = []                             # the drafts of the chain being run
        self.stats = {"flushes": 0, "requests": 0}

    def submit(self, draft, sequence_tokens: Sequence[int]) -> None:
        """Queue ``draft``'s proposal after ``sequence_tokens`` (its last token the root)."""
        if not len(sequence_tokens):
            raise ValueError("sequence_tokens must hold at least the root token, got none")
        if id(draft) in self._sequences or id(draft) in self._results:
            raise ValueError("this draft already submitted a sequence: collect() its tree first")
        self._waiting.append(draft)
        self._sequences[id(draft)] = sequence_tokens

    def collect(self, draft) -> tuple[TokenTree, list[int]]:
        """``draft``'s tree and tokens, drafting for every submitted request first if not yet done."""
        if id(draft) not in self._results:
            if id(draft) not in self._sequences:
                raise ValueError("collect() before submit(): this draft has no sequence queued")
            self._flush()
        return self._results.pop(id(draft))

    def drop(self, draft) -> None:
        """Forget ``draft``'s queued sequence or uncollected tree (its request ended)."""
        self._sequences.pop(id(draft), None)
        self._results.pop(id(draft), None)
        self._waiting = [d for d in self._waiting if d is not draft]

    def sync(self, jobs: list) -> list[torch.Tensor]:
        """One drafter step per prompt chunk over the new queries of every ``(draft, tokens, states)`` job
        (tokens ``[n]`` ids; EAGLE's states ``[n, feature]``, query ``i`` pairing state ``i`` with token ``i``, or
        None for a draft model); sets each EAGLE draft's root output feature; returns each root's logits
        ``[draft vocab]``."""
        logits, hidden = sync_drafter(self.engine, [(d, tokens, states, None) for d, tokens, states in jobs])
        if hidden is not None:
            for (draft, _, _), feature in zip(jobs, hidden):
                draft.root_output = feature
        return list(logits)

    # ================================================================ private

    def _flush(self) -> None:
        drafts, self._waiting = self._waiting, []
        sequences = [self._sequences.pop(id(d)) for d in drafts]
        try:
            jobs = [(d, *d.sync_inputs(seq)) for d, seq in zip(drafts, sequences)]
            roots = self.sync(jobs)
            by_shape: dict[tuple[int, int], list[int]] = {}
            for i, d in enumerate(drafts):
                by_shape.setdefault((d.depth, d.top_k), []).append(i)
            flats, order = [], []
            for (depth, k), members in by_shape.items():
                flats.append(self._draft(depth, k, [drafts[i] for i in members],
                                         torch.stack([roots[i] for i in members])).flatten())
                order += members
            values = torch.cat(flats).tolist()                 # the one wait of the proposals
        except BaseException:
            for d in drafts:
                d.root_output = None
            raise
        at = 0
        for i in order:
            d, seq = drafts[i], sequences[i]
            size = _flat_size(d.depth, d.top_k)
            self._results[id(d)] = grown_tree(int(seq[-1]), values[at:at + size], d.top_k, d.depth - 1,
                                              d.total_tokens)
            at += size
        self.stats["flushes"] += 1
        self.stats["requests"] += len(drafts)

    def _draft(self, depth: int, k: int, drafts: list, root_logits: torch.Tensor) -> torch.Tensor:
        """The candidates ``[B, flat]`` of ``B`` requests' proposals of one shape (see :func:`_chain_body`)."""
        e, b = self.engine, len(drafts)
        to_target = drafts[0].to_target
        roots = {"root_logits": root_logits}
        if drafts[0].root_output is not None:   # EAGLE: the root's output feature (a draft model reads none)
            roots["root_hidden"] = torch.stack([d.root_output for d in drafts])
        if depth == 1:
            return _chain_body(None, roots, 1, k, to_target)[0]
        self._drafting = [(sequence_slots(e, d.node), d.scratch_slots()) for d in drafts]
        scratch = to_device(np.stack([s for _, s in self._drafting]), e.device)
        key = (b, depth, k)
        chain = self._chains.get(key)
        if chain is None:
            inputs = {name: (tuple(value.shape), value.dtype) for name, value in roots.items()}
            inputs["scratch"] = (tuple(scratch.shape), torch.int64)
            chain = self._chains[key] = StepChain(
                e, depth - 1, lambda i: self._layout(i, k),
                lambda ctx, x: _chain_body(ctx, x, depth, k, to_target), inputs)
        (flat,) = chain.run(roots | {"scratch": scratch})
        return flat

    def _layout(self, i: int, k: int) -> ChainStep:
        return chain_layout(self._drafting, i, k)


def sync_drafter(engine: Engine, jobs: list[tuple]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Bring drafts up to their sequences: one drafter step per prompt chunk over every ``(draft, tokens, states,
    count)`` job's new queries, for EAGLE each pairing a fused target state (``states [n, feature]``) with its
    token (a draft model: ``states`` None in every job). ``tokens``: host ids (recorded in the drafter's tree) or
    an int64 device tensor (placeholders in the tree, the step reads the device values); ``count``: how many of
    the ``n`` are real (a one-element device tensor, ``n`` within one chunk; None: all). Returns each job's root
    (its last real query) logits ``[jobs, draft vocab]`` and, for EAGLE, output features ``[jobs, feature]``
    (else None); nothing is read back."""
    e, t = engine, engine.tree
    with_states = {states is not None for _, _, states, _ in jobs}
    if len(with_states) != 1:
        raise ValueError("a drafter sync's jobs must all give target states (EAGLE) or none (a draft model)")
    with_states = with_states.pop()
    need = sum(e.pool.pages_for(len(tokens)) + 1 for _, tokens, _, _ in jobs)
    if need > e.pool.num_free_pages:
        raise PoolExhaustedError(f"drafter KV pool exhausted: {sum(len(x) for _, x, _, _ in jobs)} tokens of "
                                 f"{len(jobs)} request(s) need up to {need} pages, {e.pool.num_free_pages} free")
    try:
        roots = _sync_chunks(e, jobs, with_states)
    except BaseException:
        if t.num_pending:   # (tokens added, their step failed: marked computed, so the drafts' resets can free them)
            t.commit_step()
        raise
    logits = torch.stack([r[0] for r in roots])
    return logits, torch.stack([r[1] for r in roots]) if with_states else None


def _sync_chunks(e: Engine, jobs: list[tuple], with_states: bool) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """:func:`sync_drafter`'s steps, one per prompt chunk: each job's root (logits, output feature or None)."""
    chunk = e.prefill_chunk
    roots: list[tuple[torch.Tensor, torch.Tensor | None] | None] = [None] * len(jobs)
    for at in range(0, max(len(tokens) for _, tokens, _, _ in jobs), chunk):
        here = [j for j, (_, tokens, _, _) in enumerate(jobs) if len(tokens) > at]
        on_device = any(isinstance(jobs[j][1], torch.Tensor) for j in here)
        nodes, sizes = [], []
        for j in here:
            draft, tokens = jobs[j][0], jobs[j][1]
            sizes.append(min(chunk, len(tokens) - at))
            piece = [0] * sizes[-1] if isinstance(tokens, torch.Tensor) else tokens[at:at + chunk]
            nodes.append(draft.extend_sequence(piece))
        rows = e.pending_token_rows(nodes)                   # node by node, in token order
        at_rows = to_device(rows, e.device)
        features = None
        if with_states:
            states = torch.cat([jobs[j][2][at:at + chunk] for j in here])
            features = torch.empty_like(states)
            features[at_rows] = states                       # query order
        device_tokens = None
        if on_device:
            device_tokens = torch.empty(len(rows), dtype=torch.int64, device=e.device)
            device_tokens[at_rows] = torch.cat([
                jobs[j][1][at:at + chunk].to(torch.int64) if isinstance(jobs[j][1], torch.Tensor)
                else to_device(np.asarray(jobs[j][1][at:at + chunk], dtype=np.int64), e.device) for j in here])
        # Rows read: a job's last chunk's last row, or all of its rows when its count is a device value.
        starts = np.cumsum([0] + sizes)
        ends = [(i, j) for i, j in enumerate(here) if len(jobs[j][1]) <= at + chunk]
        wanted = [rows[starts[i]:starts[i + 1]] if jobs[j][3] is not None else rows[starts[i + 1] - 1:starts[i + 1]]
                  for i, j in ends]
        out = e.step(logits_rows=np.concatenate(wanted) if wanted else rows[-1:], return_hidden=with_states,
                     features=features, tokens=device_tokens)   # (no root in this chunk: one row, unread)
        offset = 0
        for (i, j), got in zip(ends, wanted):
            count = jobs[j][3]
            root = slice(offset, offset + 1) if count is None else count.reshape(1) - 1 + offset   # (no wait)
            roots[j] = (out.logits[root][0], out.hidden[root][0] if with_states else None)
            offset += len(got)
    return roots


def chain_layout(drafting: list[tuple[np.ndarray, np.ndarray]], i: int, k: int) -> ChainStep:
    """Chain step ``i`` of the requests being drafted (``drafting``: per request, its sequence's slots and its
    ``[k, depth - 1]`` scratch slots): request ``b``'s sequence (one root), then its ``k`` chains holding tokens
    ``0..i`` in its scratch slots; query ``b * k + j`` is chain ``j``'s token ``i``."""
    b = len(drafting)
    prefix_lens = np.array([len(p) for p, _ in drafting], dtype=np.int64)
    lengths = np.empty(b * (k + 1), dtype=np.int64).reshape(b, k + 1)
    lengths[:, 0], lengths[:, 1:] = prefix_lens, i + 1
    kv_start = np.zeros(b * (k + 1) + 1, dtype=np.int64)
    np.cumsum(lengths.reshape(-1), out=kv_start[1:])
    roots = np.arange(b, dtype=np.int64) * (k + 1)
    parent = np.repeat(roots, k + 1).reshape(b, k + 1)
    parent[:, 0] = -1
    slots = np.concatenate([part for p, s in drafting for part in (p, s[:, :i + 1].reshape(-1))])
    chains = (roots[:, None] + 1 + np.arange(k)).reshape(-1)
    layout = TreeLayout(np.arange(b * (k + 1), dtype=np.int64), parent.reshape(-1), kv_start, slots, chains,
                        np.full(b * k, i, dtype=np.int64))
    return ChainStep(layout, np.arange(b * k))


def _flat_size(depth: int, k: int) -> int:
    return 2 * k + (depth - 1) * 2 * k * k + max(depth - 2, 0) * k


def sequence_slots(engine: Engine, node: int) -> np.ndarray:
    """The pool slots of ``node``'s whole sequence (its path from the root), in order."""
    path = engine.tree.path(node)
    return engine.tree.slots(node) if len(path) == 1 else np.concatenate([engine.tree.slots(n) for n in path])


def _chain_body(ctx: ChainContext | None, inputs: dict[str, torch.Tensor], depth: int, k: int, to_target
                ) -> tuple[torch.Tensor]:
    """The device work of ``B`` requests' proposals: layer 1's candidates from each root's logits, then per
    chain step every request's ``k`` chains' children; each request's next frontier (its ``k`` best children by
    cumulative log-prob) is picked on the device, each chain taking its new parent's path (token, feature,
    K/V in the request's scratch slots). ``[B, flat]`` float64: per request, layer 1's ids and log-probs, each
    deeper layer's ``[k, k]`` ids and log-probs, each frontier's candidate index (what :func:`grown_tree`
    reads)."""
    top = torch.log_softmax(inputs["root_logits"].float(), dim=-1).topk(k)        # [B, k]
    tokens, scores = to_target(top.indices), top.values                           # layer 1: all frontier
    b, root_hidden = tokens.shape[0], inputs.get("root_hidden")                   # (EAGLE's: a draft model has none)
    parts, links = [tokens.double(), scores.double()], []
    width = None if root_hidden is None else root_hidden.shape[-1]
    features = None if root_hidden is None else root_hidden[:, None, :].expand(b, k, width)
    for i in range(depth - 1):
        out = ctx.forward(i, tokens.reshape(-1), None if features is None else features.reshape(b * k, width))
        top = torch.log_softmax(out.logits.float(), dim=-1).topk(k)              # [B * k chains, k children]
        ids, values = to_target(top.indices).reshape(b, k * k), top.values.reshape(b, k * k)
        parts += [ids.double(), values.double()]
        if i == depth - 2:
            break
        pick = (scores.repeat_interleave(k, dim=1) + values).topk(k).indices      # [B, k] best first
        links.append(pick.double())
        parent = pick // k
        scores = scores.gather(1, parent) + values.gather(1, pick)
        tokens = ids.gather(1, pick)
        if features is not None:
            features = out.hidden.reshape(b, k, width).gather(1, parent[:, :, None].expand(b, k, width))
        slots = inputs["scratch"][:, :, :i + 1]                                   # [B, k, i + 1]
        ctx.engine.pool.copy_slots(slots.gather(1, parent[:, :, None].expand(b, k, i + 1)).reshape(-1),
                                   slots.reshape(-1))
    return (torch.cat(parts + links, dim=1),)


def grown_tree(root: int, flat: list[float], k: int, deeper: int, total_tokens: int) -> tuple[TokenTree, list[int]]:
    """The tree of one proposal's candidates (read back as ``flat``: layer 1's ids and log-probs, each deeper
    layer's ``[k, k]`` ids and log-probs, each frontier's candidate index), kept as
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
