"""Load-adaptive speculation: each asynchronous step verifies the drafter's
block (B rows a request), a shorter chain of its first drafts (B/2, B/4
rows: ``EngineConfig.shortest_verify_block``), or is a plain
autoregressive step (one row; the drafter only stores the row's context,
so speculation can resume), whichever emits more tokens per second at
this batch size.

Speculating pays where ``E[tokens a row emits per step] / T(n)`` beats
``1 / T_ar(n)``: at batch 1 a step costs about the same either way and the
block emits ~3 tokens; at large batches a B-row verify reads the same
weights but computes B times the rows, and a sampled row accepts little.
A shorter chain gives up the block's last drafts, the ones least often
accepted, and where the verify is compute-bound (a large target under
load) costs about its share of rows. Both sides are measured, not assumed:

* ``T(n)`` of each kind: what a step of it costs at each padded batch
  size: the longer of its replay's device time (CUDA events; off CUDA
  the host's) and the wall time of the engine cycle that applied it
  (``EngineCore._observe_cycle``: with a small model the host, whose work
  grows with the tokens a step emits, is the limit: on the H200 the
  embedded pair served at c=16 ran 0.73x of autoregressive when only device
  time was weighed): the lower median of its last ``COST_SAMPLES`` timed
  steps, or of those of its latest run (a probe, or the stretch it has
  been chosen for) where that is lower, each kind measured on first use
  by running it. Greedy and sampled batches keep costs apart, as they
  keep acceptance apart: their steps replay other graphs and do other host
  work (on the H100 a sweep's greedy points priced autoregressive steps at
  padded 64 at 2.67 ms, its sampled points then read that price where such
  steps ran at 1.3-1.6, and speculated at 0.86x of the AR engine). A
  median, since a cycle's wall time has a floor and a long tail, and a
  losing kind is timed only by its rare probes: on the H200 at c=64 T=1,
  moving means priced autoregressive steps at 2.23 ms and 4-row chains at
  2.71 where such cycles ran at 1.58 and 2.01, and the policy verified
  8-row chains at 0.93x of the autoregressive engine. The
  latest run where lower, since errors are not alike: a kind priced too
  low is chosen, so timed every step and corrected within a few; a losing
  kind priced too high is retimed only by probes, up to
  ``MAX_PROBE_EVERY`` steps apart, and readings older than its last probe
  outvoted it (on the H100 at c=32 T=1, readings from the point's churn
  priced autoregressive steps at 2.14 ms where they ran at 1.15-1.2, and
  the policy speculated at 0.90x of the autoregressive engine);
* the tokens a row emits when it verifies ``d`` drafts: ``1 + sum(S_j, j <=
  d)``, where ``S_j``, the chance that a row accepts at least ``j`` drafts,
  is an exponentially weighted mean (a plain one over its first ~1/alpha
  rows) of the engine's recent speculative
  rows that verified a ``j``-th draft, kept apart for greedy and sampled
  batches (their acceptance differs by half) and for each length of chain
  (the drafter's block attends both ways, so a 2-row block's first draft
  is not a 4-row block's: on the H100 at c=8 T=1, 2-row chains emitted
  1.25 tokens a row and 4-row ones 1.69, more than their first draft
  alone could give at 2-row acceptance; pooled, the shorter chain's rows
  priced the longer one's first draft and the policy kept the shorter);
  while the drafter rests no row comes, and each ``S_j`` returns toward a
  settled mean of the same rows (``SETTLED_ALPHA``, ``resting``). The losing kinds are
  probed now and then, all of them together at a cost of at most
  ``PROBE_BUDGET`` of the throughput, each its share (``probe_every``;
  on the H200 at c=1 T=0 three losing kinds, each at the whole budget,
  together cost ~1.5 % where speculation ran at 1.97x): a kind with more
  drafts than the winner's at least ``PROBE_EVERY`` steps apart, one with fewer (autoregressive
  steps) ``AR_PROBE_EVERY``, and at those base cadences while a cost has
  fewer than ``CONFIRM`` timed steps or none in its last ``STALE_AFTER``
  steps (a probe whose steps a join or a switch left untimed tells
  nothing). A probe is ``PROBE_STEPS`` steps in a row,
  and the engine measures no step whose kind or batch size differs from
  the step applied before it or the step launched beside it: such a cycle
  carries the other kind's host work and its wait for the GPU (on the H200
  at c=64 single-step probes read an autoregressive step at 2.98 ms where
  a chain of them ran at 1.49, and the policy kept speculating at 0.39x of
  the AR engine).

Exactness does not depend on the choice: every step, of either kind, emits
the target's tokens (greedy) or its distribution (sampled).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from functools import cached_property

COST_SAMPLES = 5  # a kind's cost: the lower median of its last this many timed steps (or its latest run's)
RUN_GAP = 16  # a kind's timed steps at most this many steps apart are one run
CONFIRM = 3  # a losing kind's cost is probed at the base cadence until this many steps are timed
# Weight of one row in a position's acceptance mean (a step whose n rows
# verified the position weighs 1 - (1 - ROW_ALPHA)**n): a sampled row emits 1 token or many, so
# at batch 1 a mean over single steps swung across the break-even point
# and the policy fell back to autoregressive steps for 16 at a time.
ROW_ALPHA = 0.02
PROBE_EVERY = 16  # steps at least between two probes of a kind with more drafts than the winner's
# The same for a kind with fewer drafts (autoregressive steps): rarer,
# since at batch 1 an autoregressive step gives up ~2/3 of a step's tokens.
AR_PROBE_EVERY = 64
# A probe's steps in a row: its first follows the other kind and its last
# launches it, so only the steps between are measured (on the H100 at c=8
# T=1, two-step probes priced AR steps at 2.45 ms where they ran at 1.46).
PROBE_STEPS = 3
# A probe of a losing kind costs what that kind loses: probes of the
# losing kinds are spaced to cost at most this share of the throughput
# together, each kind an equal part of it (on
# the H200 at c=64 T=1, where a speculative step emitted 3x fewer tokens a
# second, spec probes every 16 steps cost 13 %; at c=32 T=1 whole-block
# probes spaced by the square of their loss still cost ~3 %) ...
PROBE_BUDGET = 0.004
MAX_PROBE_EVERY = 512  # ... and come at least this often
# A losing kind with no timed step in this many steps is probed at the base
# cadence until one is timed: probes at MAX_PROBE_EVERY whose steps were not
# timed would leave its cost as old as the batch's last change of load.
STALE_AFTER = 2 * MAX_PROBE_EVERY
MARGIN = 1.03  # speculate only where it is this much faster (measurement noise)
# A position's settled acceptance: the same rows weighted this much less
# (~400 rows). While the drafter rests (drafter_rest.py) no row tells the
# policy anything, and a recent mean left where a stretch of low acceptance
# put it would keep the drafter asleep for good: on the H100 at c=1 T=1 the
# policy ran 5 878 autoregressive steps of 6 058 at 1.00x of the AR engine
# where speculating ran at 1.25x. So at rest the recent mean returns to the
# settled one, as if rows of settled acceptance came. The settled mean
# itself moves only with rows a fed drafter verified: where ~400 rows of
# low acceptance put it below the break-even point, the drafter sleeps until
# the batch's costs change (a rest's probes time steps, their drafts come
# from a context with holes).
SETTLED_ALPHA = ROW_ALPHA / 8
UNSEEN = 0.5  # a position not seen yet


@dataclass
class SpecPolicy:
    block_size: int
    # Draft counts a step may verify besides the drafter's whole block
    # (``block_size - 1``) and none (an autoregressive step): shorter chains.
    shorter: tuple[int, ...] = ()
    tree: bool = False  # the whole block holds a draft tree (the shorter ones are chains)
    # (padded batch, drafts, "greedy" or "sampled") -> seconds
    cost: dict[tuple[int, int, str], float] = field(default_factory=dict)
    # (sampling kind, shape) -> P(a row accepts at least j drafts), j = 1 .. block_size - 1; shape:
    # "tree" or "chain" (the whole block), "chain3" (a shorter chain of 3 drafts)
    survival: dict[tuple[str, str], list[float | None]] = field(default_factory=dict)
    settled: dict[tuple[str, str], list[float | None]] = field(default_factory=dict)  # the same, SETTLED_ALPHA
    rows_seen: dict[tuple[str, str], list[int]] = field(default_factory=dict)  # rows behind each position's means
    # (padded batch, drafts) -> steps of that batch size since one verified that
    # many: a size the batch passes through (a drain, 64 to 1 rows) starts
    # at 0, so its kinds are not probed on arrival for the steps elsewhere
    since: dict[tuple[int, int], int] = field(default_factory=dict)
    choices: dict[int, int] = field(default_factory=dict)  # drafts -> steps that verified that many
    held: int = 0  # steps a probe still holds its kind for
    holding: int = 0  # the probe's draft count
    exploring: bool = False  # the last choice was a probe's step or a kind's first, not a choice by rate
    # The timed steps behind ``cost``: count and seconds, unweighted (what
    # the costs were made of: bench/concurrency_sweep.py reports it
    # beside the cycles' own costs).
    measured: dict[tuple[int, int, str], list] = field(default_factory=dict)
    recent: dict[tuple[int, int, str], deque] = field(default_factory=dict)  # the last COST_SAMPLES timed steps
    run: dict[tuple[int, int, str], deque] = field(default_factory=dict)  # ... of the kind's latest run
    last_timed: dict[tuple[int, int, str], int] = field(default_factory=dict)  # steps chosen when it was last timed

    @cached_property
    def options(self) -> tuple[int, ...]:
        """Draft counts a step may verify, the whole block first."""
        full = self.block_size - 1
        return (full, *sorted({d for d in self.shorter if 0 < d < full}, reverse=True), 0)

    def choose(self, n_padded: int, kind: str) -> int:
        """How many drafts each row of the next step of a batch padded to
        ``n_padded`` rows of sampling ``kind`` ("greedy" or else) verifies
        (0: an autoregressive step)."""
        if self.held:
            self.held -= 1
            drafts, self.exploring = self.holding, True
        else:
            drafts, probe = self._choose(n_padded, kind)
            self.held, self.holding = (PROBE_STEPS - 1 if probe else 0), drafts
            self.exploring = probe or (n_padded, drafts, _kind(kind)) not in self.cost
        for d in self.options:
            key = (n_padded, d)
            self.since[key] = 0 if d == drafts else self.since.get(key, 0) + 1
        self.choices[drafts] = self.choices.get(drafts, 0) + 1
        return drafts

    def hold(self, drafts: int, steps: int) -> None:
        """The next ``steps`` steps verify ``drafts`` drafts whatever the
        rates (a resting drafter's trial wake, drafter_rest.py)."""
        self.held, self.holding = steps, drafts

    def tokens(self, kind: str, drafts: int) -> float:
        """Tokens a row is expected to emit in a step verifying ``drafts``
        drafts: the bonus and each draft it accepts."""
        return _expected_tokens(self.survival.get(self._shape(kind, drafts), ()), drafts)

    def resting(self, kind: str, rows: int) -> None:
        """A step of a resting drafter, ``rows`` rows of sampling ``kind``:
        each position's recent mean moves toward its settled one as far as
        ``rows`` rows of settled acceptance would move it."""
        for key, settled in self.settled.items():
            if key[0] == _kind(kind):
                s = self.survival[key]
                s[:] = [x if x is None or m is None else _ewm(x, m, ROW_ALPHA, rows) for x, m in zip(s, settled)]

    def _choose(self, n: int, kind: str) -> tuple[int, bool]:
        """(drafts, whether it is a probe)."""
        cost = {d: self.cost.get((n, d, _kind(kind))) for d in self.options}
        for d in self.options:  # each kind is measured on first use, the whole block first
            if cost[d] is None:
                return d, False
        rate = {d: self.tokens(kind, d) / cost[d] for d in self.options}
        # speculate only where it beats autoregressive steps by MARGIN
        best = max((d for d in self.options if d == 0 or rate[d] > MARGIN * rate[0]), key=rate.get)
        # The losing kinds are probed now and then (the batch's load changes
        # their costs), the rarer the more they lose; steps with more drafts
        # than the winner's more often than those with fewer, since at
        # batch 1 an autoregressive step gives up ~2/3 of a step's tokens.
        # A cost from fewer than CONFIRM timed steps is probed at the base
        # cadence: its first step ran where the batch size first came, and a
        # cold reading of a loser would stand until its rare probes.
        share = PROBE_BUDGET / (len(self.options) - 1)
        now = sum(self.choices.values())

        def gap(d: int) -> int:
            base = PROBE_EVERY if d > best else AR_PROBE_EVERY
            key = (n, d, _kind(kind))
            if len(self.recent.get(key, ())) < CONFIRM or now - self.last_timed[key] > STALE_AFTER:
                return base
            return probe_every(base, rate[best] / rate[d], share)

        due = [d for d in self.options if d != best and self.since.get((n, d), 0) >= gap(d)]
        if due:
            return max(due, key=rate.get), True
        return best, False

    def observe(self, n_padded: int, drafts: int, seconds: float, kind: str,
                rows: list[tuple[int, int]] | None = None) -> None:
        """A finished step that verified ``drafts`` drafts a row: its time,
        and (speculative) its rows' (drafts accepted, drafts verified)."""
        if seconds > 0:
            key = (n_padded, drafts, _kind(kind))
            m = self.measured.setdefault(key, [0, 0.0])
            m[0], m[1] = m[0] + 1, m[1] + seconds
            recent = self.recent.setdefault(key, deque(maxlen=COST_SAMPLES))
            run = self.run.setdefault(key, deque(maxlen=COST_SAMPLES))
            now = sum(self.choices.values())
            if now - self.last_timed.get(key, now) > RUN_GAP:
                run.clear()
            self.last_timed[key] = now
            recent.append(seconds)
            run.append(seconds)
            self.cost[key] = min(lower_median(recent), lower_median(run))
        if drafts and rows:
            self._observe_acceptance(self._shape(kind, drafts), rows)

    def _shape(self, kind: str, drafts: int) -> tuple[str, str]:
        """A tree accepts more at each depth than a chain, and a chain's
        drafts depend on its block's length: each keeps its acceptance."""
        if drafts == self.block_size - 1:
            return _kind(kind), "tree" if self.tree else "chain"
        return _kind(kind), f"chain{drafts}"

    def _drafts_of(self, shape: str) -> int:
        return int(shape[5:]) if shape.startswith("chain") and shape != "chain" else self.block_size - 1

    def _observe_acceptance(self, key: tuple[str, str], rows: list[tuple[int, int]]) -> None:
        """Each position's survival moves by its rows (a row whose block
        was cut short, or shorter, tells nothing of the positions past it):
        a row accepting ``a`` of ``g`` drafts accepted at least ``j`` for
        every ``j <= a`` and not for ``a < j <= g``. A position's first
        rows set it (None: not seen yet)."""
        s = self.survival.setdefault(key, [None] * (self.block_size - 1))
        settled = self.settled.setdefault(key, [None] * (self.block_size - 1))
        count = self.rows_seen.setdefault(key, [0] * (self.block_size - 1))
        n = len(s)
        # rows by the drafts they verified and accepted (counted once a row,
        # not once a row and position: this runs every step, 64 rows at c=64)
        verified, accepted = [0] * (n + 1), [0] * (n + 1)
        for a, g in rows:
            verified[min(g, n)] += 1
            accepted[min(a, g, n)] += 1
        seen = yes = 0  # rows that verified / accepted at least j drafts
        at_least = []
        for j in range(n, 0, -1):
            seen, yes = seen + verified[j], yes + accepted[j]
            at_least.append((seen, yes))
        for j, (seen, yes) in enumerate(reversed(at_least), 1):
            if not seen:
                break  # a row verifies its drafts from the first: none saw a later one
            mean = yes / seen
            s[j - 1] = _ewm(s[j - 1], mean, ROW_ALPHA, seen, count[j - 1])
            settled[j - 1] = _ewm(settled[j - 1], mean, SETTLED_ALPHA, seen, count[j - 1])
            count[j - 1] += seen

    def snapshot(self) -> dict:
        full = self.block_size - 1
        return {"speculative_steps": sum(c for d, c in self.choices.items() if d),
                "autoregressive_steps": self.choices.get(0, 0),
                "steps_by_drafts": {str(d): c for d, c in sorted(self.choices.items())},
                "tokens_per_speculative_row": {k: round(self.tokens(k, full), 4)
                                               for k in sorted({k for k, _ in self.survival})},
                "settled_tokens_per_row": {"/".join(k): round(_expected_tokens(s, self._drafts_of(k[1])), 4)
                                           for k, s in self.settled.items()},
                "survival": _rounded(self.survival), "settled_survival": _rounded(self.settled),
                "step_ms": _by_kind(self.cost, full, lambda t: round(1000 * t, 4)),
                "measured": _by_kind(self.measured, full, list)}


def probe_every(base: int, advantage: float, budget: float = PROBE_BUDGET) -> int:
    """Steps between probes of a losing kind when the winner emits
    ``advantage`` times its tokens a second: a probe's ``PROBE_STEPS`` each
    give up ``1 - 1/advantage`` of a step, spread to cost ``budget`` (the
    kind's share of ``PROBE_BUDGET``), ``base`` steps apart at least,
    ``MAX_PROBE_EVERY`` at most."""
    loss = PROBE_STEPS * (1 - 1 / max(1.0, advantage))
    return int(min(MAX_PROBE_EVERY, max(base, loss / budget)))


def _expected_tokens(survival, drafts: int) -> float:
    """Tokens a row emits verifying ``drafts`` drafts at these per-position
    survival means: the bonus and each draft it accepts (a position not
    seen yet, which a speculative step's first rows set: UNSEEN)."""
    return 1.0 + sum(UNSEEN if x is None else x for x in (list(survival) + [None] * drafts)[:drafts])


def _by_kind(costs: dict, full: int, value) -> dict:
    """``{"greedy": {"8s": ...}, "sampled": {...}}`` of a dict keyed (padded, drafts, kind)."""
    out = {}
    for (n, d, kind), v in sorted(costs.items()):
        out.setdefault(kind, {})[step_key(n, d, full)] = value(v)
    return out


def _rounded(survival: dict) -> dict:
    return {"/".join(k): [None if x is None else round(x, 4) for x in s] for k, s in survival.items()}


def _ewm(old: float | None, mean: float, alpha: float, rows: int, before: int | None = None) -> float:
    """``old`` moved toward ``mean`` by ``rows`` rows of weight ``alpha``
    (None: not seen yet, ``mean``). ``before``: the rows behind ``old``;
    until they are ~1/alpha the mean is every row's alike, so the first
    rows do not stand for hundreds (a sampled row at batch 1 accepts 0 or
    several: the settled mean began where the first row put it, 0, and
    moved 0.25 % a row, so at c=1 T=1 on the H100 it was still below
    break-even when a dip put the drafter to rest, and the rest lasted)."""
    if old is None:
        return mean
    weight = 1 - (1 - alpha) ** rows
    if before is not None:
        weight = max(weight, rows / (before + rows))
    return old + weight * (mean - old)


def lower_median(xs) -> float:
    return sorted(xs)[(len(xs) - 1) // 2]


def step_key(n: int, drafts: int, full: int) -> str:
    """``8s`` (the whole block), ``8s3`` (3 drafts), ``8a`` (autoregressive)."""
    return f"{n}a" if drafts == 0 else f"{n}s" if drafts == full else f"{n}s{drafts}"


def _kind(kind: str) -> str:
    return "greedy" if kind == "greedy" else "sampled"


def scripted(policy: SpecPolicy, turns: list[int]):
    """A test hook, ``EngineConfig(extra={"policy_turns": [7, 3, 0]})``: a
    ``choose`` that takes the draft counts in turn, whatever was measured,
    for engines in processes a test cannot patch (Ray actors)."""
    bad = [d for d in turns if d not in policy.options]
    if bad:
        raise ValueError(f"policy_turns {bad} are not among the draft counts a step may verify {policy.options}")
    cycle = itertools.cycle(turns)

    def choose(n_padded: int, kind: str) -> int:
        drafts = next(cycle)
        policy.choices[drafts] = policy.choices.get(drafts, 0) + 1
        return drafts

    return choose
