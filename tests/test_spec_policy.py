"""Load-adaptive speculation (spec_policy.py): the choice follows measured
costs and acceptance, and whatever it chooses the output stays the
target's: greedy tokens equal autoregressive decoding, sampled steps of
both kinds mixed keep the target's distribution."""

import itertools

import pytest

from factories import make_models
from joint_sampling import pooled_chi2_p, sampled_triples
from specray import LLM, SamplingParams
from specray.async_decode import AsyncSteps, InflightStep
from specray.spec_policy import (AR_PROBE_EVERY, CONFIRM, COST_SAMPLES, MAX_PROBE_EVERY, PROBE_BUDGET, PROBE_EVERY, PROBE_STEPS,
                                 ROW_ALPHA, STALE_AFTER, SpecPolicy, probe_every)

def rows_of(tokens: float, n: int = 50) -> list[tuple[int, int]]:
    """``n`` rows (drafts accepted, 15 verified) that emit ``tokens`` a row on average."""
    total = round(n * (tokens - 1))
    return [(total // n + (i < total % n), 15) for i in range(n)]


def timed_choices(p: SpecPolicy, n: int, kind: str, steps: int, seconds: dict[int, float]) -> list[int]:
    """``steps`` choices, each step timed as the engine times it: only
    between two steps of its kind (``test_a_step_after_another_kind_is_not_timed``)."""
    picks = []
    for _ in range(steps):
        picks.append(p.choose(n, kind))
        if len(picks) >= 3 and picks[-3] == picks[-2] == picks[-1]:
            p.observe(n, picks[-2], seconds[picks[-2]], kind)
    return picks


PROMPTS = [[5, 17, 33, 2, 9, 10, 42], [3, 4], list(range(2, 40)), [7] * 15, [11, 12, 13]]
MAX_TOKENS = [30, 24, 17, 33, 20]


def test_policy_measures_both_kinds_then_picks_the_faster():
    p = SpecPolicy(block_size=16)
    assert p.choose(8, "greedy")  # speculative cost unknown: measure it
    p.observe(8, 15, 0.004, "greedy", rows_of(1.5))
    assert not p.choose(8, "greedy")  # autoregressive cost unknown
    p.observe(8, 0, 0.002, "greedy")
    # 1.5 tokens in 4 ms against 1 token in 2 ms: autoregressive
    assert not p.choose(8, "greedy")
    # cheap verify, high acceptance: speculate
    p.observe(1, 15, 0.0011, "greedy", rows_of(3.1))
    p.observe(1, 0, 0.001, "greedy")
    assert p.choose(1, "greedy")
    # acceptance is kept per sampling kind: a sampled batch at batch 1 with
    # low acceptance steps autoregressively
    p.observe(1, 15, 0.0011, "sampled", rows_of(1.02))
    assert not p.choose(1, "sampled")


def test_one_slow_first_measurement_does_not_keep_speculation_off():
    p = SpecPolicy(block_size=16)
    p.observe(2, 15, 0.0116, "greedy", rows_of(2.9))  # the first speculative step ran cold: 11.6 ms
    p.observe(2, 0, 0.00094, "greedy")
    assert not p.choose(2, "greedy")
    p.observe(2, 15, 0.0016, "greedy", rows_of(2.9))  # the next probe finds what such a step costs
    assert p.cost[(2, 15, "greedy")] == 0.0016
    assert p.choose(2, "greedy")  # 2.9 tokens in 1.6 ms beat 1 in 0.94 ms
    p.observe(2, 15, 0.0024, "greedy", rows_of(2.9))  # the cost is the lower median of the last steps
    assert p.cost[(2, 15, "greedy")] == 0.0024
    # what the medians were made of: every timed step, unweighted
    assert p.snapshot()["measured"] == {"greedy": {"2a": [1, 0.00094], "2s": [3, pytest.approx(0.0116 + 0.0016 + 0.0024)]}}


def test_a_slow_probe_does_not_move_a_kinds_cost_and_a_changed_cost_is_followed():
    """A losing kind is timed only by its probes: a cycle from the wall
    time's tail (a host busy with other work) must not price it out for
    hundreds of steps, as a moving mean did; a cost that really changed
    takes over once it is the median of the last COST_SAMPLES."""
    p = SpecPolicy(block_size=16)
    for _ in range(COST_SAMPLES):
        p.observe(64, 0, 0.0015, "sampled")
    p.observe(64, 0, 0.0060, "sampled")  # one slow cycle: 4x
    assert p.cost[(64, 0, "sampled")] == 0.0015
    p.observe(64, 0, 0.0060, "sampled")
    assert p.cost[(64, 0, "sampled")] == 0.0015
    p.observe(64, 0, 0.0030, "sampled")  # the step now costs 3 ms: 3 of the last 5 at 3 ms or more
    assert p.cost[(64, 0, "sampled")] == 0.0030
    # the choice follows: 1.7 tokens a row in 2 ms against 1 in 1.5 ms speculates, against 1 in 3 ms too
    p.observe(64, 15, 0.0020, "sampled", rows_of(1.7))
    for _ in range(COST_SAMPLES):
        p.observe(64, 0, 0.0015, "sampled")
    assert p.choose(64, "sampled") == 15


def test_policy_probes_autoregressive_steps_while_speculating():
    p = SpecPolicy(block_size=16)
    p.observe(16, 15, 0.0027, "greedy", rows_of(2.9))
    p.observe(16, 0, 0.0023, "greedy")  # measured cold: an autoregressive step costs less
    # a cost from one timed step is confirmed at the base cadence, not the budget's
    every = probe_every(AR_PROBE_EVERY, 2.9 * 0.0023 / 0.0027)  # speculation's advantage: 2.47x
    assert every > AR_PROBE_EVERY
    picks = [p.choose(16, "greedy") for _ in range(AR_PROBE_EVERY + PROBE_STEPS)]
    assert picks == [15] * AR_PROBE_EVERY + [0] * PROBE_STEPS  # a probe is steps in a row
    # the probe finds the cheaper autoregressive step, and the policy follows it
    p.observe(16, 0, 0.0009, "greedy")
    assert not p.choose(16, "greedy")


def test_a_confirmed_cost_is_probed_at_the_budgets_spacing():
    p = SpecPolicy(block_size=16)
    p.observe(16, 15, 0.0027, "greedy", rows_of(2.9))
    for _ in range(CONFIRM):
        p.observe(16, 0, 0.0023, "greedy")
    every = probe_every(AR_PROBE_EVERY, 2.9 * 0.0023 / 0.0027)
    picks = [p.choose(16, "greedy") for _ in range(2 * (every + PROBE_STEPS))]
    assert picks == ([15] * every + [0] * PROBE_STEPS) * 2


def test_a_cold_first_cost_of_the_losing_kind_is_confirmed_soon():
    """A kind's first timed step runs where its batch size first came (on
    the H100 the AR cost at padded 64 stood at 2.5-3.1 ms where AR cycles
    ran at 1.3-1.6: the budget probes such a loser every ~400 steps):
    until CONFIRM steps are timed it is probed at the base cadence."""
    p = SpecPolicy(block_size=16)
    p.observe(64, 15, 0.0025, "sampled", rows_of(1.75))
    p.observe(64, 0, 0.0030, "sampled")  # cold: 1.75 tokens in 2.5 ms beat 1 in 3 ms by 2.1x
    picks = [p.choose(64, "sampled") for _ in range(AR_PROBE_EVERY + PROBE_STEPS)]
    assert picks[AR_PROBE_EVERY:] == [0] * PROBE_STEPS and 0 not in picks[:AR_PROBE_EVERY]
    p.observe(64, 0, 0.0013, "sampled")  # the probe's timed step: the lower median of two
    assert p.cost[(64, 0, "sampled")] == 0.0013
    assert not p.choose(64, "sampled")  # 1 token in 1.3 ms beats 1.75 in 2.5


def test_a_losing_kinds_stale_cost_gives_way_to_its_next_cheaper_probe():
    """Readings from a churning stretch priced a losing kind too high (on
    the H100 at c=32 T=1 autoregressive steps at 2.14 ms where they ran at
    1.15-1.2): the median of its last steps held that price until three
    probes, up to MAX_PROBE_EVERY steps apart, had timed it again. A
    cheaper probe is taken at once, since a kind priced too low is then
    chosen and timed every step; a dearer run still has to make the median."""
    p = SpecPolicy(block_size=8)
    p.observe(32, 7, 0.0023, "sampled", [(1, 7)] * 40 + [(0, 7)] * 10)  # 1.8 tokens a row
    for _ in range(COST_SAMPLES):
        p.observe(32, 0, 0.00214, "sampled")
    picks = [p.choose(32, "sampled") for _ in range(AR_PROBE_EVERY)]
    assert set(picks) == {7}  # 1.8 tokens in 2.3 ms beat 1 in 2.14
    p.observe(32, 0, 0.0012, "sampled")  # a probe's timed step, a run of its own
    assert p.cost[(32, 0, "sampled")] == 0.0012
    assert p.choose(32, "sampled") == 0  # 1 token in 1.2 ms beats 1.8 in 2.3
    # one slow step of the run does not bring the old price back; a run of them moves the cost
    p.observe(32, 0, 0.0040, "sampled")
    assert p.cost[(32, 0, "sampled")] == 0.0012
    for _ in range(2):
        p.choose(32, "sampled")
        p.observe(32, 0, 0.0040, "sampled")
    assert p.cost[(32, 0, "sampled")] == 0.0040


def test_a_noisy_sampled_row_does_not_turn_speculation_off_at_batch_1():
    """A sampled row emits 1 token half the time and 2-4 otherwise (mean 2);
    2 tokens in 1.43 ms beat 1 in 1.02 ms, so nearly every step speculates
    (a mean over single steps dropped below break-even after a run of 1s)."""
    import random

    rng = random.Random(0)
    p = SpecPolicy(block_size=16)
    picks = []
    for _ in range(3000):
        spec = p.choose(1, "sampled")
        picks.append(spec)
        if spec:
            p.observe(1, 15, 0.00143, "sampled", [((1 if rng.random() < 0.5 else rng.choice([2, 3, 4])) - 1, 15)])
        else:
            p.observe(1, 0, 0.00102, "sampled")
    # the autoregressive probes: PROBE_STEPS in probe_every(AR_PROBE_EVERY, ~1.4) + PROBE_STEPS
    assert sum(picks[100:]) / len(picks[100:]) > 0.97


def _settled_then_dipped(n: int, spec_s: float, ar_s: float) -> SpecPolicy:
    """A policy at batch ``n`` T=1 that settled at 1.8 tokens a row
    (600 rows), then saw 100 rows of 1.2."""
    p = SpecPolicy(block_size=16)
    for _ in range(CONFIRM):
        p.observe(n, 0, ar_s, "sampled")
    for _ in range(120):
        p.observe(n, 15, spec_s, "sampled", rows_of(1.8, 5))
    for _ in range(20):
        p.observe(n, 15, spec_s, "sampled", rows_of(1.2, 5))
    return p


def _wakes_within(p: SpecPolicy, n: int, steps: int, rest: bool) -> int | None:
    """The step of a rest at which the policy chooses speculation by its rate."""
    for step in range(1, steps + 1):
        if rest:
            p.resting("sampled", n)
        if p.choose(n, "sampled") and not p.exploring:
            return step
    return None


def test_a_rest_brings_the_recent_acceptance_back_to_the_settled_one():
    """Speculation pays at batch 1 at the settled 1.8 tokens a row (1.8 in
    1.42 ms against 1 in 1 ms); a stretch of low acceptance turned it off.
    While the drafter rests no row reaches the policy: the recent mean
    returns to the settled one and the policy speculates again (left where
    the stretch put it, the drafter slept for good: H100, c=1 T=1, 1.00x)."""
    p = _settled_then_dipped(1, 0.00142, 0.001)
    assert p.tokens("sampled", 15) < 1.03 * 1.42  # below break-even: autoregressive steps
    assert p.settled[("sampled", "chain")][0] == pytest.approx(0.8 - 0.6 * (1 - (1 - ROW_ALPHA / 8) ** 100), abs=0.01)
    assert _wakes_within(_settled_then_dipped(1, 0.00142, 0.001), 1, 400, rest=False) is None
    settled = list(p.settled[("sampled", "chain")])
    step = _wakes_within(p, 1, 400, rest=True)
    assert step is not None and 10 < step < 60
    assert p.settled[("sampled", "chain")] == settled  # only fed rows move it
    # greedy acceptance is its own: a sampled rest leaves it be
    p.observe(1, 15, 0.00142, "greedy", rows_of(3.0, 5))
    greedy = list(p.survival[("greedy", "chain")])
    p.resting("sampled", 1)
    assert p.survival[("greedy", "chain")] == greedy


def test_a_cold_first_row_does_not_keep_the_drafter_asleep():
    """At batch 1 T=1 the first sampled row accepted nothing, the next 200
    accepted 0.9 drafts each (1.9 tokens in 1.41 ms against 1 in 1 ms:
    speculation pays), then 60 rows of 1.1 put the drafter to rest. The
    settled mean is the mean of those rows, not the first row's 0 moved
    0.25 % a row (0.36: below break-even, so the rest lasted: H100, c=1 T=1,
    5 982 of 6 090 steps autoregressive at 0.995x), and the rest ends."""
    p = SpecPolicy(block_size=16)
    for _ in range(CONFIRM):
        p.observe(1, 0, 0.001, "sampled")
    p.observe(1, 15, 0.00141, "sampled", [(0, 15)])
    for i in range(200):
        p.observe(1, 15, 0.00141, "sampled", [(0 if i % 10 == 0 else 1, 15)])
    for i in range(60):
        p.observe(1, 15, 0.00141, "sampled", [(1 if i % 10 == 0 else 0, 15)])
    settled = p.settled[("sampled", "chain")][0]
    assert settled == pytest.approx((180 + 6) / 261, abs=1e-9)  # every row alike
    assert p.tokens("sampled", 15) < 1.03 * 1.41  # the dip: autoregressive steps, the drafter rests
    step = _wakes_within(p, 1, 400, rest=True)
    assert step is not None and step < 100


def test_a_rest_under_load_stays_a_rest():
    """At batch 64 a speculative step costs 3.3 ms to the autoregressive
    1.6: 1.8 tokens a row lose (0.55 against 0.63 a ms) whatever the
    rest does to the recent mean."""
    p = _settled_then_dipped(64, 0.0033, 0.0016)
    assert _wakes_within(p, 64, 3000, rest=True) is None


def test_policy_probes_while_autoregressive():
    p = SpecPolicy(block_size=16)
    for _ in range(CONFIRM):  # a confirmed cost (one from fewer steps is probed at the base cadence)
        p.observe(4, 15, 0.01, "greedy", rows_of(1.1))
    p.observe(4, 0, 0.001, "greedy")
    every = probe_every(PROBE_EVERY, 1 / (1.1 * 0.001 / 0.01))  # speculation 9x slower: rare probes
    assert every == MAX_PROBE_EVERY
    # a probe's middle step is timed (the engine's rule)
    picks = timed_choices(p, 4, "greedy", 3 * (every + PROBE_STEPS), {15: 0.01, 0: 0.001})
    assert picks == ([0] * every + [15] * PROBE_STEPS) * 3
    # probes that find cheap steps and high acceptance turn speculation on
    for _ in range(20):
        p.observe(4, 15, 0.001, "greedy", rows_of(8.0))
    p.since[(4, 15)] = 0
    assert p.choose(4, "greedy")


def test_a_losing_kind_whose_probes_were_not_timed_is_probed_at_the_base_cadence():
    """A probe tells nothing when a join or a switch leaves its steps
    untimed: a cost not timed for STALE_AFTER steps is probed as often as
    an unconfirmed one until a step of it is timed, then at the budget's
    spacing again."""
    p = SpecPolicy(block_size=16)
    for _ in range(CONFIRM):
        p.observe(64, 15, 0.0025, "sampled", rows_of(1.75))
        p.observe(64, 0, 0.0030, "sampled")  # stale: 1.75 tokens in 2.5 ms beat 1 in 3 ms
    every = probe_every(AR_PROBE_EVERY, p.tokens("sampled", 15) * 0.0030 / 0.0025)
    assert every > 4 * AR_PROBE_EVERY
    picks = [p.choose(64, "sampled") for _ in range(STALE_AFTER + every)]  # no probe is timed
    ar_at = [i for i, d in enumerate(picks) if d == 0]
    starts = [i for i in ar_at if i - 1 not in ar_at]
    assert starts[0] == every and starts[1] - starts[0] == every + PROBE_STEPS  # the budget's spacing ...
    late = [b - a for a, b in zip(starts, starts[1:]) if a > STALE_AFTER + PROBE_STEPS]
    assert late and set(late) == {AR_PROBE_EVERY + PROBE_STEPS}  # ... until no step was timed for STALE_AFTER
    p.observe(64, 0, 0.0013, "sampled")  # a probe is timed: cheaper, so the AR steps win
    assert p.choose(64, "sampled") == 0


def test_a_batch_size_the_batch_passes_through_is_not_probed_on_arrival():
    """Steps since a kind was last chosen count per batch size: a drain
    from 64 rows passes through 48 for a few steps, and a whole block's
    probe there (3 steps of 5.5 ms on the H100 at c=64 T=1, for the steps
    the losing kinds had not run at 64, its cost there unconfirmed) cost
    more than those steps gained."""
    p = SpecPolicy(block_size=16, shorter=(1,))
    for n, ms in ((64, {15: 6.5, 1: 1.8, 0: 1.35}), (48, {15: 5.5, 1: 1.7, 0: 1.3})):
        for d, t in ms.items():
            # at 48 the whole block was timed once: unconfirmed, probed at the base cadence there
            for _ in range(1 if (n, d) == (48, 15) else CONFIRM):
                p.observe(n, d, t / 1000, "sampled", [(1, d)] * 5 + [(0, d)] * 5 if d else None)
    picks = timed_choices(p, 64, "sampled", 600, {15: 0.0065, 1: 0.0018, 0: 0.00135})
    assert picks.count(1) > 0.95 * len(picks) and 15 in picks  # the whole block is probed at 64
    assert [p.choose(48, "sampled") for _ in range(8)] == [1] * 8


def test_each_chain_length_keeps_its_acceptance():
    """A chain's drafts come from a block of its length (attending both
    ways): a 2-row block's first draft is accepted less than a 4-row
    block's. Pooled, the rows of the chain being chosen priced the other's
    first draft, and the policy kept the shorter chain where the longer
    emitted more a ms (H100, c=64 T=1: 1.45 tokens a row in 1.81 ms against
    1.79 in 2.11)."""
    p = SpecPolicy(block_size=16, shorter=(3, 1))
    for d, ms in ((15, 6.0), (3, 2.0), (1, 1.5), (0, 1.2)):
        for _ in range(CONFIRM):
            p.observe(64, d, ms / 1000, "sampled")
    p.observe(64, 15, 0.006, "sampled", [(2, 15)] * 60 + [(0, 15)] * 40)  # the whole block: 2.2 tokens
    p.observe(64, 3, 0.002, "sampled", [(3, 3)] * 10 + [(2, 3)] * 20 + [(1, 3)] * 30 + [(0, 3)] * 40)  # 2.0 tokens
    for _ in range(20):
        p.observe(64, 1, 0.0015, "sampled", [(1, 1)] * 19 + [(0, 1)] * 45)  # 1.3 tokens
    assert p.tokens("sampled", 3) == pytest.approx(2.0) and p.tokens("sampled", 1) == pytest.approx(1.3, abs=0.01)
    assert p.choose(64, "sampled") == 3  # 2.0 tokens in 2 ms beat 1.3 in 1.5


def test_greedy_and_sampled_batches_keep_costs_apart():
    """A greedy stretch's price of a step must not stand for sampled
    batches (H100 sweep: the T=0 points priced AR steps at padded 64 at
    2.67 ms, the T=1 points then speculated at 0.86x of the AR engine)."""
    p = SpecPolicy(block_size=16)
    for _ in range(CONFIRM):
        p.observe(64, 15, 0.0028, "greedy", rows_of(2.5))
        p.observe(64, 0, 0.0027, "greedy")
    p.observe(64, 15, 0.0028, "sampled", rows_of(1.75))
    assert p.choose(64, "sampled") == 0  # sampled AR steps are not priced yet: measured on first use
    p.observe(64, 0, 0.0014, "sampled")
    assert p.choose(64, "sampled") == 0 and p.choose(64, "greedy") == 15


def test_probes_of_the_losing_kind_are_rarer_the_more_it_loses():
    assert probe_every(PROBE_EVERY, 1.0) == PROBE_EVERY  # near break-even: the base cadence
    assert probe_every(PROBE_EVERY, 1.01) == PROBE_EVERY
    # a probe's PROBE_STEPS steps each give up half a step: spaced to cost PROBE_BUDGET
    assert probe_every(PROBE_EVERY, 2.0) == int(PROBE_STEPS * 0.5 / PROBE_BUDGET) > 4 * PROBE_EVERY
    assert probe_every(AR_PROBE_EVERY, 10.0) == MAX_PROBE_EVERY
    for adv in (1.2, 1.5, 2.0, 3.0):  # what probes cost, where the budget sets the spacing
        every = probe_every(PROBE_EVERY, adv)
        assert PROBE_STEPS * (1 - 1 / adv) / every == pytest.approx(PROBE_BUDGET, rel=0.02)
    p = SpecPolicy(block_size=16)
    for _ in range(CONFIRM):
        p.observe(8, 15, 0.002, "greedy", rows_of(1.9))  # 1.9 tokens in 2 ms against 1 in 1 ms: AR, by 1.05x
    p.observe(8, 0, 0.001, "greedy")
    every = probe_every(PROBE_EVERY, 1 / 0.95)
    assert every == 37  # 3 steps at 5 % lost, spread to cost 0.4 %
    picks = [p.choose(8, "greedy") for _ in range(every + 4)]
    assert picks.index(15) == every


def test_the_losing_kinds_probes_together_cost_the_budget():
    """With shorter chains three kinds lose at batch 1 (the H200's c=1 T=0
    costs and acceptance); their probes together, each an equal share,
    give up at most PROBE_BUDGET of the winner's tokens a second (each at
    the whole budget they gave up ~3x that), and every kind is probed."""
    p = SpecPolicy(block_size=16, shorter=(7, 3))
    step_ms = {15: 1.284, 7: 1.075, 3: 1.073, 0: 0.926}
    emits = {15: 2.88, 7: 1.93, 3: 1.91, 0: 1.0}
    for d in p.options:
        for _ in range(CONFIRM):
            p.observe(1, d, step_ms[d] / 1000, "greedy")
    for d in (7, 3):  # ~1.9 tokens from 3 or 7 drafts (each chain length keeps its own)
        p.survival[("greedy", f"chain{d}")] = [0.5, 0.25, 0.16] + [0.0] * 12
    p.survival[("greedy", "tree")] = [0.8, 0.5, 0.3, 0.2, 0.08] + [0.0] * 10  # 2.88 from the block
    p.tree = True
    picks = timed_choices(p, 1, "greedy", 20000, {d: t / 1000 for d, t in step_ms.items()})
    assert {15, 7, 3, 0} == set(picks)
    best = emits[15] / step_ms[15]
    tokens, ms = sum(emits[d] for d in picks), sum(step_ms[d] for d in picks)
    lost = 1 - tokens / ms / best
    assert 0 < lost <= PROBE_BUDGET * 1.1


def test_a_step_after_another_kind_is_not_timed():
    """The engine times a step only when the step applied before it and the
    step launched beside it are of its kind and batch size: the cycle after
    a switch (or a chain's start) carries the other step's host work and GPU
    wait, which made a single autoregressive probe read 2x what a chain of
    them costs, and the cycle that launches the other kind carries that
    launch (two-step AR probes read 2.45 ms where AR steps ran at 1.46)."""
    eng = type("Eng", (), {})()
    eng.policy, eng._cycle, eng._observed_kind = SpecPolicy(block_size=16), None, None

    def step(spec: bool, **kw):
        return InflightStep([object()], None, None, drafts=15 if spec else 0, padded=8, **kw)

    def cycle(spec: bool, wall: float, launched: bool | None = None):
        """A cycle that applied a step of kind ``spec`` and launched one of
        kind ``launched`` (the same unless given)."""
        eng._cycle = (100.0, [step(spec, timing=wall / 4, accepted=rows_of(2.5, 2) if spec else None)])
        eng._inflight = [step(spec if launched is None else launched)]
        AsyncSteps._observe_cycle(eng, 100.0 + wall)

    cycle(True, 0.004)  # a chain's first step: not timed, its tokens counted
    assert eng.policy.cost == {} and eng.policy.tokens("greedy", 15) == 2.5
    cycle(True, 0.004)
    assert eng.policy.cost == {(8, 15, "greedy"): pytest.approx(0.004)}
    cycle(True, 0.002, launched=False)  # its launch was an AR step's, not a speculative one's
    assert eng.policy.cost == {(8, 15, "greedy"): pytest.approx(0.004)}
    cycle(False, 0.009)  # follows a speculative step
    assert (8, 0, "greedy") not in eng.policy.cost
    cycle(False, 0.0015)
    assert eng.policy.cost[(8, 0, "greedy")] == pytest.approx(0.0015)
    cycle(False, 0.0035, launched=True)  # the probe's last step launches the other kind: not timed
    cycle(True, 0.006)  # follows an AR step
    assert eng.policy.cost == {(8, 15, "greedy"): pytest.approx(0.004), (8, 0, "greedy"): pytest.approx(0.0015)}


def test_policy_verifies_shorter_chains_where_a_whole_block_costs_too_much():
    """Under load a whole block's verify is compute-bound and its later
    drafts are the rejected ones: a shorter chain emits nearly as many
    tokens for less. At batch 1 every kind costs about the same and the
    whole block wins; with acceptance low, autoregressive steps do."""
    p = SpecPolicy(block_size=16, shorter=(7, 3))
    assert p.options == (15, 7, 3, 0)
    # rows accepting 0..15 drafts, P(a >= j) falling 0.1 a position: 1 + 0.9 + ... + 0.1 tokens (tau 5.5)
    rows = [(a, 15) for a in range(10) for _ in range(10)]
    for d, ms in ((15, 12.0), (7, 6.5), (3, 4.6), (0, 3.5)):  # batch 32
        assert p.choose(32, "greedy") == d  # each kind is measured first, the whole block first
        for _ in range(CONFIRM):  # (and confirmed: the probes' spacing below is the budget's)
            p.observe(32, d, ms / 1000, "greedy", rows if d else None)
    assert p.tokens("greedy", 15) == pytest.approx(5.5) and p.tokens("greedy", 7) == pytest.approx(1 + 0.9 + 0.8 + 0.7 + 0.6 + 0.5 + 0.4 + 0.3)
    assert p.choose(32, "greedy") == 7  # 5.2 tokens in 6.5 ms beat 5.5 in 12 and 3.4 in 4.6
    for d, ms in ((15, 1.25), (7, 1.22), (3, 1.2), (0, 1.0)):  # batch 1
        p.observe(1, d, ms / 1000, "greedy")
    assert p.choose(1, "greedy") == 15
    for d, ms in ((15, 1.25), (7, 1.22), (3, 1.2), (0, 1.0)):  # sampled steps cost their own
        p.observe(1, d, ms / 1000, "sampled", [(0, d)] * 9 + [(1, d)] if d else None)  # and accept little: 1.1 tokens
    assert p.choose(1, "sampled") == 0
    # the losing shorter chain is probed too, and a probe holds its kind
    picks = [p.choose(32, "greedy") for _ in range(1000)]
    assert {15, 3, 0} <= set(picks) and picks.count(7) > 900
    snap = p.snapshot()
    greedy = snap["step_ms"]["greedy"]
    assert greedy["32s7"] == 6.5 and greedy["32s"] == 12.0 and greedy["32a"] == 3.5
    # where the whole block is a draft tree, the shorter chains' acceptance is their own
    p = SpecPolicy(block_size=16, shorter=(7,), tree=True)
    p.observe(8, 15, 0.002, "greedy", [(6, 15)] * 10)
    assert p.tokens("greedy", 15) == 7 and p.tokens("greedy", 7) == 1 + 0.5 * 7  # no chain seen yet
    p.observe(8, 7, 0.002, "greedy", [(2, 7)] * 10)
    assert p.tokens("greedy", 7) == 3 and p.tokens("greedy", 15) == 7
    # the snapshot's settled expectation of a chain stops at its length (positions past it are never seen)
    assert p.snapshot()["settled_tokens_per_row"] == {"greedy/tree": 7, "greedy/chain7": 3}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_models(tmp_path_factory.mktemp("policy"))


def adaptive(models, **kw):
    return LLM(models / "t", models / "d", num_kv_blocks=300, kv_block_size=4, cuda_graphs=True,
               async_scheduling=True, adaptive_speculation=True, max_num_seqs=8, **kw)


@pytest.mark.parametrize("lanes", [False, True])
def test_adaptive_greedy_is_autoregressive(models, lanes):
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in MAX_TOKENS]
    want = [o.token_ids for o in LLM(models / "t", None).generate(PROMPTS, params)]
    # chains of 4 rows at the shortest: each kind is measured on first use, and
    # these requests end within ~30 steps (test_shorter_chains_... runs 1-draft chains)
    llm = adaptive(models, shortest_verify_block=4, **(dict(overlap=True, overlap_min_batch=2) if lanes else {}))
    got = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in got] == want
    snap = llm.engine.policy.snapshot()
    # Both kinds of step ran (the policy measures each), and the step
    # records say which: an autoregressive step verifies no draft.
    assert snap["speculative_steps"] > 0 and snap["autoregressive_steps"] > 0, snap
    assert sum(o.metrics.num_draft_tokens for o in got) < sum(len(o.token_ids) for o in got) * 7


