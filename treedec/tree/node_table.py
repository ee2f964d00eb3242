"""NodeTable: the nodes of a :class:`~treedec.tree.SequenceTree` as rows of preallocated numpy columns, and
their tokens and KV slots in one token buffer (internal; the tree's methods are the API).

Rows are taken from a free list and returned to it when a node is pruned; the columns (and the free list)
double when full. The id a caller holds names a row and the row's generation (``generation << 32 | row``),
so an id stays valid until its node is pruned and a stale one is refused even once its row serves another
node: checking any number of ids is one comparison with the ``node_id`` column.

Each node owns a region ``[start, start + cap)`` of two parallel int64 buffers, ``slots`` (its tokens' KV
slots) and ``tokens`` (their ids); its ``length`` first entries are in use. A node that outgrows its region
moves to a new one of twice the size at the end of the buffers (so a growing leaf is copied O(log n) times);
regions left behind are reclaimed by compacting the buffers when half of them is garbage.
"""
from __future__ import annotations

import numpy as np

ROW_BITS = 32
ROW_MASK = (1 << ROW_BITS) - 1
MAX_GENERATION = (1 << (63 - ROW_BITS)) - 1   # a row reused this often is retired (ids stay int64 and unique)
MIN_REGION = 16                               # a growing node's first region, in tokens
NO_ROWS = np.zeros(0, dtype=np.int64)
NO_ROWS.setflags(write=False)

# The columns, int64, of one [capacity, 13] array (a row's fields side by side: freeing rows is one write):
# name, value of a fresh row.
COLUMNS = {
    "node_id": -1,       # the id callers hold while the row is a live node, else -1
    "parent": -1,        # the parent's row; -1 for a root
    "born": 0,           # creation order: children and roots are kept in it
    "num_children": 0,
    "length": 0,         # tokens held
    "pending": 0,        # trailing tokens not yet committed (the step's queries)
    "tail_room": 0,      # free slots after the last token that this node may fill
    "prefix": 0,         # tokens on the path above it: its first token's position
    "start": 0,          # its region of the token buffer
    "cap": 0,
    "paused": 0,         # 1: left out of live_leaves
    "shared": 0,         # 1: a shared root, computed tokens in pages others hold too
    "released": 0,       # leading tokens whose pages it gave back: out of every future query's window
}
FRESH_ROW = np.array(list(COLUMNS.values()), dtype=np.int64)
FIELD = {name: j for j, name in enumerate(COLUMNS)}   # a column's index in a block of fields(rows)
NODE_ID, PARENT, BORN, PREFIX, START, CAP, LENGTH, TAIL, PENDING = (
    FIELD[c] for c in ("node_id", "parent", "born", "prefix", "start", "cap", "length", "tail_room", "pending"))


