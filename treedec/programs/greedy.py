"""Plain greedy decoding of one request: the reference that greedy speculative decoding
(:mod:`treedec.programs.speculative.program`) and every batched path must equal.

:func:`greedy_generate` is a :class:`~treedec.programs.generate.GenerateProgram` at temperature 0 run alone by the
scheduler (the one generation path, pipelined on a GPU), its output grown on the prompt's node so that the
request stays in the tree as a speculative request's does."""
from __future__ import annotations

from typing import Sequence

from treedec.checks import positive_int
from treedec.engine import Engine
from treedec.programs.generate import GenerateProgram
from treedec.runtime.request import MODEL_EOS, eos_token_ids
from treedec.runtime.requests import RequestSpec
from treedec.sampling.params import SamplingParams
from treedec.runtime.scheduler import run_program
from treedec.sampling.stops import StopRule

__all__ = ["greedy_generate"]


def greedy_generate(engine: Engine, prompt_ids: Sequence[int], max_new_tokens: int,
                    eos_token_id: int | Sequence[int] | str | None = MODEL_EOS, pipeline: bool | None = None
                    ) -> list[int]:
    """Plain greedy decoding, one token per engine step: the reference that greedy
    speculative decoding must equal.

    Returns the new tokens up to and including the first EOS id (``eos_token_id`` as in
    :func:`~treedec.programs.speculative.program.speculative_generate`), at most ``max_new_tokens``. The
    request stays in ``engine.tree`` (its root node): the prompt and every new token but the last.

    ``pipeline`` (default: on for a CUDA engine, where the device runs asynchronously; off on the
    CPU, where nothing would overlap): each step is planned and launched before the previous
    step's token is read back (the step reads it on the device), so the host's work
    runs while the device computes. After an EOS one step more has run; its token is dropped
    from the tree (:meth:`SequenceTree.truncate`), so the result and the tree are the same.

    Raises ``ValueError`` before anything runs for a bad argument, or a prompt and ``max_new_tokens`` past
    the model's positions.
    """
    positive_int("max_new_tokens", max_new_tokens)
    if pipeline is not None and not isinstance(pipeline, bool):
        raise ValueError(f"pipeline must be a bool or None (on for a CUDA engine), got {pipeline!r}")
    rule = StopRule(max_new_tokens, eos_token_ids(eos_token_id, engine.model))
    spec = RequestSpec("greedy", prompt_ids=tuple(prompt_ids), params=SamplingParams(max_tokens=max_new_tokens,
                                                                                     temperature=0.0))
    [result] = run_program(engine, GenerateProgram(spec, list(spec.prompt_ids), rule=rule, on_prompt=True),
                           pipeline=pipeline)
    return result.output_ids