@pytest.mark.parametrize("lookups, tree", [(0, False), (2, False), (0, True)])
def test_shorter_chains_give_the_autoregressive_tokens(models, lookups, tree, monkeypatch):
    """Greedy steps taking turns between the whole block (a chain or a
    draft tree), a shorter chain and an autoregressive step (forced) emit
    the target's tokens."""
    turns = itertools.cycle([7, 3, 1, 0])
    monkeypatch.setattr(SpecPolicy, "choose", lambda self, n, kind: next(turns))
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in MAX_TOKENS]
    want = [o.token_ids for o in LLM(models / "t", None).generate(PROMPTS, params)]
    llm = adaptive(models, draft_tree=tree, prompt_lookup_min=lookups)
    assert llm.engine.policy.options == (7, 3, 1, 0) and (llm.engine.tree is not None) == tree
    assert llm.engine.features()["adaptive_speculation"]["drafts"] == [7, 3, 1, 0]
    got = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in got] == want
    # A step verified 7, 3, 1 and 0 drafts in turn (fewer near max_tokens): with
    # every step a whole block's, rows would have verified ~7 a step.
    steps = sum(len(o.metrics.acceptance_lengths) for o in got)
    assert 0 < sum(o.metrics.num_draft_tokens for o in got) < 0.6 * 7 * steps


@pytest.mark.parametrize("tree", [False, True])
def test_adaptive_sampled_steps_keep_the_distribution(tmp_path, monkeypatch, tree):
    """Speculative steps of whole blocks and of shorter chains, and
    autoregressive ones, taking turns within requests (the policy forced):
    the token triples of 20k seeded requests follow the target's joint
    distribution. ``tree``: the whole blocks hold sampled draft trees."""
    turns = itertools.cycle([3, 0, 1])  # the drafter's block is 4 rows: 3 drafts, or 1
    monkeypatch.setattr(SpecPolicy, "choose", lambda self, n, kind: next(turns))
    outs, cells, joint = sampled_triples(tmp_path, [2, 5, 3], 20000, cuda_graphs=True, async_scheduling=True,
                                         adaptive_speculation=True, draft_tree=tree, shortest_verify_block=2)
    assert all(len(o.token_ids) == 3 for o in outs)
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0.02 * len(outs)
    assert pooled_chi2_p(cells, joint) > 1e-3
