"""A tree's state as tests compare it: everything an operation could change, read through the public API (so
the same for the array SequenceTree and the object ReferenceSequenceTree), and which node ids come next."""
from __future__ import annotations

import numpy as np

from treedec.tree import SequenceTree
from treedec.tree.layout import TreeLayout, depth_first_order


def node_ids(tree) -> list[int]:
    """Every node, in depth-first order."""
    return [i for r in tree.roots for i in tree.subtree(r)]


def tail_room(tree, node: int) -> int:
    """Free slots after the node's last token that it may fill (what pages_to_extend counts in)."""
    return sum(tree.pages_to_extend(node, k) == 0 for k in range(1, tree.pool.page_size))


def layout_arrays(layout: TreeLayout) -> tuple:
    return tuple(getattr(layout, f).tolist() for f in ("node_ids", "parent", "kv_start", "kv_slots", "query_node",
                                                       "query_offset", "node_prefix_len", "query_position"))


def public_state(tree) -> tuple:
    """Every node's fields (parent, children, tokens, slots, tail room, pending, paused), the roots, the printout
    (pages), the counts, the layout and the pool's refcounts and free list."""
    nodes = [(i, tree.parent(i), tree.children(i), tree.tokens(i), tree.slots(i).tolist(), tail_room(tree, i),
              tree.sequence_length(i) - tree.computed_length(i), tree.is_paused(i)) for i in node_ids(tree)]
    return (nodes, tree.roots, tree.pretty_print(), tree.num_pending, tree.num_tokens, tree.num_nodes,
            layout_arrays(tree.layout()), tree.pending_tokens().tolist(), tree.pool.refcount.tolist(),
            tree.pool.free_pages.tolist())


def ids_to_come(tree) -> tuple:
    """What decides the ids of the next nodes made: the array tree's rows (used, free list, creation count),
    the reference's next id."""
    if isinstance(tree, SequenceTree):
        t = tree._table
        return t.hi, t.free_row_list().tolist(), t._born
    return (tree._next_id,)


def snapshot(tree) -> tuple:
    """Everything an operation could change."""
    return public_state(tree), ids_to_come(tree)


def fresh_layout(tree: SequenceTree) -> TreeLayout:
    """The layout of an array tree built from its node table alone (no kept order): nodes in creation order,
    which is how children and roots are ordered, queries in depth-first order."""
    t = tree._table
    rows = t.live_rows()
    rows = rows[np.argsort(t.born[rows], kind="stable")]
    index = {r: i for i, r in enumerate(rows.tolist())}
    parents = [-1 if p < 0 else index[p] for p in t.parent[rows].tolist()]
    children = [[] for _ in rows]
    for i, p in enumerate(parents):
        if p >= 0:
            children[p].append(i)
    order = depth_first_order([i for i, p in enumerate(parents) if p < 0], children)
    lens, pend = t.length[rows].tolist(), t.pending[rows].tolist()
    queries = [(i, o) for i in order for o in range(lens[i] - pend[i], lens[i])]
    return TreeLayout.from_parents(parents, lens, queries, slots=[t.slots[t.token_index(rows[i:i + 1])] for i in
                                                                   range(len(rows))], node_ids=t.node_id[rows])
