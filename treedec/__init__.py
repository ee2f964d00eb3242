"""treedec: fast tree-structured LLM decoding (DeFT-style tree attention over a paged KV pool).

The front door: ``from treedec import LLM, SamplingParams`` (:mod:`treedec.llm`); below it the programs
(:mod:`treedec.programs`), what runs them (:mod:`treedec.runtime`, :mod:`treedec.sampling`), the engine, the models,
tree attention and the paged tree.

The names below are imported when first used (PEP 562), so that ``import treedec`` (and ``python -m treedec``,
which imports the package before its ``__main__``) imports nothing else: ``treedec.__main__`` cleans the import
path before torch and the rest are imported.
"""
from treedec.lazy import lazy_names

__version__ = "0.1.0"

#: Each public name -> the module it is defined in.
_NAMES = {
    "LLM": "treedec.llm", "BeamSearchOutput": "treedec.outputs", "BeamSearchSequence": "treedec.outputs",
    "CompletionOutput": "treedec.outputs", "RequestOutput": "treedec.outputs",
    "BeamSearchParams": "treedec.programs", "SamplingParams": "treedec.sampling",
    "StructuredOutputsParams": "treedec.sampling",
    "SpeculativeConfig": "treedec.programs.speculative",
    "PlanConfig": "treedec.attention", "TreeAttention": "treedec.attention", "TreePlan": "treedec.attention",
    "BackendUnavailableError": "treedec.errors", "PlanError": "treedec.errors", "PoolExhaustedError": "treedec.errors",
    "TreeError": "treedec.errors",
    "PagedKVPool": "treedec.tree", "SequenceTree": "treedec.tree", "TreeLayout": "treedec.tree",
}

__all__ = sorted(_NAMES)

__getattr__, __dir__ = lazy_names(globals(), _NAMES)
