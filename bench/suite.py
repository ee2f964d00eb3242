"""The attention benchmark suite of BENCH.md: eight decoding-tree workloads as TreeLayouts.

Each workload is built through :class:`~treedec.SequenceTree` over a bookkeeping-only
:class:`~treedec.PagedKVPool` of exactly the pages the tree needs, so its KV slots are
real paged slots (every node starts on a fresh page). The queries are the tree's pending
tokens: the whole token tree for speculative verification, the last token of each live
branch otherwise.

``scale`` shrinks every token count (prompts, branches, recorded node lengths; not the
Medusa topologies) for quick CPU runs; ``scale=1`` is the suite of BENCH.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from treedec import PagedKVPool, SequenceTree, TreeLayout
from treedec.attention import AttentionVariant
from treedec.attention.read_intervals import read_intervals
from treedec.workloads import DEFT_DIR, medusa_tree, tot_snapshot

NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama-3-8B attention


@dataclass(frozen=True)
class Workload:
    """One benchmark tree.

    Attributes
    ----------
    name, description : str
    layout : TreeLayout
        Slots are slots of a pool of ``num_pages`` pages of ``page_size`` tokens.
    num_pages, page_size : int
        The pool the K/V cache must have: ``[num_pages, page_size, NUM_KV_HEADS, head_dim]``
        (HEAD_DIM, Llama-3-8B's, unless a benchmark asks for another).
    """

    name: str
    description: str
    layout: TreeLayout
    num_pages: int
    page_size: int

    def random_inputs(self, device, dtype=None, seed: int | None = 0, head_dim: int = HEAD_DIM,
                      kv_heads: int = NUM_KV_HEADS):
        """Random q [queries, NUM_QO_HEADS, head_dim] and K/V caches [num_pages, page_size,
        kv_heads, head_dim] (standard normal, ``dtype`` default fp16) on ``device``, drawn
        after ``torch.manual_seed(seed)`` unless ``seed`` is None."""
        dtype = dtype or torch.float16
        if seed is not None:
            torch.manual_seed(seed)
        q = torch.randn(self.layout.num_queries, NUM_QO_HEADS, head_dim, dtype=dtype, device=device)
        return q, *self.random_kv(device, dtype, head_dim, kv_heads)

    def random_kv(self, device, dtype=None, head_dim: int = HEAD_DIM, kv_heads: int = NUM_KV_HEADS):
        """One random K and V cache pair [num_pages, page_size, kv_heads, head_dim]."""
        shape = (self.num_pages, self.page_size, kv_heads, head_dim)
        dtype = dtype or torch.float16
        return torch.randn(shape, dtype=dtype, device=device), torch.randn(shape, dtype=dtype, device=device)


def spec_medusa(name: str, tree_size: int, prompt: int, page_size: int = 16, scale: float = 1.0) -> Workload:
    """A ``prompt``-token node with the Medusa token tree of ``tree_size{N}.json`` under it.

    Queries: all tree tokens (each reads the prompt, its ancestors and itself).
    """
    medusa = medusa_tree(tree_size)
    prompt = scaled(prompt, scale)
    pool = bookkeeping_pool(page_size, [prompt, medusa.size])
    tree = SequenceTree(pool)
    root = tree.add_prompt(token_ids(prompt))
    tree.commit_step()
    tree.add_token_tree(root, token_ids(medusa.size), medusa.parents)
    return Workload(name, f"{prompt}-token prompt + Medusa tree_size{tree_size} token tree; all "
                          f"{medusa.size} tree tokens are queries", tree.layout(), pool.num_pages, page_size)


def fewshot(name: str, prompt: int, branches: int, branch_len: int, page_size: int = 16,
            scale: float = 1.0) -> Workload:
    """A shared prompt with ``branches`` children of ``branch_len`` tokens; one query per branch (its last token)."""
    prompt, branch_len = scaled(prompt, scale), scaled(branch_len, scale)
    parents = [-1] + [0] * branches
    lengths = [prompt] + [branch_len] * branches
    layout, num_pages = build_layout(parents, lengths, range(1, branches + 1), page_size)
    return Workload(name, f"{prompt}-token prompt, {branches} branches of {branch_len} tokens; query = "
                          f"last token of each branch", layout, num_pages, page_size)


def tot_chain(name: str, prompt: int, depth: int, thought: int, width: int, frontier: int,
              page_size: int = 16, scale: float = 1.0) -> Workload:
    """A prompt, a chain of ``depth`` thoughts, ``width`` frontier thoughts under the last one.

    One query per frontier thought (its last token).
    """
    prompt, thought, frontier = scaled(prompt, scale), scaled(thought, scale), scaled(frontier, scale)
    parents = [-1] + list(range(depth)) + [depth] * width
    lengths = [prompt] + [thought] * depth + [frontier] * width
    layout, num_pages = build_layout(parents, lengths, range(depth + 1, depth + 1 + width), page_size)
    return Workload(name, f"{prompt}-token prompt, a chain of {depth} thoughts of {thought} tokens, {width} "
                          f"frontier thoughts of {frontier}; query = last token of each frontier thought",
                    layout, num_pages, page_size)


def tot_trace(name: str, file: str, tree_index: int, fraction: float, page_size: int = 16,
              scale: float = 1.0) -> Workload:
    """A recorded ToT-BFS tree at ``fraction`` of its decode iterations (see :func:`tot_snapshot`)."""
    snap = tot_snapshot(DEFT_DIR / "reasoning" / file, tree_index, fraction)
    lengths = [scaled(int(n), scale) for n in snap.lengths]
    layout, num_pages = build_layout(snap.parents, lengths, snap.queries[:, 0], page_size)
    return Workload(name, f"reasoning/{file} tree {tree_index} at iteration {snap.iteration} "
                          f"({fraction:.0%}): {len(lengths)} nodes, {sum(lengths)} tokens, "
                          f"{len(snap.queries)} generating nodes", layout, num_pages, page_size)


#: name -> builder(page_size=16, scale=1.0), in BENCH.md's order.
SUITE: dict[str, Callable[..., Workload]] = {
    "spec_medusa64_p4k": lambda **kw: spec_medusa("spec_medusa64_p4k", 64, 4000, **kw),
    "spec_medusa256_p4k": lambda **kw: spec_medusa("spec_medusa256_p4k", 256, 4000, **kw),
    "spec_medusa64_p32k": lambda **kw: spec_medusa("spec_medusa64_p32k", 64, 32000, **kw),
    "fewshot_b30_p4k": lambda **kw: fewshot("fewshot_b30_p4k", 4000, 30, 200, **kw),
    "fewshot_b50_p16k": lambda **kw: fewshot("fewshot_b50_p16k", 16000, 50, 400, **kw),
    "tot_d5w10": lambda **kw: tot_chain("tot_d5w10", 1000, 5, 300, 10, 150, **kw),
    "tot_sorting1": lambda **kw: tot_trace("tot_sorting1", "sorting128ToT.json", 1, 0.8, **kw),
    "tot_docmerge0": lambda **kw: tot_trace("tot_docmerge0", "docmergeToT.json", 0, 0.8, **kw),
}


def build_workload(name: str, page_size: int = 16, scale: float = 1.0) -> Workload:
    """Build suite workload ``name`` (one of :data:`SUITE`)."""
    if name not in SUITE:
        raise ValueError(f"unknown workload {name!r}; the suite has {list(SUITE)}")
    if not 0.0 < scale <= 1.0:
        raise ValueError(f"scale must be in (0, 1], got {scale!r}")
    return SUITE[name](page_size=page_size, scale=scale)


def windowed_kv_layout(layout: TreeLayout, window: int) -> TreeLayout:
    """``layout`` with only the KV a ``window``-token sliding window reads: each node's tokens before every
    reader's window dropped, nodes no window reads emptied (what the windowed planner flattens; the same slots).
    Its plain (unwindowed) plan reads the same KV: the yardstick of the windowed kernel (BENCH.md's "never more than
    1.05x the plain kernel over the same windowed KV")."""
    reads = read_intervals(layout, AttentionVariant(window=window))
    lens = layout.node_len
    dropped = np.where(reads.node_len > 0, lens - reads.node_len, 0)
    kv_start = np.concatenate([[0], np.cumsum(reads.node_len)]).astype(np.int64)
    return TreeLayout(layout.node_ids, layout.parent, kv_start, reads.kv_slots, layout.query_node,
                      layout.query_offset - dropped[layout.query_node])


# ===================================================================== building blocks (bench/families.py's too)


def scaled(num_tokens: int, scale: float) -> int:
    """A workload's token count times ``scale`` (smaller shapes for CPU runs), at least 1."""
    return max(1, int(round(num_tokens * scale)))


def token_ids(n: int) -> list[int]:
    """``n`` token ids for a node: any will do, attention does not read them."""
    return list(range(n))


def bookkeeping_pool(page_size: int, node_lengths) -> PagedKVPool:
    """A bookkeeping pool with exactly the pages of nodes that each start on a fresh page."""
    pages = sum(-(-int(n) // page_size) for n in node_lengths)
    return PagedKVPool(max(pages, 1), page_size, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
                       allocate_storage=False)


def build_layout(parents, lengths, query_nodes, page_size: int) -> tuple[TreeLayout, int]:
    """Grow a SequenceTree of the given nodes (parents first); the last token of each query node is pending.

    Returns the layout and the pool's page count.
    """
    parents = np.asarray(parents, dtype=np.int64)
    query = np.zeros(len(parents), dtype=bool)
    query[np.asarray(list(query_nodes), dtype=np.int64)] = True
    pool = bookkeeping_pool(page_size, lengths)
    tree = SequenceTree(pool)
    ids: list[int] = []
    for i, (p, n) in enumerate(zip(parents.tolist(), lengths)):
        committed = token_ids(n - int(query[i]))
        if p < 0:
            ids.append(tree.add_prompt(committed))
        else:
            assert p < i, f"parents must come before children: parents[{i}] = {p}"
            ids.append(tree.branch(ids[p], [committed])[0])
    tree.commit_step()
    tree.extend_many({ids[i]: [0] for i in np.flatnonzero(query).tolist()})
    return tree.layout(), pool.num_pages
