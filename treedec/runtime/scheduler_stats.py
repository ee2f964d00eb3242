"""The scheduler's counters (:mod:`treedec.runtime.scheduler`): :class:`SchedulerStats`."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

__all__ = ["SchedulerStats"]


@dataclass
class SchedulerStats:
    """Counters of one :func:`run_programs` run.

    Attributes
    ----------
    steps : engine steps run by the scheduler (shared-prefix prefills not included).
    prompt_steps : those of them that computed a prompt chunk (the others only decode).
    queries_per_step : tokens computed by each step.
    programs_per_step : programs with rows in each step.
    waits : times a program waited for pages (a :class:`Wait`) or a queued program for admission.
    preemptions : programs closed to free pages and run again.
    shared_prefix_tokens : prompt tokens not stored again because another request shares them
        (a prefix of ``t`` tokens read by ``m`` requests counts ``t * (m - 1)``).
    prompt_tokens : prompt tokens of the programs admitted (each admission counted: a preempted program's
        prompt again).
    cached_tokens : those of them read from the prefix cache across requests
        (:mod:`treedec.runtime.prefix_cache`) instead of computed; :attr:`cache_hit_rate` is their share.
    peak_pages : the most KV pages the run held at once.
    seconds : wall time.
    lane_draws : how the steps drew the lanes' tokens: ``"in the step's graph"`` (recorded with the forward,
        :meth:`~treedec.runtime.lanes.Lanes.step_tail`) or ``"eager: <reason>"`` (after the step), steps each.
    """

    steps: int = 0
    prompt_steps: int = 0
    queries_per_step: list[int] = field(default_factory=list)
    programs_per_step: list[int] = field(default_factory=list)
    waits: int = 0
    preemptions: int = 0
    shared_prefix_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    peak_pages: int = 0
    seconds: float = 0.0
    lane_draws: Counter = field(default_factory=Counter)

    @property
    def cache_hit_rate(self) -> float:
        """The share of admitted prompt tokens read from the prefix cache (0.0 before any prompt)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
