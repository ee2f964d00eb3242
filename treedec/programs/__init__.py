"""Search programs and their scheduler: what users call to decode with treedec.

- generation: :func:`greedy_generate` (one request), :func:`generate_batch` and :class:`GenerateProgram` (many,
  sampled or greedy, one forest); :class:`SamplingParams` (vLLM's fields: every program, prompts file and the
  CLI take it), the token picker :func:`sample_tokens`, logprobs (:class:`Logprob`, :class:`TokenLogprobs`);
  parallel sampling and self-consistency
  (:func:`parallel_sample`, :func:`self_consistency`, :func:`majority_vote`);
- beam search (:func:`beam_search`, :class:`BeamProgram`) and the branch controller (:func:`run_controller`,
  :class:`Controller`, :class:`BranchEvery`, :class:`ControllerProgram`);
- the scheduler (:func:`run_programs`, :func:`run_program`, :class:`SchedulerStats`) and what a program is
  (:class:`Program`, :class:`ProgramContext`); online decoding, programs submitted and aborted while it runs
  (:class:`OnlineScheduler`, :class:`ProgramAborted`) and its driving thread for a server (:class:`OnlineEngine`,
  its streams of :class:`StreamOutput`);
- stops (:class:`StopRule`, :class:`StopChecker`) and prompts files (:func:`read_requests`, :class:`RequestSpec`,
  :func:`write_results_jsonl`);
- sub-packages: :mod:`treedec.search.speculative` (speculative decoding, draft sources, acceptance) and
  :mod:`treedec.search.tot` (Tree-of-Thought search, the Game of 24).
"""
from treedec.search.batch import GenerateProgram, generate_batch
from treedec.search.beam import BeamProgram, BeamSearchParams, BeamSearchResult, BeamSearchStats, beam_search
from treedec.search.controller import BranchEvery, Controller, ControllerProgram, ControllerRun, run_controller
from treedec.search.generate import greedy_generate
from treedec.search.online import OnlineEngine, OnlineScheduler, ProgramAborted
from treedec.search.streams import StreamOutput
from treedec.search.parallel_sampling import (SamplingResult, SelfConsistencyResult, majority_vote, parallel_sample,
                                              self_consistency)
from treedec.search.prefix_cache import PrefixCache
from treedec.search.program import Program, ProgramContext
from treedec.search.requests_file import (RequestResult, RequestSpec, RequestsFileError, read_requests,
                                          write_results_jsonl)
from treedec.search.logits import Logprob, LogitsProcessorError, NonFiniteLogitsError, TokenLogprobs
from treedec.search.sampling import GREEDY, SamplingParams, sample_tokens
from treedec.search.scheduler import SchedulerStats, run_program, run_programs
from treedec.search.stops import StopChecker, StopRule

__all__ = ["GREEDY", "BeamProgram", "BeamSearchParams", "BeamSearchResult", "BeamSearchStats", "BranchEvery", "Controller",
           "ControllerProgram", "ControllerRun", "GenerateProgram", "LogitsProcessorError", "Logprob",
           "NonFiniteLogitsError", "OnlineEngine", "OnlineScheduler", "PrefixCache", "Program", "ProgramAborted",
           "ProgramContext", "RequestResult", "RequestSpec", "RequestsFileError", "SamplingParams", "SamplingResult",
           "SchedulerStats", "SelfConsistencyResult", "StopChecker", "StopRule", "StreamOutput", "TokenLogprobs",
           "beam_search", "generate_batch", "greedy_generate", "majority_vote", "parallel_sample", "read_requests",
           "run_controller", "run_program", "run_programs", "sample_tokens", "self_consistency", "write_results_jsonl"]
