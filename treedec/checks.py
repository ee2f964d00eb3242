"""Checks of scalar arguments (counts, sizes, indices, real numbers) and how error messages show values.

One check per kind of value. Each returns the value it checked or raises ``error`` with the message
``"{name} must be {expected}{note}, got {actual}"``: the argument, what it must be (``note`` adds
alternatives or a reason, e.g. ``" or None"``), and what was given (:func:`show`). ``error`` is
``ValueError`` unless the caller owns a more precise type (``PlanError``, ``CheckpointError``,
``ControllerError``, ...; ``TypeError`` where only the type is checked).

- Ints are Python ints; bools are refused (``True`` is not a count). ``numpy=True`` also takes numpy
  integer scalars, returned as Python ints.
- Real numbers are Python ints or floats (numpy's ``float64`` is a float), not bools, finite; the
  checks return them as floats. :func:`float32_number` checks a range that float32 holds (a value used in a
  float32 tensor: a temperature, a penalty), so a number finite in Python never becomes 0 or inf there.

Cost: a valid Python int (or float) takes one ``type()`` test and a comparison; the rest runs only
to accept an int subclass, a numpy int or an int where a number is asked, or to word the error. The
call itself costs more than an inline test, so a caller that checks on every step may skip it for a
plain int in range: ``if type(v) is not int or v < 1: positive_int("v", v)``.
"""
from __future__ import annotations

import math
import reprlib

import numpy as np

_INF = math.inf
#: The largest finite float32 (a larger magnitude is inf in float32).
FLOAT32_MAX = 3.4028234663852886e38
#: The smallest positive float32 (a subnormal, 2**-149): a positive number below it is 0 in float32.
FLOAT32_TINY = 2.0 ** -149
_short = reprlib.Repr()
_short.maxlevel, _short.maxlist, _short.maxtuple, _short.maxstring, _short.maxother = 2, 6, 6, 40, 40


# ================================================================ ints


def positive_int(name: str, value, *, error: type[Exception] = ValueError, numpy: bool = False, note: str = "") -> int:
    """``value`` if it is an int >= 1, else ``error`` ``"{name} must be an int >= 1{note}, got {value}"``."""
    if type(value) is int and value >= 1:
        return value
    return _int(name, value, 1, None, error, numpy, note)


def nonnegative_int(name: str, value, *, error: type[Exception] = ValueError, numpy: bool = False,
                    note: str = "") -> int:
    """``value`` if it is an int >= 0, else ``error`` ``"{name} must be an int >= 0{note}, got {value}"``."""
    if type(value) is int and value >= 0:
        return value
    return _int(name, value, 0, None, error, numpy, note)


def int_in_range(name: str, value, low: int | None = None, high: int | None = None, *,
                 error: type[Exception] = ValueError, numpy: bool = False, note: str = "") -> int:
    """``value`` if it is an int in ``[low, high]`` (None: no bound on that side), else ``error``
    ``"{name} must be an int in [low, high]{note}, got {value}"`` (``an int >= low``, ``an int <= high``,
    ``an int`` for one bound or none)."""
    if type(value) is int and (low is None or low <= value) and (high is None or value <= high):
        return value
    return _int(name, value, low, high, error, numpy, note)


# ================================================================ real numbers


def finite_float(name: str, value, *, error: type[Exception] = ValueError, note: str = "") -> float:
    """``float(value)`` if it is a finite real number, else ``error`` ``"{name} must be a finite number, got ..."``."""
    if (type(value) is float and -_INF < value < _INF) or is_real(value):
        return float(value)
    raise error(f"{name} must be a finite number{note}, got {show(value)}")


def positive_float(name: str, value, *, error: type[Exception] = ValueError, note: str = "") -> float:
    """``float(value)`` if it is a finite real number > 0, else ``error`` ``"... a finite number > 0 ..."``."""
    if (type(value) is float and 0 < value < _INF) or (is_real(value) and value > 0):
        return float(value)
    raise error(f"{name} must be a finite number > 0{note}, got {show(value)}")


def nonnegative_float(name: str, value, *, error: type[Exception] = ValueError, note: str = "") -> float:
    """``float(value)`` if it is a finite real number >= 0, else ``error`` ``"... a finite number >= 0 ..."``."""
    if (type(value) is float and 0 <= value < _INF) or (is_real(value) and value >= 0):
        return float(value)
    raise error(f"{name} must be a finite number >= 0{note}, got {show(value)}")


def fraction(name: str, value, *, error: type[Exception] = ValueError, note: str = "") -> float:
    """``float(value)`` if it is a real number in (0, 1], else ``error`` ``"... must be a number in (0, 1] ..."``."""
    if (type(value) is float or is_real(value)) and 0 < value <= 1:   # NaN and inf fail the comparison
        return float(value)
    raise error(f"{name} must be a number in (0, 1]{note}, got {show(value)}")


def float32_number(name: str, value, low: float = -FLOAT32_MAX, high: float = FLOAT32_MAX, *,
                   error: type[Exception] = ValueError, note: str = "") -> float:
    """``float(value)`` if it is a real number in ``[low, high]``, else ``error`` ``"{name} must be a number in
    [low, high]{note}, got ..."``. The bounds default to float32's finite range (:data:`FLOAT32_MAX`); give
    ``low=FLOAT32_TINY`` for a number that must stay > 0 in float32."""
    if (type(value) is float or is_real(value)) and low <= value <= high:   # NaN fails the comparison
        return float(value)
    raise error(f"{name} must be a number in [{low:.8g}, {high:.8g}]{note}, got {show(value)}")


# ================================================================ predicates and messages


def is_int(value) -> bool:
    """Whether ``value`` is an integer scalar (a Python or numpy int, not a bool)."""
    return type(value) is int or (isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)))


def is_real(value) -> bool:
    """Whether ``value`` is a finite real number: a Python int or float (not a bool) that a float can hold."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int past the float range
        return False


def show_int(x: int) -> str:
    """``x`` for an error message; a huge one by its size (``str()`` refuses ints over 4300 digits)."""
    return str(x) if x.bit_length() <= 256 else f"{'-' if x < 0 else ''}<a {x.bit_length()}-bit int>"


def show(value) -> str:
    """``value``'s repr for an error message, cut short (long strings and containers end in ``...``, a huge
    int shows its size, a numpy int its type); safe on any value."""
    if type(value) is int:
        return show_int(value)
    try:
        return _short.repr(value)
    except Exception:  # a broken __repr__ must not hide the real error
        return "<unprintable>"


def describe(value) -> str:
    """``"<type> <short repr>"`` for error messages; safe on huge or deeply nested values."""
    return f"{type(value).__name__} {show_int(int(value)) if is_int(value) else show(value)}"


# ================================================================ private


def _int(name: str, value, low: int | None, high: int | None, error: type[Exception], numpy: bool, note: str) -> int:
    """The slow path of the int checks: an int subclass or a numpy int in range, else the error."""
    if (isinstance(value, int) and not isinstance(value, bool)) or (numpy and isinstance(value, np.integer)):
        if (low is None or low <= value) and (high is None or value <= high):
            return value if isinstance(value, int) else int(value)
    if low is None:
        expected = "an int" if high is None else f"an int <= {high}"
    else:
        expected = f"an int >= {low}" if high is None else f"an int in [{low}, {high}]"
    raise error(f"{name} must be {expected}{note}, got {show(value)}")
