"""labkit.checks: the one type-and-bound check every layer's arguments go through."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from labkit.checks import flag, number, whole_number


@pytest.mark.parametrize("value, minimum, expected", [(1, 1, 1), (np.int64(7), 0, 7), (0, 0, 0)])
def test_a_whole_number_in_bounds_comes_back_as_an_int(value, minimum, expected):
    result = whole_number("n", value, minimum)
    assert result == expected and type(result) is int


@pytest.mark.parametrize("value, minimum, or_none, message", [
    (0, 1, False, "n = 0: must be a whole number >= 1"),
    (True, 0, False, "n = True: must be a whole number >= 0"),
    (2.0, 1, False, "n = 2.0: must be a whole number >= 1"),
    ("3", 1, False, "n = '3': must be a whole number >= 1"),
    (None, 1, False, "n = None: must be a whole number >= 1"),
    (-1, 0, True, "n = -1: must be a whole number >= 0, or None"),
])
def test_anything_else_is_an_error_that_names_the_argument_and_the_value(value, minimum, or_none, message):
    with pytest.raises(ValueError) as error:
        whole_number("n", value, minimum, or_none=or_none)
    assert str(error.value) == message


def test_none_passes_only_when_asked():
    assert whole_number("n", None, or_none=True) is None and number("x", None, or_none=True) is None


@pytest.mark.parametrize("value, kwargs, message", [
    (0, {}, "x = 0: must be a number > 0"),
    (-0.5, {"or_equal": True}, "x = -0.5: must be a number >= 0"),
    (math.nan, {}, "x = nan: must be a number > 0"),
    (math.inf, {}, "x = inf: must be a number > 0"),
    (False, {"or_equal": True}, "x = False: must be a number >= 0"),
    ("1", {}, "x = '1': must be a number > 0"),
    (0.0, {"unit": "seconds", "or_none": True}, "x = 0.0: must be a number of seconds > 0, or None"),
    (1, {"minimum": 1}, "x = 1: must be a number > 1"),
])
def test_a_number_out_of_bounds_or_not_finite_is_an_error(value, kwargs, message):
    with pytest.raises(ValueError) as error:
        number("x", value, **kwargs)
    assert str(error.value) == message


@given(st.floats(allow_nan=False, allow_infinity=False), st.floats(-10, 10), st.booleans())
def test_a_number_passes_exactly_when_it_meets_its_bound(value, minimum, or_equal):
    meets = value > minimum or (or_equal and value == minimum)
    try:
        assert number("x", value, minimum, or_equal=or_equal) == value and meets
    except ValueError:
        assert not meets


@pytest.mark.parametrize("value", [True, False])
def test_a_flag_is_true_or_false(value):
    assert flag("f", value) is value


@pytest.mark.parametrize("value", [0, 1, "yes", None])
def test_a_flag_is_never_a_number_a_word_or_none(value):
    with pytest.raises(ValueError) as error:
        flag("f", value)
    assert str(error.value) == f"f = {value!r}: must be True or False"
