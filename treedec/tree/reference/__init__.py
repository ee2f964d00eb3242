"""The object implementation of SequenceTree: the reference :class:`~treedec.tree.SequenceTree` (the array
tree) must equal, operation by operation (tests/tree/test_array_tree.py). Not used by the engine."""
from treedec.tree.reference.sequence_tree import ReferenceSequenceTree

__all__ = ["ReferenceSequenceTree"]
