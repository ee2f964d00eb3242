"""Programs: what users run, as programs of the scheduler (:mod:`treedec.runtime`).

- generation: :func:`greedy_generate` (one request), :func:`generate_batch` and :class:`GenerateProgram` (many,
  sampled or greedy, one forest; each output a lane of the batch), parallel sampling and self-consistency
  (:func:`parallel_sample`, :func:`self_consistency`, :func:`majority_vote`);
- beam search (:func:`beam_search`, :class:`BeamProgram`, :class:`BeamSearchParams`) and the branch controller
  (:func:`run_controller`, :class:`Controller`, :class:`BranchEvery`, :class:`ControllerProgram`);
- sub-packages: :mod:`treedec.programs.speculative` (speculative decoding, draft sources, acceptance) and
  :mod:`treedec.programs.tot` (Tree-of-Thought search, the Game of 24).

What a request is, the scheduler and the online scheduler are :mod:`treedec.runtime`'s; ``SamplingParams``,
logprobs and stop rules :mod:`treedec.sampling`'s; prompts files :mod:`treedec.commands.requests_file`'s.
"""
from treedec.programs.beam import BeamProgram, BeamSearchParams, BeamSearchResult, BeamSearchStats, beam_search
from treedec.programs.controller import BranchEvery, Controller, ControllerProgram, ControllerRun, run_controller
from treedec.programs.generate import GenerateProgram, generate_batch
from treedec.programs.greedy import greedy_generate
from treedec.programs.parallel_sampling import (SamplingResult, SelfConsistencyResult, majority_vote,
                                                parallel_sample, self_consistency)

__all__ = ["BeamProgram", "BeamSearchParams", "BeamSearchResult", "BeamSearchStats", "BranchEvery", "Controller",
           "ControllerProgram", "ControllerRun", "GenerateProgram", "SamplingResult", "SelfConsistencyResult",
           "beam_search", "generate_batch", "greedy_generate", "majority_vote", "parallel_sample", "run_controller",
           "self_consistency"]
