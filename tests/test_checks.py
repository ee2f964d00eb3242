"""treedec.checks: the argument checks every layer uses, and how error messages show values."""
import enum
import math
import re

import numpy as np
import pytest

from treedec.checks import (describe, finite_float, fraction, int_in_range, is_int, is_real, nonnegative_float,
                            nonnegative_int, positive_float, positive_int, show)
from treedec.errors import PlanError


class Color(enum.IntEnum):
    RED = 3


def _short_id(value):
    """Pytest ids for huge ints (``str()`` refuses over 4300 digits); None: pytest's own id."""
    return "huge-int" if isinstance(value, int) and value.bit_length() > 1000 else None


@pytest.mark.parametrize("check,args,value", [
    (positive_int, (), 1), (positive_int, (), 2**40), (positive_int, (), Color.RED),
    (nonnegative_int, (), 0), (nonnegative_int, (), 7),
    (int_in_range, (1, 4), 1), (int_in_range, (1, 4), 4), (int_in_range, (None, 4), -9), (int_in_range, (-1,), -1),
    (int_in_range, (), -(2**70)),
])
def test_int_checks_return_what_they_accept(check, args, value):
    out = check("n", value, *args)
    assert out is value


@pytest.mark.parametrize("check,args,value,message", [
    (positive_int, (), 0, "n must be an int >= 1, got 0"),
    (positive_int, (), -3, "n must be an int >= 1, got -3"),
    (positive_int, (), True, "n must be an int >= 1, got True"),   # a bool is not a count
    (positive_int, (), 2.0, "n must be an int >= 1, got 2.0"),
    (positive_int, (), "2", "n must be an int >= 1, got '2'"),
    (positive_int, (), None, "n must be an int >= 1, got None"),
    (positive_int, (), np.int64(2), r"n must be an int >= 1, got np.int64\(2\)"),   # numpy ints only when asked
    (nonnegative_int, (), -1, "n must be an int >= 0, got -1"),
    (nonnegative_int, (), False, "n must be an int >= 0, got False"),
    (int_in_range, (1, 4), 5, r"n must be an int in \[1, 4\], got 5"),
    (int_in_range, (1, 4), 0, r"n must be an int in \[1, 4\], got 0"),
    (int_in_range, (None, 4), 5, "n must be an int <= 4, got 5"),
    (int_in_range, (2,), 1, "n must be an int >= 2, got 1"),
    (int_in_range, (), 1.5, "n must be an int, got 1.5"),
    (int_in_range, (), [1] * 50, r"n must be an int, got \[1, 1, 1, 1, 1, 1, \.\.\.\]"),   # cut short
    (positive_int, (), -(10**5000), "n must be an int >= 1, got -<a 16610-bit int>"),       # str() would refuse it
], ids=_short_id)
def test_int_checks_name_the_argument_the_expected_and_the_actual_value(check, args, value, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        check("n", value, *args)


def test_numpy_ints_when_asked_come_back_as_python_ints():
    for check, args in [(positive_int, ()), (nonnegative_int, ()), (int_in_range, (1, 4))]:
        out = check("n", np.int32(3), *args, numpy=True)
        assert out == 3 and type(out) is int
    with pytest.raises(ValueError, match=r"got np.int64\(0\)"):
        positive_int("n", np.int64(0), numpy=True)
    with pytest.raises(ValueError, match="got np.True_"):
        positive_int("n", np.bool_(True), numpy=True)


@pytest.mark.parametrize("error", [PlanError, TypeError, ValueError])
def test_the_caller_picks_the_exception_type(error):
    for check, value in [(positive_int, 0), (nonnegative_int, -1), (int_in_range, "x"), (finite_float, math.nan),
                         (positive_float, 0.0), (nonnegative_float, -1.0), (fraction, 2.0)]:
        with pytest.raises(error) as info:
            check("x", value, error=error)
        assert type(info.value) is error


def test_a_note_adds_alternatives_or_a_reason():
    with pytest.raises(ValueError, match=r"^s must be an int >= 1, 'auto' or None, got 0$"):
        positive_int("s", 0, note=", 'auto' or None")
    with pytest.raises(ValueError, match=r"^t must be a finite number > 0 \(0 is greedy\), got 0$"):
        positive_float("t", 0, note=" (0 is greedy)")


@pytest.mark.parametrize("check,good,bad,expected", [
    (finite_float, [-1e300, 0, 2.5, np.float64(1.5)], [math.nan, math.inf, -math.inf, True, "1", None, 10**400],
     "a finite number"),
    (positive_float, [1e-300, 3, 0.5], [0, 0.0, -1.0, math.inf, math.nan, True, "0.1"], "a finite number > 0"),
    (nonnegative_float, [0, 0.0, 7.5], [-0.1, math.inf, math.nan, False, [1.0]], "a finite number >= 0"),
    (fraction, [1, 1.0, 0.25, 1e-9], [0, 0.0, 1.5, -0.5, math.nan, True, "0.5"], r"a number in \(0, 1\]"),
])
def test_real_number_checks(check, good, bad, expected):
    for value in good:
        out = check("x", value)
        assert out == value and type(out) is float
    for value in bad:
        with pytest.raises(ValueError, match=f"^x must be {expected}, got {re.escape(show(value))}$"):
            check("x", value)


def test_predicates():
    assert is_int(3) and is_int(np.int8(3)) and is_int(Color.RED)
    assert not any(is_int(v) for v in (True, np.bool_(False), 3.0, "3", None, np.float32(3)))
    assert is_real(3) and is_real(-2.5) and is_real(np.float64(1.0)) and is_real(2**1000)
    assert not any(is_real(v) for v in (True, math.nan, math.inf, 10**400, "1", None, 1j))


class _Broken:
    def __repr__(self):
        raise RuntimeError("no repr")


@pytest.mark.parametrize("value,shown,described", [
    (0, "0", "int 0"), (True, "True", "bool True"), (2.5, "2.5", "float 2.5"), ("ab", "'ab'", "str 'ab'"),
    (None, "None", "NoneType None"), (np.int64(7), "np.int64(7)", "int64 7"), (10**400, "<a 1329-bit int>",
                                                                                  "int <a 1329-bit int>"),
], ids=_short_id)
def test_show_and_describe(value, shown, described):
    assert show(value) == shown
    assert describe(value) == described


def test_a_broken_repr_does_not_hide_the_error():
    assert show(_Broken()).startswith("<_Broken instance at 0x")
    assert describe(_Broken()).startswith("_Broken <_Broken instance at 0x")

