"""Sampling: how a request's tokens are drawn and when its outputs end.

- :class:`SamplingParams` (vLLM's fields and defaults: every program, the prompts files, the CLI and the server
  take it), the token picker :func:`sample_tokens` (:data:`GREEDY`: the argmax);
- the logits functions (:mod:`treedec.sampling.logits`: penalties, masks and biases, the warpers, user logits
  processors, logprobs as :class:`Logprob` / :class:`TokenLogprobs`);
- the batched sampler: every row of a step drawn in one call under its own parameters (:func:`sample_rows` over
  :class:`SamplingRows`), its counter-based random numbers (:func:`counter_uniform`);
- stops (:class:`StopRule`, :class:`StopChecker`);
- structured outputs (:class:`StructuredOutputsParams`; compiled to token bitmasks by
  :class:`~treedec.sampling.grammar.GrammarCompiler`, xgrammar).
"""
from treedec.sampling.logits import Logprob, LogitsProcessorError, NonFiniteLogitsError, TokenLogprobs
from treedec.sampling.params import GREEDY, SamplingParams, sample_tokens
from treedec.sampling.rng import counter_uniform, mix64
from treedec.sampling.sampler import (SAMPLER_KERNELS, SamplingRows, penalize, resolve_sampler_kernel, sample_rows,
                                      warp, warp_rows)
from treedec.sampling.stops import StopChecker, StopRule
from treedec.sampling.structured import StructuredOutputsParams

__all__ = ["GREEDY", "Logprob", "LogitsProcessorError", "NonFiniteLogitsError", "SAMPLER_KERNELS", "SamplingParams",
           "SamplingRows", "StopChecker", "StopRule", "StructuredOutputsParams", "TokenLogprobs", "counter_uniform",
           "mix64", "penalize", "resolve_sampler_kernel", "sample_rows", "sample_tokens", "warp", "warp_rows"]
