"""Applies a :class:`~treedec.workloads.Schedule`'s ops to a SequenceTree, with or without a model.

With an :class:`~treedec.engine.Engine`, prompts are prefilled, every step with pending
tokens runs one forward, and each node's next token is the model's greedy choice at its
last computed token. Without one (a *dry run*) the same tree operations run on a
bookkeeping-only pool: the exact page usage of a schedule, known before a model is touched.
"""
from __future__ import annotations

import time

import numpy as np

from treedec.checks import positive_int
from treedec.engine import Engine
from treedec.tree import PagedKVPool, SequenceTree
from treedec.workloads.schedule import (DEFAULT_MAX_TREE_TOKENS, OPS, Accept, Branch, Children, Extend, Handle, Op,
                                        Prompt, Prune, Schedule, TokenTree, Truncate, token_count)


class ScheduleDriver:
    """Runs ops of a schedule on ``engine`` (or on ``tree`` alone, token ids all 0).

    Attributes
    ----------
    nodes : dict
        Handle -> tree node id of every live handle.
    generated : int
        Tokens the model was asked for so far: tokens of ``extend`` ops and of accepted paths.
    emitted : list of int
        Every greedy choice of the model, in order (prefills' next tokens, then each
        forward's next token per computed node, nodes by id).
    layout_seconds : float
        Host time of the last :meth:`forward` spent finding each node's last row.
    """

    def __init__(self, engine: Engine | None = None, tree: SequenceTree | None = None, vocab_size: int = 1,
                 seed: int = 0):
        if (engine is None) == (tree is None):
            raise ValueError("give exactly one of engine (a replay) or tree (a dry run)")
        self.engine = engine
        self.tree = engine.tree if engine is not None else tree
        self.vocab_size = engine.model.config.vocab_size if engine is not None else vocab_size
        self.rng = np.random.default_rng(seed)
        self.nodes: dict[Handle, int] = {}
        self._next_token: dict[int, int] = {}
        self.generated = 0
        self.pending = 0
        self.emitted: list[int] = []
        self.layout_seconds = 0.0

    # ================================================================ ops

    def apply(self, op: Op) -> None:
        """Apply one op (validated by the Schedule: any error here but a TypeError for what is no op is a bug or
        an exhausted pool)."""
        tree = self.tree
        if isinstance(op, Prompt):
            self._prompt(op)
        elif isinstance(op, Branch):
            for h, nid in zip(op.ids, tree.branch(self.nodes[op.node], len(op.ids))):
                self.nodes[h] = nid
        elif isinstance(op, Extend):
            nid = self.nodes[op.node]
            tree.extend(nid, self._tokens(op.tokens, nid))
            self.pending += token_count(op.tokens)
            if isinstance(op.tokens, int):
                self.generated += 1
        elif isinstance(op, TokenTree):
            anchor = self.nodes[op.node]
            tokens = op.tokens
            if tokens is None:
                first, filler = self._next(anchor), self._filler(len(op.parents))
                tokens = [first if p < 0 else t for p, t in zip(op.parents, filler)]
            for h, nid in zip(op.ids, tree.add_token_tree(anchor, tokens, op.parents)):
                self.nodes[h] = nid
            self.pending += len(op.parents)
        elif isinstance(op, Children):
            parents = [self.nodes[h] for h in op.nodes]
            tokens = list(op.tokens) if op.tokens is not None else [self._next(p) for p in parents]
            for h, nid in zip(op.ids, tree.add_children(parents, tokens)):
                self.nodes[h] = nid
            self.pending += len(parents)
        elif isinstance(op, Accept):
            self._accept(op)
        elif isinstance(op, Truncate):
            nid = self.nodes[op.node]
            tree.truncate(nid, op.length)
            self._next_token.pop(nid, None)   # it was the choice after the dropped tokens
        elif isinstance(op, Prune):
            self._prune(self.nodes[op.node])
        else:
            raise TypeError(f"op must be a schedule op ({', '.join(kind.__name__ for kind in OPS)}), got "
                            f"{type(op).__name__}")

    def forward(self) -> list[int] | None:
        """Run the step's forward (or commit, in a dry run); returns the greedy next token per computed node."""
        if not self.pending:
            return None
        self.pending = 0
        if self.engine is None:
            self.tree.commit_step()
            return None
        t0 = time.perf_counter()
        layout = self.tree.layout()
        row_node = layout.node_ids[layout.query_node]
        # The last pending token of each node: its row is the last occurrence of the node.
        last = len(row_node) - 1 - np.unique(row_node[::-1], return_index=True)[1]
        nodes = row_node[last]
        self.layout_seconds = time.perf_counter() - t0
        logits = self.engine.step(logits_rows=last).logits
        tokens = logits.argmax(dim=-1).tolist()  # the controller reads its tokens: a device sync
        self._next_token.update(zip(nodes.tolist(), tokens))
        self.emitted += tokens
        return tokens

    def release(self) -> None:
        """Prune every remaining tree (commits first if a step is in flight)."""
        if self.pending:
            self.tree.commit_step()
            self.pending = 0
        for root in self.tree.roots:
            self._prune(root)

    # ================================================================ private

    def _prompt(self, op: Prompt) -> None:
        tokens = list(op.tokens) if not isinstance(op.tokens, int) else self._filler(op.tokens)
        parent = None if op.parent is None else self.nodes[op.parent]
        if op.pending:   # computed by the step's forward, with its other tokens
            tree = self.tree
            self.nodes[op.id] = tree.add_prompt(tokens) if parent is None else tree.branch(parent, [tokens])[0]
            self.pending += len(tokens)
            return
        if self.engine is not None:
            prefilled = self.engine.prefill(tokens, parent=parent)
            nid = prefilled.node
            self._next_token[nid] = int(prefilled.logits.argmax())
            self.emitted.append(self._next_token[nid])
        else:
            nid = self.tree.add_prompt(tokens) if parent is None else self.tree.branch(parent, [tokens])[0]
            self.tree.commit_step()
        self.nodes[op.id] = nid

    def _accept(self, op: Accept) -> None:
        tree = self.tree
        chain = [self.nodes[h] for h in op.ids]
        anchor = tree.parent(chain[0])
        next_token = self._next_token.get(chain[-1])
        dead = {n for child in tree.children(anchor) for n in tree.subtree(child)}
        accepted = sum(len(tree.tokens(n)) for n in chain)   # a token-tree node may have been extended
        tree.accept(anchor, chain)   # the path's K/V move onto anchor; the rest is freed
        self._forget(dead)
        if next_token is not None:
            self._next_token[anchor] = next_token
        self.generated += accepted

    def _prune(self, nid: int) -> None:
        dead = set(self.tree.subtree(nid))
        self.tree.prune(nid)
        self._forget(dead)

    def _forget(self, dead: set[int]) -> None:
        """Drop the schedule's handles and next tokens of pruned nodes."""
        for h in [h for h, n in self.nodes.items() if n in dead]:
            del self.nodes[h]
        for n in dead:
            self._next_token.pop(n, None)

    def _tokens(self, tokens: int | tuple[int, ...], nid: int) -> list[int]:
        if not isinstance(tokens, int):
            return list(tokens)
        return [self._next(nid)] + self._filler(tokens - 1)

    def _next(self, nid: int | None) -> int:
        """The model's next token at the end of ``nid`` (its parent's for a node with no tokens yet)."""
        while nid is not None:
            if nid in self._next_token:
                return self._next_token[nid]
            nid = self.tree.parent(nid)
        return 0

    def _filler(self, n: int) -> list[int]:
        return self.rng.integers(0, self.vocab_size, n).tolist() if n > 0 else []