class NodeTable:
    """Columns ``node_id, parent, born, num_children, length, pending, tail_room, prefix, start, cap, paused,
    shared, released`` (``[capacity]`` int64 views of one table) and ``gen`` (``[capacity]`` int64: how often each
    row was freed), one row per node; rows ``hi`` and up were never used. Buffers ``slots`` and ``tokens``
    (``[buffer size]`` int64), in use up to ``end``, of which ``garbage`` entries belong to no live node's
    region."""

    def __init__(self, rows: int = 64, tokens: int = 1024):
        self._table = np.tile(FRESH_ROW, (rows, 1))
        self.gen = np.zeros(rows, dtype=np.int64)
        self._bind_columns()
        self.hi = 0
        self.num_nodes = 0
        self._born = 0
        self._free_rows = np.zeros(rows, dtype=np.int64)   # a stack: _free_rows[:_num_free]
        self._num_free = 0
        self.slots = np.zeros(tokens, dtype=np.int64)
        self.tokens = np.zeros(tokens, dtype=np.int64)
        self.end = 0
        self.garbage = 0

    # ================================================================ rows

    def new_rows(self, m: int, parent: np.ndarray | int, prefix: np.ndarray | int, caps: np.ndarray | None = None,
                 length: np.ndarray | int = 0, tail_room: np.ndarray | int = 0, pending: np.ndarray | int = 0
                 ) -> np.ndarray:
        """``m`` new rows (``[m]`` int64, created in this order) with parents ``parent`` (rows, -1 for a
        root), ``prefix`` tokens above them, regions of ``caps`` tokens (``[m]`` int64; default none) and the
        given ``length``, ``tail_room`` and ``pending``: all their fields written in one go (the caller fills
        their regions)."""
        reuse = min(m, self._num_free)
        top = self._num_free
        rows = self._free_rows[top - reuse:top][::-1].copy() if reuse else NO_ROWS
        self._num_free = top - reuse
        if reuse < m:
            fresh = m - reuse
            if self.hi + fresh > len(self.node_id):
                self._grow_rows(self.hi + fresh)
            new = np.arange(self.hi, self.hi + fresh, dtype=np.int64)
            rows = new if not reuse else np.concatenate((rows, new))
            self.hi += fresh
        block = np.empty((m, len(FRESH_ROW)), dtype=np.int64)
        block[:] = FRESH_ROW
        block[:, NODE_ID] = (self.gen[rows] << ROW_BITS) | rows
        block[:, PARENT] = parent
        block[:, PREFIX] = prefix
        block[:, BORN] = np.arange(self._born, self._born + m)
        if caps is not None:
            total = int(caps.sum())
            self._reserve(total)   # (may compact: these rows are not live yet, their regions come after)
            block[:, START] = self.end + caps.cumsum() - caps
            block[:, CAP] = caps
            self.end += total
        block[:, LENGTH] = length
        block[:, TAIL] = tail_room
        block[:, PENDING] = pending
        self._table[rows] = block
        self._born += m
        self.num_nodes += m
        return rows

    def free_rows(self, rows: np.ndarray) -> None:
        """Rows of pruned nodes back to the free list (``[k]`` int64, distinct); their ids die, their regions
        become garbage."""
        self.garbage += int(self.cap[rows].sum())
        self._table[rows] = FRESH_ROW
        self.gen[rows] += 1
        self.num_nodes -= len(rows)
        rows = rows[self.gen[rows] <= MAX_GENERATION]
        top = self._num_free
        if top + len(rows) > len(self._free_rows):
            self._free_rows = np.concatenate((self._free_rows[:top], np.zeros(max(top, len(rows)), np.int64)))
        self._free_rows[top:top + len(rows)] = rows
        self._num_free = top + len(rows)

    def fields(self, rows: np.ndarray) -> np.ndarray:
        """[k, 13] int64, a copy: every column of ``rows`` (``FIELD[name]`` is a column's index), for an edit of
        many rows that reads and writes several columns (one gather and one :meth:`set_fields`)."""
        return self._table[rows]

    def set_fields(self, rows: np.ndarray, block: np.ndarray) -> None:
        """Write back a block of :meth:`fields` (``[k, 13]`` int64) for ``rows``."""
        self._table[rows] = block

    def live_rows(self) -> np.ndarray:
        """[n] int64: the rows of live nodes, ascending."""
        return np.flatnonzero(self.node_id[:self.hi] >= 0)

    def free_row_list(self) -> np.ndarray:
        """[f] int64, a copy: the free list, the next row to be taken first."""
        return self._free_rows[:self._num_free][::-1].copy()

    # ================================================================ regions of the token buffer

    def make_room(self, rows: np.ndarray, needed: np.ndarray) -> None:
        """Move each of ``rows`` (``[k]`` int64, distinct) whose region holds fewer than ``needed`` (``[k]``)
        tokens to a new one, at least twice as large, its tokens copied along."""
        short = self.cap[rows] < needed
        if not np.logical_or.reduce(short):
            return
        rows, needed = rows[short], needed[short]
        old_cap = self.cap[rows]
        caps = np.maximum(np.maximum(2 * old_cap, needed), MIN_REGION)
        self._reserve(int(caps.sum()))   # may compact: the rows' starts are read after it
        src = ranges(self.start[rows], self.length[rows])
        new_start = self.end + np.cumsum(caps) - caps
        dst = ranges(new_start, self.length[rows])
        self.slots[dst] = self.slots[src]
        self.tokens[dst] = self.tokens[src]
        self.garbage += int(self.cap[rows].sum())
        self.start[rows] = new_start
        self.cap[rows] = caps
        self.end += int(caps.sum())

    def make_room_for(self, row: int, needed: int) -> None:
        """:meth:`make_room` for one row, in scalars (the per-node edits' path)."""
        cap = self.cap.item(row)
        if cap >= needed:
            return
        new_cap = max(2 * cap, needed, MIN_REGION)
        self._reserve(new_cap)   # may compact: the row's start is read after it
        start, length, end = self.start.item(row), self.length.item(row), self.end
        self.slots[end:end + length] = self.slots[start:start + length]
        self.tokens[end:end + length] = self.tokens[start:start + length]
        self.garbage += cap
        self.start[row] = end
        self.cap[row] = new_cap
        self.end = end + new_cap

    def token_index(self, rows: np.ndarray) -> np.ndarray:
        """[their tokens] int64: the buffer positions of the tokens of ``rows`` (``[k]`` int64), row after row."""
        return ranges(self.start[rows], self.length[rows])

    def held_index(self, rows: np.ndarray) -> np.ndarray:
        """[their held tokens] int64: :meth:`token_index` less each row's ``released`` leading tokens (those whose
        pages the node gave back: their slots are no longer its own)."""
        released = self.released[rows]
        return ranges(self.start[rows] + released, self.length[rows] - released)

    def _reserve(self, extra: int) -> None:
        """Room for ``extra`` more buffer entries at ``end``: compact when half the buffers is garbage, grow
        them (doubling) when that is not enough."""
        size = len(self.slots)
        if self.end + extra <= size:
            return
        if 2 * self.garbage >= self.end:
            self._compact()
        if self.end + extra > size:
            new_size = max(2 * size, self.end + extra)
            for name in ("slots", "tokens"):
                grown = np.zeros(new_size, dtype=np.int64)
                grown[:self.end] = getattr(self, name)[:self.end]
                setattr(self, name, grown)

    def _compact(self) -> None:
        """Live regions packed from the buffers' start, in their present order; garbage dropped."""
        rows = self.live_rows()
        rows = rows[np.argsort(self.start[rows], kind="stable")]
        caps = self.cap[rows]
        new_start = np.cumsum(caps) - caps
        src = self.token_index(rows)
        dst = ranges(new_start, self.length[rows])
        for name in ("slots", "tokens"):
            buf = getattr(self, name)
            buf[dst] = buf[src]   # (a gather: the sources are read before the writes)
        self.start[rows] = new_start
        self.end = int(caps.sum())
        self.garbage = 0

    def _grow_rows(self, needed: int) -> None:
        size = max(2 * len(self.node_id), needed)
        table = np.tile(FRESH_ROW, (size, 1))
        table[:self.hi] = self._table[:self.hi]
        gen = np.zeros(size, dtype=np.int64)
        gen[:self.hi] = self.gen[:self.hi]
        self._table, self.gen = table, gen
        self._bind_columns()

    def _bind_columns(self) -> None:
        for j, name in enumerate(COLUMNS):
            setattr(self, name, self._table[:, j])


def ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """[sum(lens)] int64: ``starts[i] .. starts[i] + lens[i] - 1`` for each i, one after the other
    (``starts``, ``lens``: ``[k]`` int64, ``lens >= 0``)."""
    if len(lens) == 1:
        first = int(starts[0])
        return np.arange(first, first + int(lens[0]), dtype=np.int64)
    ends = lens.cumsum()   # (the ndarray methods: numpy's function wrappers cost more than these small arrays)
    out = np.arange(int(ends[-1]) if len(ends) else 0, dtype=np.int64)
    out += (starts - ends + lens).repeat(lens)
    return out


def count_distinct(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(values, return_counts=True)`` (``[k]`` int64 each) in fewer numpy calls (the speculative
    edits count a few pages every step)."""
    ordered = values.copy()
    ordered.sort()
    edge = np.empty(len(ordered) + 1, dtype=bool)
    edge[0] = edge[-1] = True
    np.not_equal(ordered[1:], ordered[:-1], out=edge[1:-1])
    at = edge.nonzero()[0]
    return ordered[at[:-1]], at[1:] - at[:-1]
