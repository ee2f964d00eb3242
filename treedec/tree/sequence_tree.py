"""SequenceTree: the topology and tokens of a forest of decoding trees over a PagedKVPool, as arrays.

Each node is a run of tokens that extends its parent's sequence. The tokens appended since
the last :meth:`SequenceTree.commit_step` are *pending*: they are the queries of the step
being run (their K/V are written by that step's forward pass). A node's tokens live in
pool slots; a node never writes into a page that another node started (except the packed
pages of a speculative token tree, see :meth:`add_token_tree`), so pruning a subtree frees
exactly the pages no remaining node uses: a node holds one reference on each page its slots are in.

Every operation validates its input first and changes nothing when it raises: token ids
and parent indices that are not integers (strings, floats, bools, ...) raise ``TypeError``,
out-of-range ones ``ValueError`` (see :mod:`treedec.tree.validate`), an impossible tree
operation :class:`~treedec.errors.TreeError`, a full pool
:class:`~treedec.errors.PoolExhaustedError`.

The nodes are rows of a :class:`~treedec.tree.node_table.NodeTable` (numpy columns: parent, length,
pending, tail room, ...; tokens and slots in one buffer), so an edit of many nodes (a token tree, a prune,
the lanes' one-token appends of :mod:`treedec.tree.lane_edits`) is a few numpy calls whatever their
number. The subtree edits live in :mod:`treedec.tree.subtree_edits`, the speculative ones in
:mod:`treedec.tree.token_tree_edits`, those of computed tokens (pipelined decoding) in
:mod:`treedec.tree.computed_token_edits`. The forest's depth-first order is kept up to date by each edit
(:class:`~treedec.tree.preorder.Preorder`) and a subtree is a range of it; the layout a step plans from is
made from the last one and the columns (:mod:`treedec.tree.layout_cache`). The object implementation this
one must equal, operation by operation, is :class:`~treedec.tree.reference.ReferenceSequenceTree`.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from treedec.checks import describe, is_int, show_int
from treedec.errors import PoolExhaustedError, TreeError
from treedec.tree.computed_token_edits import ComputedTokenEdits
from treedec.tree.lane_edits import LaneEdits
from treedec.tree.layout import TreeLayout
from treedec.tree.layout_cache import LayoutCache
from treedec.tree.node_table import MIN_REGION, ROW_MASK, NodeTable, ranges
from treedec.tree.paged_kv_pool import PagedKVPool
from treedec.tree.preorder import Preorder
from treedec.tree.subtree_edits import SubtreeEdits
from treedec.tree.token_tree_edits import TokenTreeEdits
from treedec.tree.tree_debugging import TreeDebugging
from treedec.tree.validate import int_array, int_list, int_value, rows
from treedec.tree.verify_edits import VerifyEdits
from treedec.tree.window_release import WindowRelease

NO_SLOTS = np.zeros(0, dtype=np.int64)
NO_SLOTS.setflags(write=False)
FEW_NODES = 16   # extend_many of one token to this many leaves or more: one array append, not a fill each


class SequenceTree(SubtreeEdits, TokenTreeEdits, ComputedTokenEdits, LaneEdits, VerifyEdits, WindowRelease,
                   TreeDebugging):
    """A forest of token trees whose KV lives in ``pool``.

    Public operations: :meth:`add_prompt`, :meth:`add_shared_root`, :meth:`extend`, :meth:`extend_many`,
    :meth:`branch`, :meth:`add_token_tree`, :meth:`add_children`, :meth:`accept`, :meth:`prune`,
    :meth:`prune_dead_end`, :meth:`extend_computed`, :meth:`set_tokens`, :meth:`truncate`, :meth:`pause`,
    :meth:`resume`, :meth:`commit_step`, :meth:`layout`; walks: :meth:`path`, :meth:`subtree`; batch
    operations over many leaves at once (the lanes'): :meth:`append_tokens`, :meth:`pages_to_append`,
    :meth:`set_last_tokens`, :meth:`pending_queries`, :meth:`prune_many`, :meth:`branch_many`; and those of
    batched speculative verification (:mod:`treedec.tree.verify_edits`): :meth:`add_token_trees`,
    :meth:`advance_token_trees`, :meth:`extend_computed_many`, :meth:`truncate_many`, :meth:`set_tokens_many`; for
    models whose every layer has a sliding window (:mod:`treedec.tree.window_release`):
    :meth:`release_outside_window`, :meth:`held_prefix`.

    Node ids are ints that stay valid until their node is pruned; a pruned node's id is never valid again.
    """

    def __init__(self, pool: PagedKVPool):
        self.pool = pool
        self._table = NodeTable()
        self._order = Preorder(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))   # kept by every edit
        self._cache = LayoutCache()
        self._layout: TreeLayout | None = None   # until the next operation: a step asks for it several times
        self._num_pending = 0                    # a count kept, as programs ask for it after every edit
        self._token_trees: dict = {}             # checked token-tree shapes -> their order (TokenTreeEdits)
        self._page_offsets = np.arange(pool.page_size, dtype=np.int64)
        self._release_window: tuple[int, int] | None = None   # (window, margin) once pages are released

    # ================================================================ queries

    @property
    def num_nodes(self) -> int:
        return self._table.num_nodes

    @property
    def num_tokens(self) -> int:
        t = self._table
        return int(t.length[:t.hi].sum())   # (a free row's length is 0)

    @property
    def roots(self) -> list[int]:
        order = self._order
        return order.ids[order.parent < 0].tolist()

    def __contains__(self, node_id: int) -> bool:
        if not is_int(node_id):
            return False
        node_id = int(node_id)
        row = node_id & ROW_MASK
        return row < self._table.hi and self._table.node_id.item(row) == node_id

    def parent(self, node_id: int) -> int | None:
        t = self._table
        up = t.parent.item(self._row(node_id))
        return None if up < 0 else t.node_id.item(up)

    def children(self, node_id: int) -> list[int]:
        row = self._row(node_id)
        if not self._table.num_children.item(row):
            return []
        order = self._order
        at = order.position(int(node_id))
        end = order.subtree_end(at)
        return order.ids[at + 1:end][order.parent[at + 1:end] == at].tolist()

    def tokens(self, node_id: int) -> list[int]:
        """The node's own tokens (not its ancestors')."""
        t = self._table
        row = self._row(node_id)
        start = t.start.item(row)
        return t.tokens[start:start + t.length.item(row)].tolist()

    def node_length(self, node_id: int) -> int:
        """``len(tokens(node_id))`` without the copy: what :meth:`set_tokens` and :meth:`truncate` count in."""
        return self._table.length.item(self._row(node_id))

    def slots(self, node_id: int) -> np.ndarray:
        """[len] int64 KV-pool slots of the node's own tokens."""
        t = self._table
        row = self._row(node_id)
        start = t.start.item(row)
        return t.slots[start:start + t.length.item(row)].copy()

    def first_slots(self, node_ids: Sequence[int]) -> np.ndarray:
        """[n] int64: the KV-pool slot of each node's first token (one slot per node of a token tree from
        :meth:`add_token_tree`), in one call instead of ``n`` :meth:`slots` copies."""
        t = self._table
        rows_ = self._rows_of(node_ids)
        empty = t.length[rows_] == 0
        if empty.any():
            raise TreeError(f"node(s) {t.node_id[rows_[empty]][:5].tolist()} hold no tokens: no first slot")
        return t.slots[t.start[rows_]]

    def sequence(self, node_id: int) -> list[int]:
        """All tokens from the root down to the end of ``node_id``."""
        t = self._table
        return t.tokens[t.token_index(self._path_rows(self._row(node_id)))].tolist()

    def sequence_length(self, node_id: int) -> int:
        """``len(sequence(node_id))`` without building the sequence (the hot path's per-step question)."""
        t = self._table
        row = self._row(node_id)
        return t.prefix.item(row) + t.length.item(row)

    def path(self, node_id: int) -> list[int]:
        """Node ids from the root down to ``node_id``."""
        return self._table.node_id[self._path_rows(self._row(node_id))].tolist()

    def pages_to_extend(self, node_id: int, num_tokens: int) -> int:
        """Fresh pages that appending ``num_tokens`` tokens to ``node_id`` takes (0 while they fit in its last page)."""
        row = self._row(node_id)
        return self._pages_to_extend(row, int_value(num_tokens, "num_tokens", low=0))

    def is_paused(self, node_id: int) -> bool:
        return bool(self._table.paused.item(self._row(node_id)))

    def live_leaves(self) -> list[int]:
        """Leaves that are not paused, in depth-first order."""
        t = self._table
        ids = self._order.ids
        r = ids & ROW_MASK
        return ids[(t.num_children[r] == 0) & (t.paused[r] == 0)].tolist()

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
        t = self._table
        if not layout.num_queries:
            return np.zeros(0, dtype=np.int64)
        rows_ = (layout.node_ids & ROW_MASK)[layout.query_node]
        return t.tokens[t.start[rows_] + layout.query_offset]

    def layout(self) -> TreeLayout:
        """Snapshot of the forest for planning; the queries are the pending tokens.

        The same (read-only) object until the next operation changes the forest.
        """
        if self._layout is None:
            self._layout = self._cache.layout(self._table, self._order)
        return self._layout

    # ================================================================ operations

    def add_prompt(self, tokens: Sequence[int]) -> int:
        """Start a new tree (a new request of the forest) with ``tokens`` (``[n]`` ints >= 0); returns its root id."""
        tokens = int_array(tokens, "tokens", low=0)
        if len(tokens) == 0:
            raise TreeError("a prompt needs at least one token, got 0")
        pages = self.pool.allocate(self.pool.pages_for(len(tokens)))   # raises before any change
        row = self._new_nodes(np.array([len(tokens)], dtype=np.int64), tokens, pages, -1, 0)[0]
        return self._add_root(row)

    def add_shared_root(self, tokens: Sequence[int], slots: np.ndarray) -> int:
        """Start a new tree whose ``tokens`` are computed already: their K/V is in ``slots`` (``[n]`` ints, whole
        pages of the pool, in use: held by others, e.g. the prefix cache), each of those pages gets one more
        holder and no step computes them. Its children start on fresh pages; it never grows. Returns its id.
        Checks first: raises :class:`~treedec.errors.TreeError` (changing nothing) unless ``slots`` are whole pages
        in order, one slot per token."""
        tokens = int_array(tokens, "tokens", low=0)
        slots = np.asarray(slots)
        ps = self.pool.page_size
        if not len(tokens) or len(tokens) % ps or slots.shape != (len(tokens),):
            raise TreeError(f"a shared root needs whole pages of {ps} tokens and one slot per token, got "
                            f"{len(tokens)} tokens and slots of shape {tuple(slots.shape)}")
        pages = slots[::ps] // ps
        if self.pool.whole_pages(slots) * ps != len(slots) or len(np.unique(pages)) != len(pages):
            raise TreeError("a shared root's slots must be whole, distinct pages, each in slot order")
        self.pool.incref(pages)   # raises (changing nothing) for a page not in use
        t = self._table
        n = len(tokens)
        row = t.new_rows(1, -1, 0, np.array([max(n, MIN_REGION)]), n)
        at = t.token_index(row)
        t.slots[at] = slots
        t.tokens[at] = tokens
        t.shared[row] = 1
        return self._add_root(int(row[0]))

    def computed_length(self, node_id: int) -> int:
        """How many of ``node_id``'s sequence's tokens are computed (all but its pending ones)."""
        t = self._table
        row = self._row(node_id)
        return t.prefix.item(row) + t.length.item(row) - t.pending.item(row)

    def extend(self, node_id: int, tokens: Sequence[int]) -> np.ndarray:
        """Append ``tokens`` (``[n]`` ints >= 0) to leaf ``node_id``; returns their ``[n]`` int64 slots."""
        return self.extend_many({node_id: tokens})[node_id]

    def extend_many(self, tokens_by_node: dict[int, Sequence[int]]) -> dict[int, np.ndarray]:
        """Append tokens to several leaves at once (all or nothing); returns slots per node.

        ``tokens_by_node`` maps leaf ids to their new tokens (each ``[n]`` ints >= 0). (One token for each
        of many leaves: :meth:`append_tokens`, without the dicts.)
        """
        if not isinstance(tokens_by_node, Mapping):
            raise TypeError(f"tokens_by_node must be a dict {{leaf id: tokens}}, got {describe(tokens_by_node)}")
        t = self._table
        plan = []
        need = 0
        ps = self.pool.page_size
        for nid, toks in tokens_by_node.items():
            row = self._row(nid)
            if t.num_children.item(row):
                raise TreeError(f"cannot extend node {nid}: it has children {self.children(nid)}; only leaves grow")
            toks = int_list(toks, f"tokens for node {nid}", low=0)   # (a list: cheaper than an array for a few)
            room = t.tail_room.item(row)
            k = -(-(len(toks) - room) // ps) if len(toks) > room else 0
            plan.append((nid, row, toks, k))
            need += k
        if len(plan) >= FEW_NODES and all(len(toks) == 1 for _, _, toks, _ in plan):   # a decode step: arrays
            slots = self._append_rows(np.array([p[1] for p in plan], dtype=np.int64),
                                      np.array([p[2][0] for p in plan], dtype=np.int64))
            return {nid: slots[i:i + 1] for i, (nid, *_) in enumerate(plan)}
        self._check_free(need)
        fresh = self.pool.allocate(need) if need else NO_SLOTS   # every node's pages in one call, in order
        out, used = {}, 0
        for nid, row, toks, k in plan:
            out[nid] = self._fill(row, toks, fresh[used:used + k])
            used += k
        return out

    def branch(self, node_id: int, children: int | Sequence[Sequence[int]]) -> list[int]:
        """Give ``node_id`` new children.

        ``children`` is a count k (k empty children, to be extended later) or a list of
        token lists (each ``[n]`` ints >= 0), one per child. Each child starts on fresh
        pages. Returns the ids.
        """
        row = self._row(node_id)
        if is_int(children):
            if not 1 <= children <= self.pool.num_pages:   # each child needs a page of its own for its first token
                raise TreeError(f"branch needs 1 <= k <= {self.pool.num_pages} (the pool's pages) children, "
                                f"got k={show_int(int(children))}")
            token_lists = [NO_SLOTS] * int(children)
        else:
            token_lists = [int_array(t, f"children[{i}]", low=0) for i, t in enumerate(rows(children, "children"))]
            if not token_lists:
                raise TreeError("branch needs at least one child, got an empty list")
        lens = np.fromiter(map(len, token_lists), dtype=np.int64, count=len(token_lists))
        need = int((-(-lens // self.pool.page_size)).sum())
        self._check_free(need)
        fresh = self.pool.allocate(need)   # as extend_many: one call, in the order the children ask
        t = self._table
        had_children = t.num_children.item(row)
        made = self._new_nodes(lens, np.concatenate(token_lists), fresh, row, t.prefix.item(row) + t.length.item(row))
        t.num_children[row] += len(made)
        order = self._order   # the children go after the parent's subtree, in order
        at = order.position(int(node_id))
        self._order = order.splice(order.subtree_end(at) if had_children else at + 1, t.node_id[made],
                                   np.full(len(made), at))
        return t.node_id[made].tolist()

    def pause(self, node_id: int) -> None:
        """Exclude a leaf from :meth:`live_leaves` (it keeps its KV)."""
        self._table.paused[self._row(node_id)] = 1

    def resume(self, node_id: int) -> None:
        self._table.paused[self._row(node_id)] = 0

    def commit_step(self) -> None:
        """Mark every pending token as computed (call after the step's forward pass)."""
        if self._num_pending:
            t = self._table
            t.pending[:t.hi] = 0
            self._num_pending = 0
        self._layout = None

    # ================================================================ private

    def _row(self, node_id: int) -> int:
        """The row of node ``node_id``; TypeError for an id that is not an int, TreeError for an unknown one."""
        if type(node_id) is not int:
            if not is_int(node_id):
                raise TypeError(f"node id must be an int, got {describe(node_id)}")
            node_id = int(node_id)
        row = node_id & ROW_MASK
        if row >= self._table.hi or self._table.node_id.item(row) != node_id:
            raise TreeError(f"unknown node id {show_int(node_id)} (pruned, or never created)")
        return row

    def _rows_of(self, node_ids) -> np.ndarray:
        """[k] int64 rows of ``node_ids`` (any sequence of ids), with :meth:`_row`'s error for the first bad one.
        A list of ints or an int64 array is checked in one comparison."""
        ids = None
        if type(node_ids) is list and len(node_ids) <= 8:   # a short path: one by one costs less than the arrays
            return np.array([self._row(n) for n in node_ids], dtype=np.int64)
        if isinstance(node_ids, np.ndarray) and node_ids.dtype == np.int64 and node_ids.ndim == 1:
            ids = node_ids
        elif type(node_ids) is list and all(type(n) is int for n in node_ids):
            try:
                ids = np.array(node_ids, dtype=np.int64)
            except OverflowError:   # an int past int64: no node has it (the loop below says which)
                ids = None
        if ids is not None:
            t = self._table
            rows_ = ids & ROW_MASK
            known = rows_ < t.hi
            known[known] = t.node_id[rows_[known]] == ids[known]
            if known.all():
                return rows_
        return np.array([self._row(n) for n in node_ids], dtype=np.int64)   # raises at the first bad id

    def _path_rows(self, row: int) -> np.ndarray:
        """[depth + 1] int64 rows from the root down to ``row``."""
        parent = self._table.parent
        out = [row]
        up = parent.item(row)
        while up >= 0:
            out.append(up)
            up = parent.item(up)
        return np.array(out[::-1], dtype=np.int64)

    def _add_root(self, row: int) -> int:
        """Register a filled parentless row as the forest's last root; returns its id."""
        node_id = self._table.node_id.item(row)
        self._order = self._order.splice(len(self._order), np.array([node_id]), np.array([-1]))
        self._layout = None
        return node_id

    def _new_nodes(self, lens: np.ndarray, tokens: np.ndarray, pages: np.ndarray, parent: np.ndarray | int,
                   prefix: np.ndarray | int) -> np.ndarray:
        """New rows under ``parent`` (a row each, or one for all; -1: roots) after ``prefix`` tokens, node ``i``
        holding ``lens[i]`` of ``tokens`` (``[sum(lens)]`` int64, node after node), each filled from the start of a
        fresh page: ``pages`` (taken already) in order, as many per node as its tokens need. Their tokens are
        pending. Returns the rows."""
        t = self._table
        ps = self.pool.page_size
        blocks = -(-lens // ps) * ps   # each node's slots: the first lens of its pages' slots
        made = t.new_rows(len(lens), parent, prefix, np.where(lens > 0, np.maximum(lens, MIN_REGION), 0), lens,
                          blocks - lens, lens)
        if len(pages):
            fresh = (pages[:, None] * ps + self._page_offsets).reshape(-1)
            at = t.token_index(made)
            t.slots[at] = fresh[ranges(blocks.cumsum() - blocks, lens)]
            t.tokens[at] = tokens
            self._num_pending += len(at)
        self._layout = None
        return made

    def _pages_to_extend(self, row: int, num_tokens: int) -> int:
        return self.pool.pages_for(max(0, num_tokens - self._table.tail_room.item(row)))

    def _check_free(self, num_pages: int) -> None:
        if num_pages > self.pool.num_free_pages:
            raise PoolExhaustedError(
                f"KV pool exhausted: the operation needs {num_pages} page(s) of {self.pool.page_size} tokens, "
                f"{self.pool.num_free_pages} of {self.pool.num_pages} free; nothing was changed")

    def _fill(self, row: int, tokens: np.ndarray | list[int], pages: np.ndarray | None = None) -> np.ndarray:
        """Give ``tokens`` (``[n]`` ints, checked) slots (tail room first, then fresh pages) and append them to ``row``,
        pending. ``pages``: the fresh pages they need, taken already (as :meth:`extend_many` takes them for all
        its nodes at once)."""
        n = len(tokens)
        if n == 0:
            return np.zeros(0, np.int64)
        t = self._table
        length, room = t.length.item(row), t.tail_room.item(row)
        if n == 1 and room and t.cap.item(row) > length:   # a decode step's token: into the last page, in scalars
            at = t.start.item(row) + length
            slot = t.slots.item(at - 1) + 1
            t.slots[at] = slot
            t.tokens[at] = tokens[0]
            t.length[row] = length + 1
            t.tail_room[row] = room - 1
            t.pending[row] = t.pending.item(row) + 1
            self._num_pending += 1
            self._layout = None
            return np.array([slot], dtype=np.int64)
        use_tail = min(n, room)
        if use_tail:
            last = t.slots.item(t.start.item(row) + length - 1)
            new_slots = np.arange(last + 1, last + 1 + use_tail, dtype=np.int64)
        if use_tail == n:   # the common decode step: the node's last page has room
            room -= n
        else:
            ps = self.pool.page_size
            if pages is None:
                pages = self.pool.allocate(-(-(n - use_tail) // ps))   # raises before any change
            fresh = (pages[:, None] * ps + self._page_offsets).reshape(-1)[: n - use_tail]
            new_slots = np.concatenate((new_slots, fresh)) if use_tail else fresh
            room = len(pages) * ps - (n - use_tail)
        t.make_room_for(row, length + n)
        begin = t.start.item(row) + length
        t.slots[begin:begin + n] = new_slots
        t.tokens[begin:begin + n] = tokens
        t.length[row] = length + n
        t.tail_room[row] = room
        t.pending[row] = t.pending.item(row) + n
        self._num_pending += n
        self._layout = None
        return new_slots
