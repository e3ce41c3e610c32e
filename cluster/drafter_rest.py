"""A resting drafter: while the adaptive policy (spec_policy.py) keeps
choosing autoregressive steps, the speculative engine stops feeding its
drafter, and rebuilds the drafter's context when speculation resumes.

An autoregressive step of a speculative engine taps the target's hidden
states and stores each new token's drafter context in the same replay, so
that a later speculative step finds it. Under load, where the policy runs
autoregressive steps for hundreds in a row, that made every step dearer
than the autoregressive engine's (H100, embedded pair, T=1: +4 % device
time a step at 8 rows, +8-9 % at 32, +19 % at 64,
``results/h100_sweep_t1_stale_costs*.json``), so the policy had no step as
cheap as the one it was measured against. After ``REST_AFTER`` such steps in
a row the engine runs the autoregressive engine's own step instead (no
taps, no context store) and notes, per request, where its drafter context
stops (``Request.context_gap_from``). The policy's probes of speculative
steps run meanwhile on the context the drafter has (a hole reads the
zeros or a finished request's context its slots held: worse drafts,
never other tokens), for their cost; their acceptance is left out, and
each step of the rest moves the policy's recent acceptance back toward its
settled mean (``SpecPolicy.resting``), so that a stretch of low acceptance
does not keep the drafter asleep; where the settled mean itself is below
break-even, a trial wake now and then (``TRIAL_AFTER``) reads the
acceptance again. When
the policy chooses a speculative step by its rate, the chain drains, the
target runs once more over each request's tokens from that point
(``refill_context``: its K/V go to the reserved slot 0, so the target's
cache keeps the values its steps wrote) and the drafter stores their
context; then speculation resumes.

Output never depends on it: a step's tokens are the target's whatever the
drafts. Where the drafter lives in another process, or the target is
split over TP ranks, the engine never rests its drafter (``supported``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specray.actors.kv_cache import block_table_tensor
from specray.plan import AttentionMetadata

# Autoregressive steps in a row before the drafter rests: past the policy's
# probes of autoregressive steps (spec_policy.PROBE_STEPS), so only a
# stretch it keeps choosing rests the drafter. A wake costs a drained chain
# and a refill: where the policy wakes it soon after a rest (near its
# break-even point it may swing), the next rest waits twice as long, up
# to MAX_REST_AFTER; a rest that lasted keeps the wait short.
REST_AFTER = 32
MAX_REST_AFTER = 512
REFILL_TOKENS = 4096  # most tokens one refill forward runs
# A rest the policy never ends (its settled acceptance below break-even, so
# no rate picks speculation) would keep the drafter asleep though the
# requests changed: after TRIAL_AFTER rested steps it wakes for a trial of
# TRIAL_STEPS speculative steps, whose acceptance, read on a whole context,
# reaches the policy. Each trial doubles the wait for the next, up to
# MAX_TRIAL_AFTER, until the policy speculates by its rates again: at c=64 on the H100
# (~2 ms a step) a trial's drain, refill and steps cost tens of ms against
# seconds of rest.
TRIAL_AFTER = 1024
MAX_TRIAL_AFTER = 16384
TRIAL_STEPS = 4


@dataclass
class DrafterRest:
    supported: bool
    streak: int = 0  # autoregressive steps chosen in a row
    rest_after: int = REST_AFTER  # the streak that rests the drafter now
    rested_steps: int = 0  # steps of the current rest
    resting: bool = False
    waking: bool = False  # a speculative step was chosen while resting: drain, refill, resume
    rests: int = 0  # times the drafter rested
    probe_steps: int = 0  # the policy's probes run while it rested
    refilled_tokens: int = 0  # positions whose context refill_context rebuilt
    trial_after: int = TRIAL_AFTER  # rested steps before a trial wake
    trial: bool = False  # the wake under way is a trial's
    trials: int = 0  # trial wakes

    def steer(self, drafts: int, exploring: bool = False) -> int:
        """The drafts the next step verifies, given the policy's choice
        (``exploring``: a probe's step or a kind's first). While resting, a
        probe runs on the context the drafter has, holes and all: it
        times the step, and its acceptance is left out of the policy's
        (``InflightStep.rested``). A speculative step chosen by its rate
        wakes the drafter: the chain drains first, so until then the step
        is autoregressive."""
        self.rested_steps += self.resting
        if drafts == 0:
            self.streak += 1
            if self.supported and not self.resting and self.streak >= self.rest_after:
                self.resting, self.rests, self.rested_steps = True, self.rests + 1, 0
            elif self.resting and not self.waking and self.rested_steps >= self.trial_after:
                self.waking = self.trial = True
                self.trials += 1
            return 0
        if self.resting:
            if exploring:
                self.probe_steps += 1
                return drafts
            self.waking = True
            return 0
        self.streak = 0
        if not exploring:  # chosen by its rate: speculation pays again, trials start over
            self.trial_after = TRIAL_AFTER
        return drafts

    def woke(self) -> bool:
        """The context is whole again; whether the wake was a trial's (its
        steps speculate whatever the policy's rates: ``SpecPolicy.hold``)."""
        trial = self.trial
        if trial:
            self.trial_after = min(2 * self.trial_after, MAX_TRIAL_AFTER)
        else:
            short = self.rested_steps < 4 * self.rest_after
            self.rest_after = min(2 * self.rest_after, MAX_REST_AFTER) if short else REST_AFTER
        self.resting = self.waking = self.trial = False
        self.streak = 0
        return trial

    def snapshot(self) -> dict:
        return {"rests": self.rests, "resting": self.resting, "rest_after": self.rest_after,
                "probe_steps": self.probe_steps, "trials": self.trials, "trial_after": self.trial_after,
                "refilled_tokens": self.refilled_tokens}


