"""JoinWait: when requests that may join a running chain join it."""

from specray.join_wait import JoinWait


def timed(wait: JoinWait, plain_ms: float, join_ms: float) -> JoinWait:
    wait.observe(plain_ms, joined=False)
    wait.observe(plain_ms + join_ms, joined=True)
    return wait


def test_joins_at_once_until_a_join_and_a_plain_cycle_are_timed():
    wait = JoinWait(join_max=4, max_steps=8)
    assert not wait.waits(1, 64)
    wait.observe(3.0, joined=False)
    assert not wait.waits(1, 64)
    wait.observe(8.0, joined=True)
    assert wait.join_ms == 5.0 and wait.waits(1, 64)


def test_rent_or_buy_waits_while_waiting_costs_less_than_a_join():
    # c=64: a waiting joiner costs 3/64 ms a cycle against a 5 ms join: it
    # waits its max_steps, or until join_max may join.
    wait = timed(JoinWait(join_max=4, max_steps=8), 3.0, 5.0)
    assert [wait.waits(1, 64) for _ in range(9)] == [True] * 8 + [False]
    assert [wait.waits(j, 64) for j in (1, 2, 3, 4)] == [True, True, True, False]
    # c=2: a waiting joiner costs half of a 3 ms cycle: after four cycles
    # (6 ms) it has cost more than the join would.
    wait = timed(JoinWait(join_max=4, max_steps=8), 3.0, 5.0)
    assert [wait.waits(1, 2) for _ in range(5)] == [True, True, True, True, False]
    # A cheap join is not waited for.
    wait = timed(JoinWait(join_max=4, max_steps=8), 3.0, 0.01)
    assert wait.waits(1, 64) and not wait.waits(1, 64)


def test_a_fixed_batch_waits_for_that_many_or_max_steps():
    wait = JoinWait(join_max=4, max_steps=3, batch=2)
    assert wait.waits(1, 8) and not wait.waits(2, 8)
    assert [wait.waits(1, 8) for _ in range(4)] == [True, True, True, False]
    assert not JoinWait(join_max=4, max_steps=8, batch=1).waits(1, 8)
    assert not JoinWait(join_max=4, max_steps=8, batch=9).waits(4, 8)  # join_max caps it
    assert not JoinWait(join_max=4, max_steps=8).waits(0, 8)


def test_join_cost_is_a_moving_mean_of_join_cycles_beyond_plain_ones():
    wait = JoinWait(join_max=4, max_steps=8)
    wait.observe(2.0, joined=False)
    wait.observe(2.0 + 4.0, joined=True)
    wait.observe(2.0 + 14.0, joined=True)
    assert abs(wait.join_ms - 5.0) < 1e-9
    wait.observe(1.0, joined=True)  # faster than a plain cycle: costs nothing, not less
    assert abs(wait.join_ms - 4.5) < 1e-9
