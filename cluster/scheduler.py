"""Continuous batching: which requests decode and which prompt chunks
prefill this step, under a token budget and two KV pools (target KV and
drafter context KV).

Decoding requests come first (each costs its block length in tokens);
prefill chunks fill what is left of the budget. When a pool runs dry the
most recently admitted request is preempted: its blocks are freed and it
goes back to the front of the queue, to be recomputed (outputs do not
change: greedy is deterministic and sampling is keyed by position).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from specray.actors.kv_cache import BlockAllocator, BlockTable
from specray.request import Request, Status


@dataclass
class DecodeItem:
    request: Request
    block_len: int  # rows verified: the last token + block_len-1 drafts


@dataclass
class PrefillItem:
    request: Request
    start: int
    end: int

    @property
    def is_last_chunk(self) -> bool:
        return self.end == self.request.prefill_len

    @property
    def samples_first_token(self) -> bool:
        """The last chunk of a prompt with no output yet: its last row gives
        the request's first token (a resumed request's re-prefill gives none)."""
        return self.is_last_chunk and not self.request.output_token_ids


@dataclass
class StepPlan:
    decode: list[DecodeItem] = field(default_factory=list)
    prefill: list[PrefillItem] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill

    @property
    def num_tokens(self) -> int:
        return sum(d.block_len for d in self.decode) + sum(p.end - p.start for p in self.prefill)


class Scheduler:
    def __init__(
        self,
        target_pool: BlockAllocator,
        draft_pool: BlockAllocator | None,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
    ):
        self.target_pool = target_pool
        self.draft_pool = draft_pool
        self.block_size = block_size  # speculative block B (1 without a drafter)
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max(max_num_batched_tokens, block_size)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    # ------------------------------------------------------------ lifecycle
    def add(self, req: Request) -> None:
        req.target_blocks = BlockTable(self.target_pool)
        req.draft_blocks = BlockTable(self.draft_pool) if self.draft_pool else None
        self.waiting.append(req)

    def finish(self, req: Request, reason: str) -> None:
        if req.status == Status.RUNNING:
            self.running.remove(req)
        elif req.status == Status.WAITING:
            self.waiting.remove(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        self._free(req)

    def _free(self, req: Request) -> None:
        req.target_blocks.free()
        if req.draft_blocks is not None:
            req.draft_blocks.free()
        req.num_computed = 0

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def emit_budget(self, req: Request) -> int:
        """Tokens this request may still emit (max_tokens and the model's
        length both bound it)."""
        return min(
            req.params.max_tokens - len(req.output_token_ids),
            self.max_model_len - req.num_tokens,
        )

    def block_len(self, req: Request) -> int:
        """Rows a decode step verifies for ``req``: its last token and up to
        block_size - 1 drafts, no more than it may still emit."""
        return min(self.block_size, self.emit_budget(req) + 1)

    # ------------------------------------------------------------- planning
    def reserve(self, req: Request, num_positions: int) -> bool:
        """Room for ``num_positions`` in both pools, or False (and nothing
        taken)."""
        t, d = req.target_blocks, req.draft_blocks
        if not t.can_reserve(num_positions) or (d is not None and not d.can_reserve(num_positions)):
            return False
        t.reserve(num_positions)
        if d is not None:
            d.reserve(num_positions)
        return True

    def _preempt_last(self, plan: StepPlan) -> Request:
        victim = self.running.pop()
        self._free(victim)
        victim.status = Status.WAITING
        victim.metrics.num_preemptions += 1
        self.waiting.appendleft(victim)
        plan.preempted.append(victim)
        plan.decode = [d for d in plan.decode if d.request is not victim]
        plan.prefill = [p for p in plan.prefill if p.request is not victim]
        return victim

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.max_num_batched_tokens
        # Decoding requests, oldest first.
        for req in list(self.running):
            if req.status != Status.RUNNING or req.is_prefilling:
                continue
            block_len = self.block_len(req)
            if block_len > budget:
                break
            while not self.reserve(req, req.num_computed + block_len):
                if self._preempt_last(plan) is req:
                    break
            if req.status != Status.RUNNING:
                continue
            plan.decode.append(DecodeItem(req, block_len))
            budget -= block_len
        # Prefill chunks of admitted requests, then new admissions.
        for req in [r for r in self.running if r.is_prefilling]:
            if budget <= 0:
                break
            item = self._plan_prefill(req, budget)
            if item is None:
                break
            plan.prefill.append(item)
            budget -= item.end - item.start
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not plan.preempted:
            req = self.waiting[0]
            item = self._plan_prefill(req, budget)
            if item is None:
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            plan.prefill.append(item)
            budget -= item.end - item.start
        return plan

    def _prefill_end(self, req: Request, budget: int) -> int | None:
        """Where ``req``'s next prefill chunk would end within ``budget``, or
        None when it does not fit."""
        start = req.num_computed
        end = min(req.prefill_len, start + budget)
        if end <= start:
            return None
        # Admit only with room for the first decode block as well, so that a
        # new request does not at once push an older one out.
        t, d = req.target_blocks, req.draft_blocks
        headroom = min(end + self.block_size, self.max_model_len)
        if not t.can_reserve(headroom) or (d is not None and not d.can_reserve(headroom)):
            return None
        return end

    def _plan_prefill(self, req: Request, budget: int) -> PrefillItem | None:
        end = self._prefill_end(req, budget)
        if end is None:
            return None
        start = req.num_computed
        self.reserve(req, end)
        return PrefillItem(req, start, end)

    def could_admit(self, decode_tokens: int) -> bool:
        """Whether scheduling now would admit the head of the queue beside
        ``decode_tokens`` rows of decode blocks."""
        if not self.waiting or len(self.running) >= self.max_num_seqs:
            return False
        return self._prefill_end(self.waiting[0], self.max_num_batched_tokens - decode_tokens) is not None

    def fits_whole(self, req: Request) -> bool:
        """Whether ``req``'s whole prompt fits one step of its own, with
        room for its first decode block (``admit_whole``)."""
        return self._prefill_end(req, self.max_num_batched_tokens) == req.prefill_len

    def admit_whole(self) -> PrefillItem:
        """Admit the head of the queue, its whole prompt in one chunk (a
        request joining a running chain: chain_admit.py); ``fits_whole``
        said it may."""
        req = self.waiting.popleft()
        req.status = Status.RUNNING
        self.running.append(req)
        item = self._plan_prefill(req, self.max_num_batched_tokens)
        assert item is not None and item.is_last_chunk, "admit_whole without fits_whole"
        return item

    def commit(self, req: Request, num_computed: int, keep: int | None = None) -> None:
        """After a step: ``num_computed`` positions are valid; roll back the
        rest (rejected draft rows), keeping room for ``keep`` positions (a
        step still in flight writes up to there)."""
        req.num_computed = num_computed
        keep = num_computed if keep is None else max(keep, num_computed)
        req.target_blocks.trim(keep)
        if req.draft_blocks is not None:
            req.draft_blocks.trim(keep)
