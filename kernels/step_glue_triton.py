"""Triton kernels for a step graph's index arithmetic (``step_glue`` holds
the PyTorch references they are tested against): one program per row, one
kernel before the model passes and one after."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specray.kernels.step_glue import BlockInputs


@triton.jit
def _block_inputs_kernel(start_ptr, last_ptr, budget_ptr, tt_ptr, tt_stride, dt_ptr, dt_stride,
                         pos_ptr, tslot_ptr, dslot_ptr, block_len_ptr, ids_ptr, seq_lens_ptr, known_ptr,
                         MASK_ID, B: tl.constexpr, KVB: tl.constexpr, BLOCK: tl.constexpr,
                         HAS_DRAFTER: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    m = i < B
    start = tl.load(start_ptr + r)
    pos = start + i
    blk = pos // KVB
    off = pos % KVB
    tl.store(pos_ptr + r * B + i, pos, mask=m)
    t = tl.load(tt_ptr + r * tt_stride + blk, mask=m, other=0).to(tl.int64)
    tl.store(tslot_ptr + r * B + i, t * KVB + off, mask=m)
    if HAS_DRAFTER:
        d = tl.load(dt_ptr + r * dt_stride + blk, mask=m, other=0).to(tl.int64)
        tl.store(dslot_ptr + r * B + i, d * KVB + off, mask=m)
    last = tl.load(last_ptr + r)
    tl.store(ids_ptr + r * B + i, tl.where(i == 0, last, MASK_ID), mask=m)
    budget = tl.load(budget_ptr + r)
    tl.store(block_len_ptr + r, tl.minimum(tl.maximum(budget + 1, 1), B))
    tl.store(seq_lens_ptr + r, start + B)
    tl.store(known_ptr + r, start + 1)


def block_inputs(start, last, budget, target_tables, draft_tables, block_size: int, kv_block_size: int,
                 mask_token_id: int) -> BlockInputs:
    S, B = start.shape[0], block_size
    dev = start.device
    start, last, budget = start.contiguous(), last.contiguous(), budget.contiguous()  # read at stride 1

    def i64(*shape):
        return torch.empty(*shape, dtype=torch.int64, device=dev)

    res = BlockInputs(i64(S, B), i64(S, B), None if draft_tables is None else i64(S, B), i64(S), i64(S, B),
                      i64(S), i64(S))
    if S:
        dt = target_tables if draft_tables is None else draft_tables
        _block_inputs_kernel[(S,)](
            start, last, budget, target_tables, target_tables.stride(0), dt, dt.stride(0), res.positions,
            res.target_slots, res.target_slots if res.draft_slots is None else res.draft_slots, res.block_len,
            res.block_ids, res.seq_lens, res.known_lens, mask_token_id, B=B, KVB=kv_block_size,
            BLOCK=max(16, triton.next_power_of_2(B)), HAS_DRAFTER=draft_tables is not None)
    return res


@triton.jit
def _accept_advance_kernel(argmax_ptr, n_in_ptr, bonus_in_ptr, drafts_ptr, block_len_ptr, looked_up_ptr,
                           dslot_ptr, start_ptr, last_ptr, budget_ptr, real_ptr, hist_ptr, hist_stride,
                           hist_rows_ptr, out_ptr, store_ptr, B: tl.constexpr, G: tl.constexpr,
                           BLOCK: tl.constexpr, GREEDY: tl.constexpr, HAS_DRAFTER: tl.constexpr,
                           HISTORY: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    dm = i < G
    drafts = tl.load(drafts_ptr + r * G + i, mask=dm, other=-1).to(tl.int64)
    if GREEDY:
        am = tl.load(argmax_ptr + r * B + i, mask=i < B, other=0).to(tl.int64)
        nd = tl.load(block_len_ptr + r) - 1
        match = (drafts == am) & (i < nd) & dm
        # The first row that does not match (lanes from G on never do): the
        # number of leading matches.
        n = tl.min(tl.where(match, BLOCK, i), axis=0).to(tl.int64)
        bonus = tl.sum(tl.where(i == n, am, 0), axis=0)
    else:
        n = tl.load(n_in_ptr + r).to(tl.int64)
        bonus = tl.load(bonus_in_ptr + r).to(tl.int64)
    start = tl.load(start_ptr + r)
    if HAS_DRAFTER:
        ds = tl.load(dslot_ptr + r * B + i, mask=i < B, other=0)
        tl.store(store_ptr + r * B + i, tl.where(i <= n, ds, 0), mask=i < B)
    if HISTORY:
        row = tl.load(hist_rows_ptr + r)
        tl.store(hist_ptr + row * hist_stride + start + 1 + i, tl.where(i < n, drafts, bonus), mask=i < B)
    o = out_ptr + r * (B + 2)
    tl.store(o, n)
    tl.store(o + 1, bonus)
    tl.store(o + 2, tl.load(looked_up_ptr + r).to(tl.int64))
    tl.store(o + 3 + i, drafts, mask=dm)
    real = tl.load(real_ptr + r) != 0
    tl.store(start_ptr + r, tl.where(real, start + n + 1, 0))
    tl.store(last_ptr + r, tl.where(real, bonus, 0))
    tl.store(budget_ptr + r, tl.load(budget_ptr + r) - n - 1)


def accept_advance(argmax, num_accepted, bonus, drafts, block_len, looked_up, draft_slots, start, last, budget,
                   real, history=None, history_rows=None):
    S, G = drafts.shape
    B = G + 1
    dev = drafts.device
    # The kernel reads and writes each row at stride 1. A separate drafter
    # passes the acceptance as columns of rank 0's packed result (strided):
    # read as they were, rows past the first took other rows' fields.
    for name, t in (("start", start), ("last", last), ("budget", budget)):
        if not t.is_contiguous():
            raise ValueError(f"accept_advance updates {name} in place: it must be contiguous")
    num_accepted, bonus, block_len, looked_up, real = (
        None if t is None else t.contiguous() for t in (num_accepted, bonus, block_len, looked_up, real))
    if draft_slots is not None:
        draft_slots = draft_slots.contiguous()
    if history_rows is not None:
        history_rows = history_rows.contiguous()
    out = torch.empty(S, B + 2, dtype=torch.int64, device=dev)
    store = None if draft_slots is None else torch.empty(S, B, dtype=torch.int64, device=dev)
    if S:
        greedy = argmax is not None
        any_i64 = start  # stands in for pointers a variant does not read
        _accept_advance_kernel[(S,)](
            argmax.contiguous() if greedy else any_i64, any_i64 if greedy else num_accepted,
            any_i64 if greedy else bonus,
            drafts.contiguous(), block_len, looked_up.view(torch.uint8), any_i64 if store is None else draft_slots,
            start, last, budget, real.view(torch.uint8), any_i64 if history is None else history,
            0 if history is None else history.stride(0), any_i64 if history is None else history_rows, out,
            out if store is None else store, B=B, G=G, BLOCK=max(16, triton.next_power_of_2(B)), GREEDY=greedy,
            HAS_DRAFTER=store is not None, HISTORY=history is not None)
    return out, store
