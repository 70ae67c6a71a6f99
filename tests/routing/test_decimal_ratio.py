"""The capacity's exact decimal reading of the capacity factor, in integer arithmetic
(traceable by torch.compile), against fractions.Fraction."""

from __future__ import annotations

import math
from fractions import Fraction

from hypothesis import given
from hypothesis import strategies as st

from moelab.routing.balancing import capacity, decimal_ratio


@given(st.floats(min_value=0, max_value=1e300, allow_nan=False, allow_infinity=False))
def test_decimal_ratio_is_the_decimal_value_of_repr(x: float) -> None:
    num, den = decimal_ratio(x)
    assert Fraction(num, den) == Fraction(repr(x))


@given(
    st.integers(0, 10**6),
    st.integers(1, 16),
    st.integers(1, 256),
    st.floats(min_value=1e-3, max_value=100, allow_nan=False),
)
def test_capacity_is_the_exact_ceiling(t: int, k: int, e: int, cf: float) -> None:
    assert capacity(t, k, e, cf) == math.ceil(Fraction(repr(cf)) * t * k / e)
