"""Which planner implementation plans the steps: the compiled one or the numpy reference.

``make_plan``, the cuda backend's ``schedule_units``, a static plan's write and a step's dynamic spans (their
places and mask patch, :mod:`treedec.attention.dynamic_span`) run compiled C++ (``treedec/kernels/planner``,
built on first use by :mod:`treedec.kernels.planner_build`) that gives the numpy code's results bit for
bit, several times faster. ``TREEDEC_PLANNER`` chooses:

- ``auto`` (default): compiled where it can be built (a C++ compiler, ninja and the Python headers),
  else numpy, with the reason;
- ``compiled``: compiled, or BackendUnavailableError saying why not;
- ``numpy``: the numpy reference.

A build that fails where it could run raises BackendUnavailableError at the first plan (and every
later one), never a silent switch to numpy. The choice is logged once at INFO with its reason, and
:func:`planner_impl` reports it.
"""
from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, field

from treedec.errors import BackendUnavailableError
from treedec.kernels import planner_build

logger = logging.getLogger("treedec")

PLANNER_ENV = "TREEDEC_PLANNER"
PLANNER_IMPLS = ("auto", "compiled", "numpy")
# os.environ's own mapping (what its setting and deleting write) and the variable's key in it: one dict lookup where
# os.environ.get is five Python calls, and planner_impl runs four or five times a step
_ENVIRON, _ENV_KEY = os.environ._data, os.environ.encodekey(PLANNER_ENV)


@dataclass(frozen=True)
class PlannerImpl:
    """The planner implementation in use: ``name`` ("compiled" or "numpy"), ``reason`` (why), and the
    compiled ``module`` (None for numpy)."""

    name: str
    reason: str
    module: object = field(default=None, repr=False, compare=False)


def planner_impl() -> PlannerImpl:
    """The implementation ``make_plan`` and ``schedule_units`` run now (``TREEDEC_PLANNER``, see the
    module docstring); builds the compiled planner on first use.

    Raises ValueError for an unknown ``TREEDEC_PLANNER`` and BackendUnavailableError when the compiled
    planner is asked for (or could be built) but its build failed.
    """
    raw = _ENVIRON.get(_ENV_KEY)   # called a few times a step: the raw value is the cache key
    choice = _resolve(None if raw is None else os.environ.decodevalue(raw))
    if isinstance(choice, Exception):
        raise type(choice)(*choice.args)
    return choice


@functools.lru_cache(maxsize=None)
def _resolve(raw: str | None) -> PlannerImpl | Exception:
    """The choice for one value of the variable, made (and logged) once; a failure is kept and raised at every
    call."""
    setting = (raw or "auto").strip().lower() or "auto"
    if setting not in PLANNER_IMPLS:
        return ValueError(f"{PLANNER_ENV} must be one of {PLANNER_IMPLS}, got {setting!r}")
    if setting == "numpy":
        choice = PlannerImpl("numpy", f"{PLANNER_ENV}=numpy")
    else:
        problem = planner_build.build_problem()
        if problem is not None and setting == "compiled":
            return BackendUnavailableError(f"{PLANNER_ENV}=compiled but the compiled planner cannot be built here: "
                                           f"{problem}")
        if problem is not None:
            choice = PlannerImpl("numpy", f"auto: numpy, the compiled planner cannot be built here ({problem})")
        else:
            try:
                module = planner_build.load_planner()
            except BackendUnavailableError as err:
                return BackendUnavailableError(f"{err}; set {PLANNER_ENV}=numpy to plan with the numpy reference")
            choice = PlannerImpl("compiled", f"{'auto' if setting == 'auto' else 'requested'}: compiled C++ planner "
                                             f"({planner_build.build_dir()})", module)
    logger.info("treedec planner: %s (%s)", choice.name, choice.reason)
    return choice
