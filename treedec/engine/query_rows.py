"""Which query row of a step holds a node's last pending token (:meth:`~treedec.engine.Engine.pending_rows`), for
many nodes at once: a few numpy calls, whatever their number (the lanes ask it for every decoding output a step)."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from treedec.errors import TreeError
from treedec.tree.layout import TreeLayout

__all__ = ["QueryRows"]


class QueryRows:
    """The rows of nodes' last pending tokens in a layout; the sort of its node ids is kept while the layouts share
    their node order (every decode step's do: the nodes stay, their tokens grow)."""

    def __init__(self):
        self._ids: np.ndarray | None = None   # the node ids (in layout order) the sort below is of
        self._sorted = self._order = np.zeros(0, dtype=np.int64)

    def last(self, layout: TreeLayout, node_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """[k] int64: the query row of the last pending token of each of ``node_ids`` in ``layout``; TreeError
        naming the nodes that have none."""
        ids = node_ids if type(node_ids) is np.ndarray and node_ids.dtype == np.int64 and node_ids.ndim == 1 \
            else np.asarray(node_ids, dtype=np.int64).reshape(-1)
        if not len(ids):
            return np.zeros(0, dtype=np.int64)
        if layout.node_ids is not self._ids:
            self._order = layout.node_ids.argsort(kind="stable")
            self._sorted, self._ids = layout.node_ids[self._order], layout.node_ids
        query_node, n = layout.query_node, len(self._sorted)
        if not n or not len(query_node):
            raise TreeError(f"node(s) {ids[:5].tolist()} have no pending tokens")
        at = self._sorted.searchsorted(ids)
        at[at == n] = n - 1
        index = self._order[at]
        # a node's queries are consecutive (layout order: the nodes depth-first, then their tokens)
        rows = query_node.searchsorted(index, side="right") - 1
        found = (self._sorted[at] == ids) & (rows >= 0) & (query_node[rows] == index)
        if not np.logical_and.reduce(found):
            raise TreeError(f"node(s) {ids[~found][:5].tolist()} have no pending tokens")
        return rows
