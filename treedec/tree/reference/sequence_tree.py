"""ReferenceSequenceTree: the object implementation of :class:`~treedec.tree.SequenceTree` (a dict of
:class:`~treedec.tree.reference.tree_node.TreeNode` objects), kept as the reference the array tree must equal
(tests/tree/test_array_tree.py), as the numpy planner is the compiled planner's. Same API, same behaviour,
same errors; node ids are handed out in creation order and never reused.

The topology and tokens of a forest of decoding trees over a PagedKVPool.

Each node is a run of tokens that extends its parent's sequence. The tokens appended since
the last :meth:`SequenceTree.commit_step` are *pending*: they are the queries of the step
being run (their K/V are written by that step's forward pass). A node's tokens live in
pool slots; a node never writes into a page that another node started (except the packed
pages of a speculative token tree, see :meth:`add_token_tree`), so pruning a subtree frees
exactly the pages no remaining node uses.

Every operation validates its input first and changes nothing when it raises: token ids
and parent indices that are not integers (strings, floats, bools, ...) raise ``TypeError``,
out-of-range ones ``ValueError`` (see :mod:`treedec.tree.validate`), an impossible tree
operation :class:`~treedec.errors.TreeError`, a full pool
:class:`~treedec.errors.PoolExhaustedError`.

The operations run on every decode step, so the forest's depth-first order is kept up to date
by each edit (:class:`~treedec.tree.preorder.Preorder`) rather than rebuilt, and a subtree is
found as a range of it; the subtree walks and removals live in :mod:`treedec.tree.subtree_edits`, the
speculative edits in :mod:`treedec.tree.token_tree_edits`.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from treedec.checks import describe, is_int, show_int
from treedec.errors import PoolExhaustedError, TreeError
from treedec.tree.layout import TreeLayout
from treedec.tree.paged_kv_pool import PagedKVPool
from treedec.tree.preorder import Preorder
from treedec.tree.reference.subtree_edits import SubtreeEdits
from treedec.tree.reference.token_tree_edits import TokenTreeEdits
from treedec.tree.reference.tree_debugging import TreeDebugging
from treedec.tree.reference.tree_node import TreeNode
from treedec.tree.validate import int_list, int_value, rows

FEW_PAGES = 256   # up to this many held pages are counted in Python (numpy's fixed cost is higher)
NO_SLOTS = np.zeros(0, dtype=np.int64)   # an empty node's slot buffer, shared (read-only)
NO_SLOTS.setflags(write=False)


class ReferenceSequenceTree(SubtreeEdits, TokenTreeEdits, TreeDebugging):
    """A forest of token trees whose KV lives in ``pool``.

    Public operations: :meth:`add_prompt`, :meth:`extend`, :meth:`extend_many`,
    :meth:`branch`, :meth:`add_token_tree`, :meth:`add_children`, :meth:`accept`, :meth:`prune`,
    :meth:`prune_dead_end`, :meth:`extend_computed`, :meth:`set_tokens`, :meth:`truncate`, :meth:`pause`,
    :meth:`resume`, :meth:`commit_step`, :meth:`layout`; walks: :meth:`path`, :meth:`subtree`.
    """

    def __init__(self, pool: PagedKVPool):
        self.pool = pool
        self._nodes: dict[int, TreeNode] = {}
        self._roots: list[int] = []
        self._next_id = 0
        self._preorder: Preorder | None = None   # once built, every edit keeps it up to date
        self._layout: TreeLayout | None = None   # until the next operation: a step asks for it several times
        self._num_pending = 0                    # a count kept, as programs ask for it after every edit
        self._pending_nodes: list[TreeNode] = []  # every node with pending tokens (and maybe some without)
        self._token_trees: dict = {}             # checked token-tree parents -> their preorder (TokenTreeEdits)
        self._page_offsets = np.arange(pool.page_size)

    # ================================================================ queries

    @property
    def num_nodes(self) -> int:
        return len(self._nodes)

    @property
    def num_tokens(self) -> int:
        return sum(len(n.tokens) for n in self._nodes.values())

    @property
    def roots(self) -> list[int]:
        return list(self._roots)

    def __contains__(self, node_id: int) -> bool:
        return is_int(node_id) and node_id in self._nodes

    def parent(self, node_id: int) -> int | None:
        return self._get(node_id).parent

    def children(self, node_id: int) -> list[int]:
        return list(self._get(node_id).children)

    def tokens(self, node_id: int) -> list[int]:
        """The node's own tokens (not its ancestors')."""
        return list(self._get(node_id).tokens)

    def node_length(self, node_id: int) -> int:
        """``len(tokens(node_id))`` without the copy: what :meth:`set_tokens` and :meth:`truncate` count in."""
        return self._get(node_id).length

    def slots(self, node_id: int) -> np.ndarray:
        """[len] int64 KV-pool slots of the node's own tokens."""
        node = self._get(node_id)
        return node.slots[: len(node.tokens)].copy()

    def first_slots(self, node_ids: Sequence[int]) -> np.ndarray:
        """[n] int64: the KV-pool slot of each node's first token (one slot per node of a token tree from
        :meth:`add_token_tree`), in one call instead of ``n`` :meth:`slots` copies."""
        nodes = [self._get(n) for n in node_ids]
        empty = [n.id for n in nodes if not n.tokens]
        if empty:
            raise TreeError(f"node(s) {empty[:5]} hold no tokens: no first slot")
        return np.fromiter((n.slots[0] for n in nodes), dtype=np.int64, count=len(nodes))

    def sequence(self, node_id: int) -> list[int]:
        """All tokens from the root down to the end of ``node_id``."""
        return [t for nid in self.path(node_id) for t in self._nodes[nid].tokens]

    def sequence_length(self, node_id: int) -> int:
        """``len(sequence(node_id))`` without building the sequence (the hot path's per-step question)."""
        return sum(len(self._nodes[nid].tokens) for nid in self.path(node_id))

    def path(self, node_id: int) -> list[int]:
        """Node ids from the root down to ``node_id``."""
        out = []
        nid: int | None = node_id
        self._get(node_id)
        while nid is not None:
            out.append(nid)
            nid = self._nodes[nid].parent
        return out[::-1]

    def pages_to_extend(self, node_id: int, num_tokens: int) -> int:
        """Fresh pages that appending ``num_tokens`` tokens to ``node_id`` takes (0 while they fit in its last page)."""
        return self._pages_to_extend(self._get(node_id), int_value(num_tokens, "num_tokens", low=0))

    def is_paused(self, node_id: int) -> bool:
        return self._get(node_id).paused

    def live_leaves(self) -> list[int]:
        """Leaves that are not paused, in depth-first order."""
        return [i for i in self._order() if not self._nodes[i].children and not self._nodes[i].paused]

    @property
    def num_pending(self) -> int:
        """Tokens pending (the next step's queries), without building the layout."""
        return self._num_pending

    def pending_slots(self) -> np.ndarray:
        """[Q] int64 slots of the pending tokens, in the order of :meth:`layout`'s queries."""
        return self.layout().query_slot

    def pending_tokens(self) -> np.ndarray:
        """[Q] int64 token ids of the pending tokens, in query order."""
        layout = self.layout()
        queried = np.zeros(layout.num_nodes, dtype=bool)
        queried[layout.query_node] = True
        out = []
        for nid in layout.node_ids[queried].tolist():   # the nodes with queries, in order
            node = self._nodes[nid]
            out += node.tokens[len(node.tokens) - node.pending:]
        return np.array(out, dtype=np.int64)

    def layout(self) -> TreeLayout:
        """Snapshot of the forest for planning; the queries are the pending tokens.

        The same (read-only) object until the next operation changes the forest.
        """
        if self._layout is None:
            self._layout = self._make_layout()
        return self._layout

    def _make_layout(self) -> TreeLayout:
        order = self._structure()   # its arrays are read-only and replaced, never changed, by edits
        lens, pending, parts = [], [], []
        for n in map(self._nodes.__getitem__, order.ids.tolist()):
            k = len(n.tokens)
            lens.append(k)
            pending.append(n.pending)
            parts.append(n.slots if len(n.slots) == k else n.slots[:k])   # (a token tree's buffers are exact)
        kv_slots = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        lens = np.array(lens, dtype=np.int64)
        kv_start = np.zeros(len(lens) + 1, dtype=np.int64)
        np.cumsum(lens, out=kv_start[1:])
        pending = np.array(pending, dtype=np.int64)
        query_node = np.repeat(np.arange(len(lens)), pending)
        # query q of node i is its token lens[i] - pending[i] + (q - the node's first query)
        query_offset = np.arange(len(query_node)) + np.repeat(lens - np.cumsum(pending), pending)
        for a in (kv_start, kv_slots, query_node, query_offset):
            a.setflags(write=False)   # shared by every caller until the forest changes
        return TreeLayout(order.ids, order.parent, kv_start, kv_slots, query_node, query_offset)

    # ================================================================ operations

    def add_prompt(self, tokens: Sequence[int]) -> int:
        """Start a new tree (a new request of the forest) with ``tokens`` (``[n]`` ints >= 0); returns its root id."""
        tokens = int_list(tokens, "tokens", low=0)
        if len(tokens) == 0:
            raise TreeError("a prompt needs at least one token, got 0")
        node = self._new_node(parent=None)
        self._fill(node, tokens)  # may raise before anything is registered
        return self._add_root(node)

    def add_shared_root(self, tokens: Sequence[int], slots: np.ndarray) -> int:
        """Start a new tree whose ``tokens`` are computed already: their K/V is in ``slots`` (``[n]`` ints, whole
        pages of the pool, in use: held by others, e.g. the prefix cache), each of those pages gets one more
        holder and no step computes them. Its children start on fresh pages; it never grows. Returns its id.
        Checks first: raises :class:`~treedec.errors.TreeError` (changing nothing) unless ``slots`` are whole pages
        in order, one slot per token."""
        tokens = int_list(tokens, "tokens", low=0)
        slots = np.asarray(slots)
        ps = self.pool.page_size
        if not tokens or len(tokens) % ps or slots.shape != (len(tokens),):
            raise TreeError(f"a shared root needs whole pages of {ps} tokens and one slot per token, got "
                            f"{len(tokens)} tokens and slots of shape {tuple(slots.shape)}")
        pages = slots[::ps] // ps
        if self.pool.whole_pages(slots) * ps != len(slots) or len(np.unique(pages)) != len(pages):
            raise TreeError("a shared root's slots must be whole, distinct pages, each in slot order")
        self.pool.incref(pages)   # raises (changing nothing) for a page not in use
        node = self._new_node(parent=None)
        node.tokens, node.slots, node.pages = tokens, slots.astype(np.int64), pages.astype(np.int64).tolist()
        node.shared = True
        self._layout = None
        return self._add_root(node)

    def computed_length(self, node_id: int) -> int:
        """How many of ``node_id``'s sequence's tokens are computed (all but its pending ones)."""
        return self.sequence_length(node_id) - self._get(node_id).pending

    def extend(self, node_id: int, tokens: Sequence[int]) -> np.ndarray:
        """Append ``tokens`` (``[n]`` ints >= 0) to leaf ``node_id``; returns their ``[n]`` int64 slots."""
        return self.extend_many({node_id: tokens})[node_id]

    def extend_many(self, tokens_by_node: dict[int, Sequence[int]]) -> dict[int, np.ndarray]:
        """Append tokens to several leaves at once (all or nothing); returns slots per node.

        ``tokens_by_node`` maps leaf ids to their new tokens (each ``[n]`` ints >= 0).
        """
        if not isinstance(tokens_by_node, Mapping):
            raise TypeError(f"tokens_by_node must be a dict {{leaf id: tokens}}, got {describe(tokens_by_node)}")
        plan = []
        need = 0
        ps = self.pool.page_size
        for nid, toks in tokens_by_node.items():
            node = self._get(nid)
            if node.children:
                raise TreeError(f"cannot extend node {nid}: it has children {node.children}; only leaves grow")
            toks = int_list(toks, f"tokens for node {nid}", low=0)
            k = -(-(len(toks) - node.tail_room) // ps) if len(toks) > node.tail_room else 0
            plan.append((nid, node, toks, k))
            need += k
        self._check_free(need)
        fresh = self.pool.allocate(need)   # every node's fresh pages in one call, in the order they ask
        out, used = {}, 0
        for nid, node, toks, k in plan:
            out[nid] = self._fill(node, toks, fresh[used:used + k])
            used += k
        return out

    def branch(self, node_id: int, children: int | Sequence[Sequence[int]]) -> list[int]:
        """Give ``node_id`` new children.

        ``children`` is a count k (k empty children, to be extended later) or a list of
        token lists (each ``[n]`` ints >= 0), one per child. Each child starts on fresh
        pages. Returns the ids.
        """
        parent = self._get(node_id)
        if is_int(children):
            if not 1 <= children <= self.pool.num_pages:   # each child needs a page of its own for its first token
                raise TreeError(f"branch needs 1 <= k <= {self.pool.num_pages} (the pool's pages) children, "
                                f"got k={show_int(int(children))}")
            token_lists = [[] for _ in range(int(children))]
        else:
            token_lists = [int_list(t, f"children[{i}]", low=0) for i, t in enumerate(rows(children, "children"))]
            if not token_lists:
                raise TreeError("branch needs at least one child, got an empty list")
        need = [self.pool.pages_for(len(t)) for t in token_lists]
        self._check_free(sum(need))
        fresh = self.pool.allocate(sum(need))   # as extend_many: one call, in the order the children ask
        ids, used = [], 0
        for toks, k in zip(token_lists, need):
            child = self._new_node(parent=parent.id)
            self._fill(child, toks, fresh[used:used + k])
            used += k
            self._nodes[child.id] = child
            self._next_id += 1
            ids.append(child.id)
        if self._preorder is not None:   # the children go after the parent's subtree, in order
            order = self._preorder
            at = order.position(parent.id)
            self._preorder = order.splice(order.subtree_end(at) if parent.children else at + 1, np.array(ids),
                                          np.full(len(ids), at))
        parent.children += ids
        self._layout = None
        return ids

    def set_tokens(self, node_id: int, start: int, tokens: Sequence[int]) -> None:
        """Overwrite the ids of ``node_id``'s tokens ``start .. start + len(tokens) - 1`` (``[n]`` ints >= 0).

        Slots and K/V stay as they are. For pipelined decoding: a step is planned with a
        placeholder token while the previous step still runs, its forward reads the real token on
        the device (``Engine.step(tokens=...)``), and the real id is recorded here once it is
        read back.
        """
        node = self._get(node_id)
        tokens = int_list(tokens, "tokens", low=0)
        start = int_value(start, "start", low=0)
        if start + len(tokens) > node.length:
            raise TreeError(f"node {node_id} has {node.length} tokens; cannot set tokens {start}.."
                            f"{start + len(tokens) - 1}")
        node.tokens[start:start + len(tokens)] = tokens

    def extend_computed(self, node_id: int, tokens: Sequence[int]) -> np.ndarray:
        """Append ``tokens`` (``[n]`` ints >= 0) to leaf ``node_id`` as computed tokens: no step computes them,
        the caller writes their K/V into the returned ``[n]`` slots (e.g. a pipelined speculative step moving
        the accepted tokens' K/V on the device before their ids reach the host; :meth:`set_tokens` records
        the ids later, :meth:`truncate` drops the ones not accepted). Checks first, changes nothing when it
        raises."""
        node = self._computed_leaf(node_id, "append computed tokens to")
        tokens = int_list(tokens, "tokens", low=0)
        slots = self._fill(node, tokens)   # raises before any change when the pool is short
        node.pending -= len(tokens)
        self._num_pending -= len(tokens)
        return slots

    def truncate(self, node_id: int, length: int) -> np.ndarray:
        """Keep the first ``length`` (>= 1) tokens of leaf ``node_id``; free the pages only the rest held.

        The dropped tokens must be computed (no pending tokens): e.g. a step run past an EOS by
        pipelined decoding. Returns the pages freed.
        """
        node = self._computed_leaf(node_id, "truncate")
        length = int_value(length, "length", low=1)
        if length > node.length:
            raise TreeError(f"cannot truncate node {node_id} of {node.length} tokens to {length}")
        return self.pool.decref(self._cut_tail(node, length))

    def _cut_tail(self, node: TreeNode, length: int) -> np.ndarray:
        """:meth:`truncate` of ``node`` to ``length`` tokens (checked) but the pool's part: the pages it no longer
        holds, for the caller to decref (one node's, or a batch's at once)."""
        pages = np.asarray(node.pages, dtype=np.int64)
        ps = self.pool.page_size
        # A page stays when a kept token is in it (kept pages marked in a pool-sized mask: no sort over a long
        # node's slots).
        mark = np.zeros(self.pool.num_pages, dtype=bool)
        mark[node.slots[:length] // ps] = True
        kept = mark[pages]
        del node.tokens[length:]
        node.pages = pages[kept].tolist()
        # The kept last page's free slots are refilled only when no other node holds that page (a page held by
        # others, e.g. a shared prefix's, may have their tokens after this node's).
        last = int(node.slots[length - 1])
        page = last // self.pool.page_size
        alone = node.pages and node.pages[-1] == page and self.pool.refcount[page] == 1
        node.tail_room = self.pool.page_size - 1 - last % self.pool.page_size if alone else 0
        self._layout = None
        return pages[~kept]   # (the last kept page is not among them: its count above is the one after the decref)

    def pause(self, node_id: int) -> None:
        """Exclude a leaf from :meth:`live_leaves` (it keeps its KV)."""
        self._get(node_id).paused = True

    def resume(self, node_id: int) -> None:
        self._get(node_id).paused = False

    def commit_step(self) -> None:
        """Mark every pending token as computed (call after the step's forward pass)."""
        for node in self._pending_nodes:
            node.pending = 0
        self._pending_nodes = []
        self._num_pending = 0
        self._layout = None

    # ================================================================ private

    def _get(self, node_id: int) -> TreeNode:
        if type(node_id) is not int and not is_int(node_id):
            raise TypeError(f"node id must be an int, got {describe(node_id)}")
        try:
            return self._nodes[node_id]
        except KeyError:
            raise TreeError(f"unknown node id {show_int(int(node_id))} (pruned, or never created)") from None

    def _computed_leaf(self, node_id: int, doing: str) -> TreeNode:
        """The node, checked to be a leaf without pending tokens (what ``doing`` needs)."""
        node = self._get(node_id)
        if node.children:
            raise TreeError(f"cannot {doing} node {node_id}: it has children {node.children[:5]}")
        if node.pending:
            raise TreeError(f"cannot {doing} node {node_id}: it has {node.pending} pending token(s); "
                            f"call commit_step() first")
        return node

    def _add_root(self, node: TreeNode) -> int:
        """Register a filled parentless node as the forest's last root; returns its id."""
        self._nodes[node.id] = node
        self._roots.append(node.id)
        self._next_id += 1
        if self._preorder is not None:
            self._preorder = self._preorder.splice(len(self._preorder), np.array([node.id]), np.array([-1]))
        return node.id

    def _new_node(self, parent: int | None) -> TreeNode:
        return TreeNode(self._next_id, parent, [], NO_SLOTS, [])   # (the first fill gives it a buffer)

    def _order(self) -> list[int]:
        return self._structure().ids.tolist()

    def _structure(self) -> Preorder:
        """The forest in depth-first preorder: built on first use, then kept up to date by every edit."""
        if self._preorder is None:
            self._preorder = self._fresh_preorder()
        return self._preorder

    def _fresh_preorder(self) -> Preorder:
        return Preorder.build(self._roots, {i: n.children for i, n in self._nodes.items()})

    @staticmethod
    def _holds(nodes: Iterable[TreeNode]) -> tuple[np.ndarray, np.ndarray]:
        """The pages ``nodes`` hold (``[k]`` int64, distinct) and how many of them hold each (``[k]`` int64)."""
        pages: list[int] = []
        for n in nodes:
            pages += n.pages
        if len(pages) > FEW_PAGES:   # a whole request: numpy's sort counts faster
            return np.unique(np.array(pages, dtype=np.int64), return_counts=True)
        count = Counter(pages)       # a speculative tree's nodes, a few per page
        return (np.fromiter(count, dtype=np.int64, count=len(count)),
                np.fromiter(count.values(), dtype=np.int64, count=len(count)))

    def _pages_freed(self, holds: tuple[np.ndarray, np.ndarray]) -> int:
        """Pages that dropping ``holds`` (as :meth:`_holds` gives them) would return to the pool."""
        pages, times = holds
        return int((self.pool.refcount[pages] == times).sum())

    def _cut(self, start: int, stop: int, nodes: list[TreeNode],
             holds: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
        """Remove ``nodes``, the whole subtrees at preorder positions ``start .. stop - 1``, freeing their
        pages in one :meth:`PagedKVPool.decref`, which checks before it changes anything; the caller
        unlinks the subtrees' tops from their parents. Returns the pages freed."""
        freed = self.pool.decref(*(self._holds(nodes) if holds is None else holds))
        for n in nodes:
            del self._nodes[n.id]
        self._preorder = self._structure().cut(start, stop)
        self._layout = None
        return freed

    def _pages_to_extend(self, node: TreeNode, num_tokens: int) -> int:
        return self.pool.pages_for(max(0, num_tokens - node.tail_room))

    def _check_free(self, num_pages: int) -> None:
        if num_pages > self.pool.num_free_pages:
            raise PoolExhaustedError(
                f"KV pool exhausted: the operation needs {num_pages} page(s) of {self.pool.page_size} tokens, "
                f"{self.pool.num_free_pages} of {self.pool.num_pages} free; nothing was changed")

    def _fill(self, node: TreeNode, tokens: list[int], pages: np.ndarray | None = None) -> np.ndarray:
        """Give ``tokens`` slots (tail room first, then fresh pages) and append them, pending. ``pages``: the
        fresh pages they need, taken already (as :meth:`extend_many` takes them for all its nodes at once)."""
        n = len(tokens)
        if n == 0:
            return np.zeros(0, np.int64)
        start = len(node.tokens)
        use_tail = min(n, node.tail_room)
        if use_tail:
            last = int(node.slots[start - 1])
            new_slots = np.arange(last + 1, last + 1 + use_tail, dtype=np.int64)
        if use_tail == n:   # the common decode step: the node's last page has room
            node.tail_room -= n
        else:
            ps = self.pool.page_size
            if pages is None:
                pages = self.pool.allocate(-(-(n - use_tail) // ps))   # raises before any change
            fresh = (pages[:, None] * ps + self._page_offsets).reshape(-1)[: n - use_tail]
            new_slots = np.concatenate((new_slots, fresh)) if use_tail else fresh
            node.pages += pages.tolist()
            node.tail_room = len(pages) * ps - (n - use_tail)
        if len(node.slots) < start + n:  # grow the buffer geometrically
            buf = np.empty(max(2 * len(node.slots), start + n, 16), dtype=np.int64)
            buf[:start] = node.slots[:start]
            node.slots = buf
        node.slots[start:start + n] = new_slots
        node.tokens += tokens
        if not node.pending:
            self._pending_nodes.append(node)
        node.pending += n
        self._num_pending += n
        self._layout = None
        return new_slots
