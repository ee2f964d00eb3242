"""The runner: :class:`Engine` (prefill, step -> :class:`StepOutput`) of a :mod:`treedec.models` network on
treedec's tree attention (its layers grouped by their attention variants: :class:`LayerAttention`), CUDA graphs
(:class:`CudaGraphConfig`), step chains (:class:`StepChain`), pool sizing."""
from treedec.engine.attention_groups import LayerAttention
from treedec.engine.cuda_graphs import CudaGraphConfig
from treedec.engine.engine import Engine, greedy
from treedec.engine.prompt import PromptChunks
from treedec.engine.step_chain import ChainContext, ChainStep, StepChain
from treedec.engine.step_output import PrefillOutput, StepOutput

__all__ = ["ChainContext", "ChainStep", "CudaGraphConfig", "Engine", "LayerAttention", "PrefillOutput", "PromptChunks",
           "StepChain", "StepOutput", "greedy"]
