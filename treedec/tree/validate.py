"""Checks of the integer arguments of treedec.tree: token ids, parent indices, page ids, slots.

Accepted: lists, tuples, ranges or other iterables of ints (Python ints, numpy integer
scalars, 0-d integer arrays or tensors), 1-D numpy integer arrays, 1-D torch integer
tensors. Rejected, because a silent conversion would change them: strings and bytes,
floats (also float arrays and tensors), bools, None, nested sequences, mappings and sets,
and values outside ``[low, high]`` (which also keeps every value inside int64, the dtype
they are stored in). Errors name the argument and show the offending values: a
``TypeError`` for a value that is not an integer, a ``ValueError`` for a shape or range
error.

These checks run on every decode step, so the common inputs take a fast path: a list of
Python ints costs one C-level pass over the element types and the builtins ``min`` /
``max``, an integer array its dtype and a ``min`` / ``max`` (an int64 array only the bounds
tighter than int64's: node ids none); the element-by-element path only runs to accept mixed
integer types or to word an error.

Scalar arguments (counts, sizes, real numbers) are checked by :mod:`treedec.checks`, which also
words how a value shows in an error (:func:`~treedec.checks.describe`).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Set

import numpy as np
import torch

from treedec.checks import describe, is_int, show_int

INT64_MIN = int(np.iinfo(np.int64).min)
INT64_MAX = int(np.iinfo(np.int64).max)

_JUST_INT = frozenset([int])
_SMALL = 32  # arrays up to this length are range-checked as Python lists (faster than two numpy reductions)


def int_array(values, name: str, *, low: int = INT64_MIN, high: int = INT64_MAX) -> np.ndarray:
    """``values`` as a new ``[n]`` int64 array, after checking each is an integer in ``[low, high]``.

    Parameters
    ----------
    values : list / tuple / iterable of ints, ``[n]`` numpy integer array or torch integer tensor
    name : how the error messages call the argument, e.g. ``"tokens"``.
    low, high : inclusive bounds, within int64.

    Raises
    ------
    TypeError : ``values`` is not a 1-D collection of integers (a string, a float, a bool, None, a dict, ...).
    ValueError : an array with ``ndim != 1``, or a value outside ``[low, high]``.
    """
    return np.array(_checked(values, name, low, high), dtype=np.int64)  # a copy: never the caller's array


def int_list(values, name: str, *, low: int = INT64_MIN, high: int = INT64_MAX) -> list[int]:
    """Like :func:`int_array`, but a new list of Python ints (for values stored in lists, such as tokens)."""
    checked = _checked(values, name, low, high)
    return checked if type(checked) is list else checked.tolist()


def int_value(value, name: str, *, low: int = INT64_MIN, high: int = INT64_MAX) -> int:
    """``value`` as a Python int, after checking it is one integer (not a bool) in ``[low, high]``.

    Raises TypeError for a non-integer, ValueError for a value outside ``[low, high]``.
    """
    if type(value) is not int:
        value = _element(value, name)
    if not low <= value <= high:
        raise ValueError(f"{name} must be {_bounds(low, high)}, got {show_int(value)}")
    return value


def rows(values, name: str) -> list:
    """The items of a list-like argument whose items are checked one by one (token lists, (node, offset) pairs).

    Raises TypeError for a string, bytes, mapping, set, scalar or 0-d array.
    """
    if (isinstance(values, (str, bytes, bytearray, Mapping, Set)) or not isinstance(values, Iterable)
            or getattr(values, "ndim", 1) == 0):
        raise TypeError(f"{name} must be a sequence, got {describe(values)}")
    return list(values)


# ================================================================ private


def _checked(values, name: str, low: int, high: int) -> list[int] | np.ndarray:
    """The checked values: a new list of Python ints, or the caller's (or a host copy of a tensor's) integer array."""
    if type(values) is np.ndarray and values.dtype == np.int64 and values.ndim == 1:   # the step path's arrays
        tight_low, tight_high = low > INT64_MIN, high < INT64_MAX   # (int64 values are within int64's limits)
        n = len(values)
        if n and (tight_low or tight_high):
            if n <= _SMALL:
                small = values.tolist()
                lowest, highest = min(small) if tight_low else low, max(small) if tight_high else high
            else:
                lowest, highest = values.min() if tight_low else low, values.max() if tight_high else high
            if lowest < low or highest > high:
                raise _range_error(values.tolist(), name, low, high)
        return values
    if type(values) is list or type(values) is tuple:
        if _JUST_INT.issuperset(map(type, values)):  # the fast path: Python ints (not bools)
            if values and (min(values) < low or max(values) > high):
                raise _range_error(values, name, low, high)
            return list(values)
        return _checked(_elements(values, name), name, low, high)
    if isinstance(values, torch.Tensor):
        if not _is_int_dtype(values.dtype):
            raise TypeError(f"{name} must be integers, got a {values.dtype} tensor")
        values = values.detach().cpu().numpy()
    if isinstance(values, np.ndarray):
        if values.ndim != 1:
            raise ValueError(f"{name} must be 1-D, got an array of shape {values.shape}")
        if values.dtype == object:
            return _checked(values.tolist(), name, low, high)
        if values.dtype.kind not in "iu":
            raise TypeError(f"{name} must be integers, got a {values.dtype} array")
        if len(values) <= _SMALL:  # two numpy reductions cost more than the builtins on a short list
            small = values.tolist()
            out_of_range = small and (min(small) < low or max(small) > high)
        else:
            out_of_range = values.min() < low or values.max() > high
        if out_of_range:
            raise _range_error(values.tolist(), name, low, high)
        return values
    if isinstance(values, (str, bytes, bytearray, Mapping, Set)) or not isinstance(values, Iterable):
        raise TypeError(f"{name} must be a sequence of integers, got {describe(values)}")
    return _checked(list(values), name, low, high)  # a range, deque, generator, ...


def _elements(values, name: str) -> list[int]:
    """The elements of a list or tuple as Python ints; TypeError naming the first that is not an integer."""
    return [_element(x, f"{name}[{i}]") for i, x in enumerate(values)]


def _element(x, name: str) -> int:
    if is_int(x):
        return int(x)
    if isinstance(x, np.ndarray) and x.ndim == 0 and x.dtype.kind in "iu":
        return int(x)
    if isinstance(x, torch.Tensor) and x.ndim == 0 and _is_int_dtype(x.dtype):
        return int(x)
    raise TypeError(f"{name} must be an integer, got {describe(x)}")


def _is_int_dtype(dtype: torch.dtype) -> bool:
    return not (dtype == torch.bool or dtype.is_floating_point or dtype.is_complex)


def _range_error(values: list, name: str, low: int, high: int) -> ValueError:
    bad = [(i, int(x)) for i, x in enumerate(values) if not low <= x <= high]
    shown = ", ".join(f"{name}[{i}] = {show_int(x)}" for i, x in bad[:5]) + (", ..." if len(bad) > 5 else "")
    return ValueError(f"{name} must be {_bounds(low, high)}, got {shown}")


def _bounds(low: int, high: int) -> str:
    if high == INT64_MAX:
        return "int64 values" if low == INT64_MIN else f">= {low} and fit in int64"
    return f"in [{low}, {high}]"


def on_cycle(parents, start: int) -> bool:
    """Whether following ``parents`` (indices; -1 or out of range ends the walk) from ``start``
    comes back to ``start``: tells a cycle from a forward reference in an error message."""
    seen = set()
    i = start
    while 0 <= i < len(parents) and i not in seen:
        seen.add(i)
        i = int(parents[i])
    return i == start
