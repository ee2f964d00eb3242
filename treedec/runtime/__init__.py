"""The runtime: what runs programs.

- what a program is and yields (:class:`Program`, :class:`ProgramContext`; :class:`Decode` for outputs decoded
  token by token, resumed with a :class:`DecodeResult`; a :class:`Bulk` request that a :class:`BulkTable` steps with
  every other of its kind, e.g. pipelined speculative verification), and a request and its results
  (:class:`RequestSpec`, :class:`RequestResult`);
- the scheduler (:func:`run_programs`, :func:`run_program`, :class:`SchedulerStats`) and LANES, the batch-level
  per-token data path it steps every decoding output on (:class:`Lanes`);
- online decoding, programs submitted and aborted while it runs (:class:`OnlineScheduler`, :class:`ProgramAborted`;
  the streams of :class:`StreamOutput`), and the prefix cache across requests (:class:`PrefixCache`).
"""
from treedec.runtime.bulk import Bulk, BulkTable
from treedec.runtime.decode import Decode, DecodeResult, LaneOutput, PlacedLanes
from treedec.runtime.lanes import Lanes
from treedec.runtime.online import OnlineScheduler, ProgramAborted
from treedec.runtime.prefix_cache import PrefixCache
from treedec.runtime.program import Program, ProgramContext
from treedec.runtime.requests import RequestResult, RequestSpec
from treedec.runtime.scheduler import run_program, run_programs
from treedec.runtime.scheduler_stats import SchedulerStats
from treedec.runtime.streams import StreamOutput

__all__ = ["Bulk", "BulkTable", "Decode", "DecodeResult", "LaneOutput", "Lanes", "OnlineScheduler", "PlacedLanes",
           "PrefixCache", "Program",
           "ProgramAborted", "ProgramContext", "RequestResult", "RequestSpec", "SchedulerStats", "StreamOutput",
           "run_program", "run_programs"]
