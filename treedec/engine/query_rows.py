"""Which query row of a step holds a node's last pending token (:meth:`~treedec.engine.Engine.pending_rows`), for
many nodes at once: a few numpy calls, whatever their number (the lanes ask it for every decoding output a step)."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from treedec.errors import TreeError
from treedec.tree.layout import TreeLayout

__all__ = ["QueryRows"]


class QueryRows:
    """The rows of nodes' last pending tokens in a layout; the sort of its node ids is kept until the layout changes."""

    def __init__(self):
        self._layout: TreeLayout | None = None
        self._sorted = self._order = np.zeros(0, dtype=np.int64)

    def last(self, layout: TreeLayout, node_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """[k] int64: the query row of the last pending token of each of ``node_ids`` in ``layout``; TreeError
        naming the nodes that have none."""
        ids = np.asarray(node_ids, dtype=np.int64).reshape(-1)
        if not len(ids):
            return np.zeros(0, dtype=np.int64)
        if layout is not self._layout:
            self._order = np.argsort(layout.node_ids, kind="stable")
            self._sorted, self._layout = layout.node_ids[self._order], layout
        found = np.zeros(len(ids), dtype=bool)
        rows = np.full(len(ids), -1, dtype=np.int64)
        if len(self._sorted) and layout.num_queries:
            at = np.minimum(np.searchsorted(self._sorted, ids), len(self._sorted) - 1)
            index = self._order[at]
            # a node's queries are consecutive (layout order: the nodes depth-first, then their tokens)
            rows = np.searchsorted(layout.query_node, index, side="right") - 1
            found = (self._sorted[at] == ids) & (rows >= 0) & (layout.query_node[np.maximum(rows, 0)] == index)
        if not found.all():
            raise TreeError(f"node(s) {ids[~found][:5].tolist()} have no pending tokens")
        return rows.astype(np.int64, copy=False)
