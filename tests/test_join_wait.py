"""JoinWait: when requests that may join a running chain join it."""

import math

from specray.join_wait import ALPHA_ARRIVALS, JoinWait


def timed(plain_ms: float, join_ms: float, arrivals: float, **kw) -> JoinWait:
    wait = JoinWait(join_max=4, max_steps=8, **kw)
    wait.observe(plain_ms, joined=0)
    wait.observe(plain_ms + join_ms, joined=1)
    wait.arrivals = arrivals
    return wait


def test_joins_at_once_until_cycles_and_arrivals_are_measured():
    wait = JoinWait(join_max=4, max_steps=8)
    assert wait.want(64) == 1 and not wait.waits(1, 64)
    wait.observe(3.0, joined=0)
    assert wait.want(64) == 1
    wait.observe(8.0, joined=2)
    assert wait.join_ms == 5.0 and math.isclose(wait.arrivals, 2 * ALPHA_ARRIVALS)
    assert wait.want(64) > 1 and wait.waits(1, 64)


def test_the_batch_is_the_one_that_costs_least():
    # k = sqrt(2 J lambda / w), w = plain / rows: heavy load (c=64, a
    # request joining every ~3 cycles) waits for join_max; c=8 for two;
    # light load (c=2, one every ~20 cycles) joins at once.
    assert timed(3.3, 5.4, 0.35).want(64) == 4
    assert timed(1.43, 5.9, 0.08).want(8) == 2
    assert timed(1.3, 5.0, 0.05).want(2) == 1
    assert timed(3.3, 0.01, 0.35).want(64) == 1  # a join that costs nothing is not waited for
    wait = timed(1.43, 5.9, 0.08)
    assert [wait.waits(1, 8), wait.waits(1, 8), wait.waits(2, 8)] == [True, True, False]
    assert wait.waited == 0  # reset for the next joiners


def test_a_joiner_waits_max_steps_at_most():
    wait = timed(3.3, 5.4, 0.35)
    assert [wait.waits(1, 64) for _ in range(9)] == [True] * 8 + [False]
    fixed = JoinWait(join_max=4, max_steps=3, batch=2)
    assert fixed.waits(1, 8) and not fixed.waits(2, 8)
    assert [fixed.waits(1, 8) for _ in range(4)] == [True, True, True, False]


def test_a_fixed_batch_ignores_the_cost_model():
    assert JoinWait(join_max=4, max_steps=8, batch=1).want(64) == 1
    assert JoinWait(join_max=4, max_steps=8, batch=9).want(8) == 4  # join_max caps it
    assert timed(3.3, 5.4, 0.35, batch=1).want(64) == 1
    assert not JoinWait(join_max=4, max_steps=8).waits(0, 8)


def test_join_cost_is_a_moving_mean_of_join_cycles_beyond_plain_ones():
    wait = JoinWait(join_max=4, max_steps=8)
    wait.observe(2.0, joined=0)
    wait.observe(2.0 + 4.0, joined=1)
    wait.observe(2.0 + 14.0, joined=3)
    assert abs(wait.join_ms - 5.0) < 1e-9
    wait.observe(1.0, joined=1)  # faster than a plain cycle: costs nothing, not less
    assert abs(wait.join_ms - 4.5) < 1e-9
