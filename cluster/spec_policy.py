"""Load-adaptive speculation: each asynchronous step either verifies the
drafter's block (B rows a request) or is a plain autoregressive step (one
row; the drafter only stores the row's context, so speculation can resume),
whichever emits more tokens per second at this batch size.

Speculating pays where ``E[tokens a row emits per step] / T_spec(n)`` beats
``1 / T_ar(n)``: at batch 1 a step costs about the same either way and the
block emits ~3 tokens; at large batches a B-row verify reads the same
weights but computes B times the rows, and a sampled row accepts little.
Both sides are measured, not assumed:

* ``T_spec(n)``, ``T_ar(n)``: what a step of each kind costs at each padded
  batch size: the longer of its replay's device time (CUDA events; off CUDA
  the host's) and the wall time of the engine cycle that applied it
  (``EngineCore._observe_cycle``: with a small model the host, whose work
  grows with the tokens a step emits, is the limit: on the H200 the
  embedded pair served at c=16 ran 0.73x of autoregressive when only device
  time was weighed), an exponentially weighted mean, each measured on
  first use by running that kind of step;
* the tokens a speculative step emits per row, an exponentially weighted
  mean over the engine's recent speculative rows, kept apart for greedy
  and sampled batches (their acceptance differs by half). While steps are
  autoregressive a speculative probe every ``PROBE_EVERY`` steps keeps it
  current, and while they speculate an autoregressive one every
  ``AR_PROBE_EVERY`` steps keeps that cost current, both the rarer the
  further the estimate is from break-even (``probe_every``). A probe is
  ``PROBE_STEPS`` steps in a row, and the engine measures no step whose
  kind or batch size differs from the step applied before it or the step
  launched beside it: such a cycle carries the other kind's host work and
  its wait for the GPU (on the H200 at c=64 single-step probes read an
  autoregressive step at 2.98 ms where a chain of them ran at 1.49, and
  the policy kept speculating at 0.39x of the AR engine).

Exactness does not depend on the choice: every step, of either kind, emits
the target's tokens (greedy) or its distribution (sampled).
"""

from __future__ import annotations

from dataclasses import dataclass, field

ALPHA = 0.2  # weight of a new step-time measurement in its moving mean
# Weight of one row's emitted tokens in their moving mean (a step of n rows
# weighs 1 - (1 - ROW_ALPHA)**n): a sampled row emits 1 token or many, so
# at batch 1 a mean over single steps swung across the break-even point
# and the policy fell back to autoregressive steps for 16 at a time.
ROW_ALPHA = 0.02
PROBE_EVERY = 16  # autoregressive steps between two speculative probes
# Speculative steps between two autoregressive probes: rarer, since at
# batch 1 an autoregressive step gives up ~2/3 of a step's tokens.
AR_PROBE_EVERY = 64
# A probe's steps in a row: its first follows the other kind and its last
# launches it, so only the steps between are measured (on the H100 at c=8
# T=1, two-step probes priced AR steps at 2.45 ms where they ran at 1.46).
PROBE_STEPS = 3
# A probe of the losing kind costs what that kind loses: the further the
# estimate is from break-even, the rarer the probes, by the square of the
# winner's advantage, up to this many steps apart (on the H200 at c=64 T=1,
# where a speculative step emitted 3x fewer tokens a second, spec probes
# every 16 steps cost 13 % of the throughput).
MAX_PROBE_EVERY = 256
MARGIN = 1.03  # speculate only where it is this much faster (measurement noise)


@dataclass
class SpecPolicy:
    block_size: int
    cost: dict[tuple[int, bool], float] = field(default_factory=dict)  # (padded batch, speculative) -> seconds
    emitted: dict[str, float] = field(default_factory=dict)  # sampling kind -> tokens a row emits per spec step
    since_probe: int = 0  # autoregressive steps since the last speculative one
    since_ar: int = 0  # speculative steps since the last autoregressive one
    choices: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})
    held: int = 0  # steps a probe still holds its kind for
    # The timed steps behind ``cost``: count and seconds, unweighted (what
    # the moving means were made of: bench/concurrency_sweep.py reports it
    # beside the cycles' own costs).
    measured: dict[tuple[int, bool], list] = field(default_factory=dict)

    def choose(self, n_padded: int, kind: str) -> bool:
        """Whether the next step of a batch padded to ``n_padded`` rows of
        sampling ``kind`` ("greedy" or else) speculates."""
        if self.held:
            self.held -= 1
            spec = self.since_probe == 0  # the probe's kind, as its first step chose it
        else:
            spec, probe = self._choose(n_padded, kind)
            self.held = PROBE_STEPS - 1 if probe else 0
        self.since_probe = 0 if spec else self.since_probe + 1
        self.since_ar = self.since_ar + 1 if spec else 0
        self.choices[spec] += 1
        return spec

    def _choose(self, n: int, kind: str) -> tuple[bool, bool]:
        """(speculate, whether it is a probe)."""
        t_spec, t_ar = self.cost.get((n, True)), self.cost.get((n, False))
        if t_spec is None:
            return True, False
        if t_ar is None:
            return False, False
        tokens = self.emitted.get(_kind(kind), 1.0 + 0.5 * (self.block_size - 1))
        advantage = tokens * t_ar / t_spec  # speculation's tokens a second over autoregressive's
        spec = advantage > MARGIN
        if not spec and self.since_probe >= probe_every(PROBE_EVERY, 1 / advantage):
            return True, True
        if spec and self.since_ar >= probe_every(AR_PROBE_EVERY, advantage):
            return False, True  # keeps the autoregressive cost current (the batch's load changes it)
        return spec, False

    def observe(self, n_padded: int, spec: bool, seconds: float, kind: str, tokens_per_row: float | None,
                rows: int = 1) -> None:
        """A finished step: its time, and (speculative) the tokens its
        ``rows`` rows emitted on average."""
        if seconds > 0:
            key = (n_padded, spec)
            m = self.measured.setdefault(key, [0, 0.0])
            m[0], m[1] = m[0] + 1, m[1] + seconds
            old = self.cost.get(key)
            # A measurement far below the mean replaces it: an overestimated
            # kind is chosen (and measured) only by the rare probes, so one
            # slow first step (a graph launched cold, a busy host) would
            # otherwise keep it off for hundreds of steps; an underestimate
            # corrects itself, since that kind runs and is measured.
            fresh = old is None or seconds < old / 2
            self.cost[key] = seconds if fresh else (1 - ALPHA) * old + ALPHA * seconds
        if spec and tokens_per_row is not None:
            k = _kind(kind)
            old = self.emitted.get(k)
            w = 1 - (1 - ROW_ALPHA) ** max(rows, 1)
            self.emitted[k] = tokens_per_row if old is None else (1 - w) * old + w * tokens_per_row

    def snapshot(self) -> dict:
        return {"speculative_steps": self.choices[True], "autoregressive_steps": self.choices[False],
                "tokens_per_speculative_row": dict(self.emitted),
                "step_ms": {_key(n, s): round(1000 * t, 4) for (n, s), t in sorted(self.cost.items())},
                "measured": {_key(n, s): list(m) for (n, s), m in sorted(self.measured.items())}}


def probe_every(base: int, advantage: float) -> int:
    """Steps between probes of the losing kind when the winner emits
    ``advantage`` times its tokens a second."""
    return int(min(MAX_PROBE_EVERY, base * max(1.0, advantage) ** 2))


def _key(n: int, spec: bool) -> str:
    return f"{n}{'s' if spec else 'a'}"


def _kind(kind: str) -> str:
    return "greedy" if kind == "greedy" else "sampled"
