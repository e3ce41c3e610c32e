"""How requests enter chains of asynchronous steps (async_decode.py).

A chain can start at the prefill that finishes its prompts
(``chain_from_prefill``): its first decode step opens with the first tokens
the prefill left on the device and is launched before the host reads them.

A request can also join a running chain (``join_chain``) in place of a
finished row, or as a row more: its prompt is prefilled alone in a
synchronous step queued behind the chain's step in flight, its row's state
written into the step graphs' buffers on the device, and the chain's next
step launched with it before the host reads anything. Under churn (a closed
loop at c=64 admits a request every step or two) draining the chain at each
admission cost a synchronous step and a chain restart each time, and rows
of a speculative engine finish at different steps where an autoregressive
engine's same-length requests finish together.
"""

from __future__ import annotations

import torch

from specray import async_decode
from specray.chain_rows import batch_mode
from specray.request import Request, RequestOutput
from specray.scheduler import StepPlan


def chain_from_prefill(core, plan, first_tokens: torch.Tensor) -> async_decode.InflightStep | None:
    """The first decode step of the requests whose prompts the synchronous
    step ``plan`` finished, launched before the host reads their first
    tokens (``first_tokens`` ``[P]`` on the device, in ``plan.prefill``'s
    order): the drafter's context store of the step's rows, then one step
    graph replay whose rows open with those tokens. The host's launch then
    overlaps the GPU's prefill, where it waited for the token first (the
    speculative engine's store and first launch cost the H200's host ~1.3 ms
    a request with the GPU idle). None where the next step must be
    synchronous, by the rules a running chain follows (``_can_chain``)."""
    sched, B = core.scheduler, core.block_size
    requests = [p.request for p in plan.prefill]
    if plan.decode or plan.preempted or not requests:
        return None
    if len(sched.running) != len(requests) or sched.could_admit(len(requests) * B) or \
            not core.async_capable(requests):
        return None
    if len(core.lane_split(requests)) > 1:
        # Lanes start at the next step (``_start_lanes``): a chain launched
        # here runs as one lane, which requests then join, and never splits.
        return None
    for p in plan.prefill:
        if not p.samples_first_token or not _room_after_first_token(core, p.request):
            return None
    if not all(sched.reserve(r, r.num_tokens + B) for r in requests):
        return None  # what was reserved is trimmed when the prefill commits
    core.begin_chain()
    _store_prompts(core, plan)
    return async_decode.launch_decode(core, requests, chained=False, first_tokens=first_tokens,
                                      drafts=core.speculate(requests))


# At most this many requests join a chain in one step: their prompts are
# prefilled one graph replay each (actors/target.py, PREFILL_EACH_MAX), and
# the chain's next step waits behind them.
JOIN_MAX = 4


def may_join(core, rows: list[Request]) -> int:
    """How many requests at the head of the queue may join the running
    chain of ``rows`` now: new requests (not a preempted one's re-prefill,
    which samples no first token) whose whole prompts fit one step
    together, of the chain's sampling kind, with room for their first
    blocks, no more than the chain has places for (finished rows, then
    rows up to max_num_seqs) and ``JOIN_MAX``."""
    sched = core.scheduler
    if not sched.waiting:
        return 0
    places = min(JOIN_MAX, sched.max_num_seqs - len(sched.running))
    vocab = core.target_spec.vocab_size
    mode, tokens, count = batch_mode(rows, vocab), 0, 0
    for r in list(sched.waiting)[:places]:
        tokens += r.prefill_len
        if r.output_token_ids or r.num_computed or tokens > sched.max_num_batched_tokens or \
                not sched.fits_whole(r) or not _room_after_first_token(core, r) or \
                not core.async_capable([r]) or batch_mode(rows + [r], vocab) != mode:
            break
        count += 1
    return count


def join_chain(core, rows: list[Request], count: int, t0: float) -> list[RequestOutput] | None:
    """Admit up to ``count`` requests at the head of the queue into the
    running chain of ``rows`` (the step in flight's): a synchronous step
    prefills their prompts and, before reading its results, launches the
    chain's next step with them in finished rows' places (then as rows
    more); ``core._inflight`` is that step. Returns the prefill's outputs
    (the first tokens), or None where none fits any more (the blocks the
    chain reserved since ``may_join`` looked)."""
    sched = core.scheduler
    items = []
    while len(items) < count and sched.waiting and sched.fits_whole(sched.waiting[0]):
        items.append(sched.admit_whole())
        r = items[-1].request
        # Its first block too, before the next one is looked at (fits_whole left room for it).
        if not sched.reserve(r, r.num_tokens + core.block_size):
            raise RuntimeError(f"request {r.request_id}: no room for its first block, though admitted with it")
    if not items:
        return None
    plan = StepPlan(prefill=items)

    def launch(first_tokens: torch.Tensor) -> async_decode.InflightStep:
        _store_prompts(core, plan)
        joined_rows, places = list(rows), []
        free = (k for k, q in enumerate(rows) if q.finished)
        for p in items:
            k = next(free, len(joined_rows))
            joined_rows[k:k + 1] = [p.request]
            places.append(k)
        return async_decode.launch_decode(core, joined_rows, chained=True, first_tokens=first_tokens,
                                          drafts=core.speculate(joined_rows), joined=tuple(places))

    core.num_chain_joins += len(items)
    return core._sync_step(plan, t0, launch)


def _room_after_first_token(core, r: Request) -> bool:
    """Its first token leaves it a token to emit, and its next block room."""
    return core.scheduler.emit_budget(r) >= 2 and r.num_tokens + 2 * core.block_size <= core.max_model_len


def _store_prompts(core, plan) -> None:
    """The drafter's context of the prompts ``plan``'s step prefilled (its
    rows, in order), before a chain step that drafts from it is launched."""
    if core.drafter is not None:
        positions = [i for p in plan.prefill for i in range(p.start, p.end)]
        slots = [s for p in plan.prefill for s in p.request.draft_blocks.slots(p.start, p.end)]
        core.store_context(None, positions, slots)