def dry_run(schedule: Schedule, page_size: int, max_tree_tokens: int = DEFAULT_MAX_TREE_TOKENS) -> dict:
    """Run ``schedule``'s tree operations on a bookkeeping-only pool.

    Returns ``{"peak_pages", "peak_tokens", "final_free" (all pages free at the end)}``
    for that page size (the pool is large enough for any schedule; it makes no K/V storage).
    The run's host memory grows with the tree's tokens: a schedule whose tree holds more
    than ``max_tree_tokens`` tokens at once raises :class:`ScheduleError` (naming the op)
    before anything is allocated.
    """
    positive_int("page_size", page_size)
    schedule.check_fits(max_tree_tokens=max_tree_tokens)
    # a page holds >= 1 token; a branch of k empty children needs k pages in the pool
    stats = schedule.stats
    pool = PagedKVPool(max(stats.peak_tree_tokens + 1, stats.widest_branch), page_size, allocate_storage=False)
    driver = ScheduleDriver(tree=SequenceTree(pool))
    peak_pages = peak_tokens = 0
    for step in schedule.steps:
        for op in step:
            driver.apply(op)
            peak_pages = max(peak_pages, pool.num_pages - pool.num_free_pages)
            peak_tokens = max(peak_tokens, driver.tree.num_tokens)
        driver.forward()
    driver.release()
    return {"peak_pages": peak_pages, "peak_tokens": peak_tokens, "final_free": pool.num_free_pages == pool.num_pages}
