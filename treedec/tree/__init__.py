"""Decoding-tree topology and paged KV storage."""
from treedec.tree.layout import TreeLayout
from treedec.tree.paged_kv_pool import PagedKVPool
from treedec.tree.reference import ReferenceSequenceTree as SequenceTree   # until the array tree lands
from treedec.tree.token_tree import TokenTree

__all__ = ["PagedKVPool", "SequenceTree", "TokenTree", "TreeLayout"]
