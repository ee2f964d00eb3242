"""Sampling: the batched sampler (every row of a step drawn in one call, each under its own parameters) and its
counter-based random numbers. (``SamplingParams``, the logits processors and the stop rules join this package
when ``treedec/search/`` is split into runtime/, sampling/ and programs/.)"""
from treedec.sampling.rng import counter_uniform, mix64
from treedec.sampling.sampler import SamplingRows, penalize, sample_rows, warp_rows

__all__ = ["SamplingRows", "counter_uniform", "mix64", "penalize", "sample_rows", "warp_rows"]
