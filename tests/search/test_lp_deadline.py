"""A bound program stops at the search's end: one GLOP program of an interleaved node takes 3-8 s on K3 FP8 over
GB300, and the last one started before a 60-s limit ended the plan at 61-68 s. A program the deadline cuts bounds
nothing (0), never a value above the optimum."""

from __future__ import annotations

import math
import time

import numpy as np

from k3opt.search import lp_bound


def _program() -> tuple:
    """min z0 + 2 z1, z0 + z1 >= 3 (as -z0 - z1 <= -3), z0 <= 1: the optimum is 1 + 2 x 2 = 5."""
    cost = np.array([1.0, 2.0])
    a_ub, b_ub = np.array([[-1.0, -1.0]]), np.array([-3.0])
    a_eq, b_eq = np.zeros((0, 2)), np.zeros(0)
    upper = np.array([1.0, math.inf])
    return cost, a_ub, b_ub, a_eq, b_eq, upper


def test_a_program_before_its_deadline_gives_its_optimum():
    assert lp_bound._glop(*_program(), deadline=time.monotonic() + 30.0) == 5.0  # noqa: SLF001


def test_a_program_past_its_deadline_bounds_nothing():
    assert lp_bound._glop(*_program(), deadline=time.monotonic() - 1.0) == 0.0  # noqa: SLF001
    value, z = lp_bound._glop(*_program(), solution=True, deadline=time.monotonic() - 1.0)  # noqa: SLF001
    assert value == 0.0 and z is None
