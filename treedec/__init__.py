"""treedec: fast tree-structured LLM decoding (DeFT-style tree attention over a paged KV pool).

The front door: ``from treedec import LLM, SamplingParams`` (:mod:`treedec.llm`); below it the programs
(:mod:`treedec.search`), the engine, the models, tree attention and the paged tree."""
from treedec.attention import PlanConfig, TreeAttention, TreePlan
from treedec.errors import BackendUnavailableError, PlanError, PoolExhaustedError, TreeError
from treedec.llm import LLM, CompletionOutput, RequestOutput
from treedec.search import SamplingParams
from treedec.search.speculative import SpeculativeConfig
from treedec.tree import PagedKVPool, SequenceTree, TreeLayout

__version__ = "0.1.0"

__all__ = ["LLM", "BackendUnavailableError", "CompletionOutput", "PagedKVPool", "PlanConfig", "PlanError",
           "PoolExhaustedError", "RequestOutput", "SamplingParams", "SequenceTree", "SpeculativeConfig",
           "TreeAttention", "TreeError", "TreeLayout", "TreePlan"]