def refill_context(target, drafter, requests) -> int:
    """The drafter's context of each request's positions from
    ``context_gap_from`` up to ``num_computed`` (its tokens all applied):
    one eager target forward over them (a chunk of ``REFILL_TOKENS`` at
    most), attending to the K/V the target's steps cached and writing its
    own to the reserved slot 0, its taps stored by ``drafter``. Returns
    the positions refilled."""
    todo = []
    for r in requests:
        lo, r.context_gap_from = r.context_gap_from, None
        if lo is not None and lo < r.num_computed and not r.finished:
            todo.append((r, lo, r.num_computed))
    # Pieces of at most REFILL_TOKENS positions, packed into forwards of at most that many.
    pieces = [(r, a, min(a + REFILL_TOKENS, hi)) for r, lo, hi in todo for a in range(lo, hi, REFILL_TOKENS)]
    chunks, size = [[]], 0
    for p in pieces:
        if chunks[-1] and size + p[2] - p[1] > REFILL_TOKENS:
            chunks.append([])
            size = 0
        chunks[-1].append(p)
        size += p[2] - p[1]
    return sum(_refill(target, drafter, c) for c in chunks if c)


def _refill(target, drafter, piece: list) -> int:
    ids, pos, qsl, seq_lens, tables, slots = [], [], [0], [], [], []
    for r, lo, hi in piece:
        ids.extend(r.all_token_ids[lo:hi])
        pos.extend(range(lo, hi))
        qsl.append(qsl[-1] + hi - lo)
        seq_lens.append(hi)
        tables.append(r.target_blocks.blocks)
        slots.extend(r.draft_blocks.slots(lo, hi))
    positions = torch.tensor(pos, dtype=torch.int64)
    attn = AttentionMetadata(positions, torch.zeros_like(positions), torch.tensor(qsl, dtype=torch.int64),
                             torch.tensor(seq_lens, dtype=torch.int64), block_table_tensor(tables),
                             max(b - a for a, b in zip(qsl, qsl[1:])), max(seq_lens))
    hidden_tapped = target.tapped_hidden(torch.tensor(ids, dtype=torch.int64), attn)
    drafter.store_context(hidden_tapped, positions, torch.tensor(slots, dtype=torch.int64))
    return len(pos)
