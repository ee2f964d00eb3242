"""treedec: fast tree-structured LLM decoding (DeFT-style tree attention over a paged KV pool)."""
from treedec.attention import PlanConfig, TreeAttention, TreePlan
from treedec.errors import BackendUnavailableError, PlanError, PoolExhaustedError, TreeError
from treedec.tree import PagedKVPool, SequenceTree, TreeLayout

__version__ = "0.1.0"

__all__ = ["BackendUnavailableError", "PagedKVPool", "PlanConfig", "PlanError", "PoolExhaustedError",
           "SequenceTree", "TreeAttention", "TreeError", "TreeLayout", "TreePlan"]
