"""Decoding-tree topology and paged KV storage."""
from treedec.tree.lane_edits import PendingQueries
from treedec.tree.layout import TreeLayout
from treedec.tree.paged_kv_pool import PagedKVPool
from treedec.tree.sequence_tree import SequenceTree
from treedec.tree.token_tree import TokenTree

__all__ = ["PagedKVPool", "PendingQueries", "SequenceTree", "TokenTree", "TreeLayout"]
