"""SequenceTree: the topology and tokens of a forest of decoding trees over a PagedKVPool.

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
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from treedec.errors import PoolExhaustedError, TreeError
from treedec.tree.layout import TreeLayout, depth_first_order
from treedec.tree.paged_kv_pool import PagedKVPool
from treedec.tree.tree_debugging import TreeDebugging
from treedec.tree.validate import describe, int_array, int_list, int_value, is_int, on_cycle, rows, show_int


@dataclass
class _Node:
    id: int
    parent: int | None
    tokens: list[int]
    slots: np.ndarray                      # capacity buffer; the first len(tokens) are valid
    pages: list[int]                       # distinct pages this node holds a reference on
    tail_room: int = 0                     # free slots after the last token that this node may fill
    pending: int = 0                       # trailing tokens not yet committed
    paused: bool = False
    children: list[int] = field(default_factory=list)

    @property
    def length(self) -> int:
        return len(self.tokens)


class SequenceTree(TreeDebugging):
    """A forest of token trees whose KV lives in ``pool``.

    Public operations: :meth:`add_prompt`, :meth:`extend`, :meth:`extend_many`,
    :meth:`branch`, :meth:`add_token_tree`, :meth:`accept`, :meth:`prune`, :meth:`pause`,
    :meth:`resume`, :meth:`commit_step`, :meth:`layout`.
    """

    def __init__(self, pool: PagedKVPool):
        self.pool = pool
        self._nodes: dict[int, _Node] = {}
        self._roots: list[int] = []
        self._next_id = 0
        self._preorder: tuple[list[int], np.ndarray] | None = None
        self._layout: TreeLayout | None = None   # until the next operation: a step asks for it several times
        self._num_pending = 0                    # a count kept, as programs ask for it after every edit

    # ================================================================ queries

    @property
    def num_nodes(self) -> int:
        return len(self._nodes)

    @property
    def num_tokens(self) -> int:
        return sum(n.length for n in self._nodes.values())

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

    def slots(self, node_id: int) -> np.ndarray:
        """[len] int64 KV-pool slots of the node's own tokens."""
        node = self._get(node_id)
        return node.slots[: node.length].copy()

    def sequence(self, node_id: int) -> list[int]:
        """All tokens from the root down to the end of ``node_id``."""
        return [t for nid in self.path(node_id) for t in self._nodes[nid].tokens]

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

    def pages_freed_by_prune(self, node_ids: Iterable[int]) -> int:
        """Pages that pruning the subtrees of ``node_ids`` would return to the pool (changes nothing).

        A page is freed when every node holding it is in one of those subtrees.
        """
        return self._pages_freed({i for nid in node_ids for i in self._subtree(self._get(nid).id)})

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
        out = [t for i in self._order() for t in self._nodes[i].tokens[self._nodes[i].length - self._nodes[i].pending:]]
        return np.asarray(out, dtype=np.int64)

    def layout(self) -> TreeLayout:
        """Snapshot of the forest for planning; the queries are the pending tokens.

        The same (read-only) object until the next operation changes the forest.
        """
        if self._layout is None:
            self._layout = self._make_layout()
        return self._layout

    def _make_layout(self) -> TreeLayout:
        order, parent = self._structure()
        nodes = [self._nodes[i] for i in order]
        lens = np.fromiter((n.length for n in nodes), dtype=np.int64, count=len(nodes))
        pending = np.fromiter((n.pending for n in nodes), dtype=np.int64, count=len(nodes))
        kv_start = np.zeros(len(nodes) + 1, dtype=np.int64)
        np.cumsum(lens, out=kv_start[1:])
        query_node = np.repeat(np.arange(len(nodes)), pending)
        first = np.cumsum(pending) - pending
        query_offset = (lens - pending)[query_node] + np.arange(len(query_node)) - first[query_node]
        kv_slots = np.concatenate([n.slots[: n.length] for n in nodes]) if nodes else np.zeros(0, np.int64)
        arrays = (np.asarray(order, dtype=np.int64), parent.copy(), kv_start, kv_slots, query_node, query_offset)
        for a in arrays:
            a.setflags(write=False)   # shared by every caller until the forest changes
        return TreeLayout(*arrays)

    # ================================================================ operations

    def add_prompt(self, tokens: Sequence[int]) -> int:
        """Start a new tree (a new request of the forest) with ``tokens`` (``[n]`` ints >= 0); returns its root id."""
        tokens = int_list(tokens, "tokens", low=0)
        if len(tokens) == 0:
            raise TreeError("a prompt needs at least one token, got 0")
        node = self._new_node(parent=None)
        self._fill(node, tokens)  # may raise before anything is registered
        self._nodes[node.id] = node
        self._roots.append(node.id)
        self._next_id += 1
        self._preorder = self._layout = None
        return node.id

    def extend(self, node_id: int, tokens: Sequence[int]) -> np.ndarray:
        """Append ``tokens`` (``[n]`` ints >= 0) to leaf ``node_id``; returns their ``[n]`` int64 slots."""
        return self.extend_many({node_id: tokens})[node_id]

    def extend_many(self, tokens_by_node: dict[int, Sequence[int]]) -> dict[int, np.ndarray]:
        """Append tokens to several leaves at once (all or nothing); returns slots per node.

        ``tokens_by_node`` maps leaf ids to their new tokens (each ``[n]`` ints >= 0).
        """
        if not isinstance(tokens_by_node, Mapping):
            raise TypeError(f"tokens_by_node must be a dict {{leaf id: tokens}}, got {describe(tokens_by_node)}")
        plan = {}
        for nid, toks in tokens_by_node.items():
            node = self._get(nid)
            if node.children:
                raise TreeError(f"cannot extend node {nid}: it has children {node.children}; only leaves grow")
            plan[nid] = int_list(toks, f"tokens for node {nid}", low=0)
        need = sum(self._pages_to_extend(self._nodes[nid], len(t)) for nid, t in plan.items())
        self._check_free(need)
        return {nid: self._fill(self._nodes[nid], toks) for nid, toks in plan.items()}

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
        self._check_free(sum(self.pool.pages_for(len(t)) for t in token_lists))
        ids = []
        for toks in token_lists:
            child = self._new_node(parent=parent.id)
            self._fill(child, toks)
            self._nodes[child.id] = child
            parent.children.append(child.id)
            self._next_id += 1
            ids.append(child.id)
        self._preorder = self._layout = None
        return ids

    def add_token_tree(self, node_id: int, tokens: Sequence[int], parents: Sequence[int]) -> list[int]:
        """Hang a token tree (e.g. Medusa/EAGLE candidates) under ``node_id``, one node per token.

        ``tokens`` is ``[m]`` ints >= 0; ``parents[i]`` is the index of token i's parent
        token, or -1 for a child of ``node_id``: ints in ``[-1, i)``, so parents come
        before their children. The tokens are packed into ``ceil(m / page_size)`` fresh
        pages, shared by refcount. Returns node ids in token order.
        """
        anchor = self._get(node_id)
        tokens = int_list(tokens, "tokens", low=0)
        parents = int_array(parents, "parents", low=-1)
        m = len(tokens)
        if m == 0 or len(parents) != m:
            raise TreeError(f"need one parent per token and at least one token, got {m} tokens and {len(parents)} parents")
        outside = np.flatnonzero(parents >= m)
        if len(outside):   # before the cycle check, which follows parents
            i = int(outside[0])
            raise TreeError(f"parents[{i}] = {int(parents[i])} is not a token index in [-1, {m})")
        late = np.flatnonzero(parents >= np.arange(m))
        if len(late):
            i, p = int(late[0]), int(parents[late[0]])
            kind = "a cycle" if on_cycle(parents, i) else "a forward reference"
            raise TreeError(f"parents[{i}] = {p}: parents must come before children ({kind})")
        return self._hang([anchor.id] * m, tokens, parents.tolist())

    def add_children(self, node_ids: Sequence[int], tokens: Sequence[int]) -> list[int]:
        """Give each node ``node_ids[i]`` a new child holding the one token ``tokens[i]`` (a node may be
        named several times: several children), pending; e.g. one layer of a draft tree whose nodes
        have different parents. The tokens are packed into ``ceil(m / page_size)`` fresh pages, as
        :meth:`add_token_tree` packs its tokens. Returns the new node ids in order; checks everything
        first and changes nothing when it raises."""
        tokens = int_list(tokens, "tokens", low=0)
        anchors = [self._get(n).id for n in int_list(node_ids, "node_ids", low=0)]
        if not tokens or len(anchors) != len(tokens):
            raise TreeError(f"need one node per token and at least one token, got {len(tokens)} tokens and "
                            f"{len(anchors)} nodes")
        return self._hang(anchors, tokens, [-1] * len(tokens))

    def _hang(self, anchors: list[int], tokens: list[int], parents: list[int]) -> list[int]:
        """New one-token pending nodes: token ``i`` under ``anchors[i]`` when ``parents[i] < 0``, else under
        new node ``parents[i]``; packed into fresh shared pages (checked input)."""
        m = len(tokens)
        pages = self.pool.allocate(self.pool.pages_for(m))  # raises before any change
        slots = (pages[:, None] * self.pool.page_size + np.arange(self.pool.page_size)).reshape(-1)[:m]
        ids = [self._next_id + i for i in range(m)]
        page_list = (slots // self.pool.page_size).tolist()
        for i in range(m):
            parent_id = anchors[i] if parents[i] < 0 else ids[parents[i]]
            node = _Node(id=ids[i], parent=parent_id, tokens=[tokens[i]], slots=slots[i:i + 1].copy(),
                         pages=[page_list[i]], pending=1)
            self._nodes[node.id] = node
            self._nodes[parent_id].children.append(node.id)
        # The pages are fresh with refcount 1: add the other nodes that hold each one.
        held, holders = np.unique(slots // self.pool.page_size, return_counts=True)
        self.pool.incref(np.repeat(held, holders - 1))
        self._next_id += m
        self._num_pending += m
        self._preorder = self._layout = None
        return ids

    def prune(self, node_id: int) -> np.ndarray:
        """Remove ``node_id`` and its whole subtree; returns the pages freed.

        Pruning a root removes that request. A subtree that still has pending tokens
        (queries of the step in flight) cannot be pruned until :meth:`commit_step`.
        """
        self._get(node_id)
        subtree = self._subtree(node_id)
        pending = [i for i in subtree if self._nodes[i].pending]
        if pending:
            raise TreeError(f"cannot prune node {node_id}: node(s) {pending[:5]} in its subtree have pending "
                            f"tokens of the current step; call commit_step() first")
        return self._remove_subtrees([node_id], subtree)

    def accept(self, anchor: int, path: Sequence[int]) -> np.ndarray:
        """Keep a verified path of a speculative tree under leaf ``anchor``; free the rest.

        ``path`` lists committed nodes from a child of ``anchor`` downwards, each the parent
        of the next (e.g. the accepted tokens of a verified token tree). Their tokens are
        appended to ``anchor`` with their K/V moved along (no recompute, nothing pending),
        then every child subtree of ``anchor`` is pruned, pages freed. Checks everything first
        and changes nothing when it raises. Returns the ``[n]`` slots the tokens now hold.
        """
        node = self._get(anchor)
        path = int_list(path, "path", low=0)
        chain = [self._get(n) for n in path]
        for parent, child in zip([node] + chain, chain):
            if child.parent != parent.id:
                raise TreeError(f"path must be a chain under node {anchor}: node {child.id}'s parent is "
                                f"{child.parent}, not {parent.id}")
        doomed = [n for c in node.children for n in self._subtree(c)]
        busy = [n for n in doomed if self._nodes[n].pending]
        if busy:
            raise TreeError(f"cannot accept under node {anchor}: node(s) {busy[:5]} below it have pending tokens "
                            f"of the current step; call commit_step() first")
        tokens = [t for c in chain for t in c.tokens]
        need = self._pages_to_extend(node, len(tokens))
        if need > self.pool.num_free_pages and need > self.pool.num_free_pages + self._pages_freed(doomed):
            raise PoolExhaustedError(f"KV pool exhausted: keeping {len(tokens)} accepted token(s) needs {need} "
                                     f"page(s); nothing was changed")
        saved = None
        if tokens and self.pool.k is not None:
            saved = self.pool.gather(np.concatenate([c.slots[:c.length] for c in chain]))
        if node.children:
            self._remove_subtrees(list(node.children), doomed)
        slots = self._fill(node, tokens)
        node.pending -= len(tokens)   # their K/V are in place: nothing to compute
        self._num_pending -= len(tokens)
        if saved is not None:
            self.pool.scatter(slots, saved)
        return slots

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

    def truncate(self, node_id: int, length: int) -> np.ndarray:
        """Keep the first ``length`` (>= 1) tokens of leaf ``node_id``; free the pages only the rest held.

        The dropped tokens must be computed (no pending tokens): e.g. a step run past an EOS by
        pipelined decoding. Returns the pages freed.
        """
        node = self._get(node_id)
        length = int_value(length, "length", low=1)
        if node.children:
            raise TreeError(f"cannot truncate node {node_id}: it has children {node.children[:5]}")
        if node.pending:
            raise TreeError(f"cannot truncate node {node_id}: it has {node.pending} pending token(s); "
                            f"call commit_step() first")
        if length > node.length:
            raise TreeError(f"cannot truncate node {node_id} of {node.length} tokens to {length}")
        kept_pages = set((node.slots[:length] // self.pool.page_size).tolist())
        dropped = [p for p in node.pages if p not in kept_pages]
        freed = self.pool.decref(np.asarray(dropped, dtype=np.int64))
        del node.tokens[length:]
        node.pages = [p for p in node.pages if p in kept_pages]
        node.tail_room = 0   # the kept last page's free slots may follow another node's: never refill them
        self._layout = None
        return freed

    def pause(self, node_id: int) -> None:
        """Exclude a leaf from :meth:`live_leaves` (it keeps its KV)."""
        self._get(node_id).paused = True

    def resume(self, node_id: int) -> None:
        self._get(node_id).paused = False

    def commit_step(self) -> None:
        """Mark every pending token as computed (call after the step's forward pass)."""
        for node in self._nodes.values():
            node.pending = 0
        self._num_pending = 0
        self._layout = None

    # ================================================================ private

    def _get(self, node_id: int) -> _Node:
        if type(node_id) is not int and not is_int(node_id):
            raise TypeError(f"node id must be an int, got {describe(node_id)}")
        try:
            return self._nodes[node_id]
        except KeyError:
            raise TreeError(f"unknown node id {show_int(int(node_id))} (pruned, or never created)") from None

    def _new_node(self, parent: int | None) -> _Node:
        return _Node(id=self._next_id, parent=parent, tokens=[], slots=np.zeros(0, np.int64), pages=[])

    def _order(self) -> list[int]:
        return self._structure()[0]

    def _structure(self) -> tuple[list[int], np.ndarray]:
        """Node ids in depth-first preorder and each one's parent index; cached until the topology changes."""
        if self._preorder is None:
            order = depth_first_order(self._roots, {i: n.children for i, n in self._nodes.items()})
            index = {nid: i for i, nid in enumerate(order)}
            parent = np.array([-1 if self._nodes[i].parent is None else index[self._nodes[i].parent] for i in order],
                              dtype=np.int64)
            self._preorder = (order, parent)
        return self._preorder

    def _subtree(self, node_id: int) -> list[int]:
        """``node_id`` and its descendants, depth-first (the tree has no cycles: ops build it top-down)."""
        order, stack = [], [node_id]
        while stack:
            i = stack.pop()
            order.append(i)
            stack.extend(reversed(self._nodes[i].children))
        return order

    def _pages_freed(self, nodes) -> int:
        """Pages that removing ``nodes`` (whole subtrees, each node once) would return to the pool."""
        pages = [p for i in nodes for p in self._nodes[i].pages]
        if not pages:
            return 0
        held, holders = np.unique(np.asarray(pages, dtype=np.int64), return_counts=True)
        return int((self.pool.refcount[held] == holders).sum())

    def _remove_subtrees(self, tops: list[int], nodes: list[int]) -> np.ndarray:
        """Remove the subtrees under ``tops`` (``nodes``: all their nodes), freeing their pages in one
        :meth:`PagedKVPool.decref`, which checks before it changes anything; returns the pages freed."""
        pages = [p for i in nodes for p in self._nodes[i].pages]
        freed = self.pool.decref(np.asarray(pages, dtype=np.int64))
        for top in tops:
            parent = self._nodes[top].parent
            if parent is None:
                self._roots.remove(top)
            else:
                self._nodes[parent].children.remove(top)
        for i in nodes:
            del self._nodes[i]
        self._preorder = self._layout = None
        return freed

    def _pages_to_extend(self, node: _Node, num_tokens: int) -> int:
        return self.pool.pages_for(max(0, num_tokens - node.tail_room))

    def _check_free(self, num_pages: int) -> None:
        if num_pages > self.pool.num_free_pages:
            raise PoolExhaustedError(
                f"KV pool exhausted: the operation needs {num_pages} page(s) of {self.pool.page_size} tokens, "
                f"{self.pool.num_free_pages} of {self.pool.num_pages} free; nothing was changed")

    def _fill(self, node: _Node, tokens: list[int]) -> np.ndarray:
        """Give ``tokens`` slots (tail room first, then fresh pages) and append them."""
        n = len(tokens)
        if n == 0:
            return np.zeros(0, np.int64)
        self._layout = None
        ps = self.pool.page_size
        use_tail = min(n, node.tail_room)
        last = int(node.slots[node.length - 1]) if node.length else -1
        tail_slots = np.arange(last + 1, last + 1 + use_tail, dtype=np.int64)
        pages = self.pool.allocate(self.pool.pages_for(n - use_tail))
        fresh = (pages[:, None] * ps + np.arange(ps)).reshape(-1)[: n - use_tail]
        new_slots = np.concatenate([tail_slots, fresh])
        start = node.length
        if len(node.slots) < start + n:  # grow the buffer geometrically
            buf = np.empty(max(2 * len(node.slots), start + n, 16), dtype=np.int64)
            buf[:start] = node.slots[:start]
            node.slots = buf
        node.slots[start:start + n] = new_slots
        node.tokens.extend(tokens)
        node.pages.extend(pages.tolist())
        node.tail_room = node.tail_room - use_tail if len(pages) == 0 else len(pages) * ps - (n - use_tail)
        node.pending += n
        self._num_pending += n
        return new_slots
