"""One loop for every program: programs say what to add to the tree, the scheduler steps them all.

A *program* (greedy or sampled generation, beam search, speculative decoding, Tree-of-Thought,
a branch controller) is a Python generator, made by its :meth:`Program.run`. It edits the
engine's tree (adds the tokens it wants computed: new leaves, a prompt continuation, a
speculative token tree) and then *yields* a :class:`StepRequest` naming the nodes whose last
pending tokens' outputs it reads; it is resumed with a :class:`StepRows` holding those rows
(logits, and on request hidden states and row heads) once the step has run. When it returns,
its return value is its result. So a program is a small state machine whose state is its
suspended code, and the engine step is made in one place only, here. A program that needs a
device tensor's values on the host (the tokens it drew) yields :class:`Read`: the reads of all
programs are copied back together, one wait for all instead of one each. Those types are in
:mod:`treedec.runtime.program`.

:func:`run_programs` runs many programs over one engine's forest. Each iteration it

1. admits queued programs while the pool holds their prompts plus headroom for the next step
   of every live program (:meth:`Program.start_pages`, :meth:`Program.step_pages`); requests
   whose prompts share a prefix read one copy of it (:mod:`treedec.runtime.prefixes`): the
   prefix is prefilled when a member is admitted and none holds it, its pages counted in that
   member's admission, and pruned after its last member;
2. resumes the live programs, which edit the tree and yield; a program that needs more free
   pages than there are yields :class:`Wait` instead and is retried next iteration;
3. runs ONE engine step over every program's pending tokens (one plan, one forward) and
   hands each program its rows;
4. retires the programs that returned (each frees its own pages when it ends).

Pool pressure never crashes a run: a program that cannot grow waits while others run; when
every live program waits, the pages of shared prefixes that no running program reads are
taken back first, then the most recently admitted program is *preempted* (closed, which frees
its pages, and its prefix's when no other member runs; queued again at the front, to run again
from its start: a seeded program gives the same result; :attr:`SchedulerStats.preemptions`
counts them). Only a program that cannot run alone in the pool raises
:class:`~treedec.errors.PoolExhaustedError` (a shared prefix holds whole pages, so a member
takes the pages it takes alone).

Before anything runs, every program whose length is known up front (:meth:`Program.positions`:
its prompt and token budget) is checked against the model's positions
(:func:`~treedec.runtime.request.position_limit`); one that may run past them raises
``ValueError`` naming it, and nothing runs.

Pipelining (no host wait between steps): a program may yield placeholder tokens whose ids are
on the device (``StepRequest.tokens``: drawn from the last step's logits, not read back) and
ask for a device tensor to be read (``StepRequest.read``); the step is launched first and the
program gets the values read in its next :class:`StepRows`, copied for all programs at once.

:func:`run_program` runs a single program (the one-request functions of :mod:`treedec.programs`
are that); there a :class:`Wait` raises at once, as there is nothing to wait for.
:class:`~treedec.runtime.online.OnlineScheduler` drives the same loop, an iteration at a time, while
programs are submitted and aborted.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

from treedec.checks import nonnegative_int, positive_int
from treedec.engine import Engine
from treedec.runtime.prefix_cache import PrefixCache
from treedec.runtime.program import Program
from treedec.runtime.request import check_positions
from treedec.runtime.program import program_name
from treedec.runtime.scheduler_loop import SchedulerLoop
from treedec.runtime.scheduler_stats import SchedulerStats

__all__ = ["SchedulerStats", "run_program", "run_programs"]


def run_program(engine: Engine, program: Program, pipeline: bool | None = None) -> Any:
    """Run one program alone on ``engine`` (``pipeline`` as :func:`run_programs`'); returns its result. A
    :class:`Wait` raises :class:`~treedec.errors.PoolExhaustedError` (nothing else would free pages)."""
    results, _ = run_programs(engine, [program], preempt=False, pipeline=pipeline)
    return results[0]


def run_programs(engine: Engine, programs: Iterable[Program], *, max_step_tokens: int | None = None,
                 min_shared_prefix: int | None = None, preempt: bool = True, prefix_cache: PrefixCache | None = None,
                 on_done: Callable[[int, Any], None] | None = None,
                 on_step: Callable[[SchedulerStats], None] | None = None, pipeline: bool | None = None,
                 seed: int = 0) -> tuple[list[Any], SchedulerStats]:
    """Run ``programs`` batched over ``engine``'s forest (see the module docstring).

    Parameters
    ----------
    engine : the engine; its tree must have no pending tokens. Its other trees are left alone.
    programs : the programs, admitted in this order.
    max_step_tokens : resume no more programs in an iteration once this many tokens are pending
        (default ``engine.prefill_chunk``; a program's own step may exceed it); the others go on
        in the next step, first. Running programs are resumed before newly admitted ones (whose
        prompts fill the budget).
    min_shared_prefix : the fewest common leading prompt tokens requests share as one prefix node
        (default: the pool's page size; 0 turns sharing off; a prefix is whole pages: its length is rounded
        down to a multiple of the page size).
    preempt : when every live program waits for pages, close the newest and queue it again
        (else raise PoolExhaustedError).
    prefix_cache : a :class:`~treedec.runtime.prefix_cache.PrefixCache` of ``engine``'s tree, kept across runs: a
        program that shares no prefix within the run is admitted on the longest prefix of its prompt cached
        there, and its computed prompt and ended outputs are offered to it (None: no cache).
    on_done : called as ``on_done(index, result)`` when a program returns.
    on_step : called as ``on_step(stats)`` after each engine step is launched (progress: ``stats.steps``, ...).
    pipeline : the lanes' draws (:mod:`treedec.runtime.lanes`: programs that yield a ``Decode``) read back while the
        next step runs (default: on a CUDA engine; off on the CPU, where nothing would overlap). Outputs are the same
        either way.
    seed : the draws of outputs whose request has no seed derive from it.

    Returns ``(results, stats)``: each program's result, in the order given, and the run's
    :class:`SchedulerStats`. A program that raises ends the run: the others are closed (their
    pages freed) and the error propagates; the results given to ``on_done`` before stay given.

    Raises
    ------
    ValueError : a program may run past the model's positions (:meth:`Program.positions`), before
        anything runs; it is named by :attr:`Program.name`, else as ``programs[i]``.
    PoolExhaustedError : a program cannot run alone in the pool (the run's other programs closed).
    """
    if not isinstance(engine, Engine):
        raise TypeError(f"engine must be an Engine, got {type(engine).__name__}")
    programs = list(programs)
    bad = next((p for p in programs if not isinstance(p, Program)), None)
    if bad is not None:
        raise TypeError(f"programs must be Program instances, got {type(bad).__name__}")
    budget = engine.prefill_chunk if max_step_tokens is None else max_step_tokens
    positive_int("max_step_tokens", budget)
    min_shared = engine.pool.page_size if min_shared_prefix is None else min_shared_prefix
    nonnegative_int("min_shared_prefix", min_shared, note=" (0: no sharing) or None")
    pending = engine.tree.num_pending
    if pending:
        raise ValueError(f"the engine's tree has {pending} pending token(s): run engine.step() first")
    for i, program in enumerate(programs):
        need = program.positions()
        if need is not None:
            check_positions(engine.model, need, program_name(program, i), before_run=True)
    if prefix_cache is not None and prefix_cache.tree is not engine.tree:
        raise ValueError("prefix_cache must be a PrefixCache of this engine's tree")
    if pipeline is not None and not isinstance(pipeline, bool):
        raise ValueError(f"pipeline must be a bool or None (on for a CUDA engine), got {pipeline!r}")
    return SchedulerLoop(engine, programs, budget, min_shared, preempt, on_done, on_step, cache=prefix_cache,
                         pipeline=pipeline, seed=seed).run()
