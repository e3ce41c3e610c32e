"""The index arithmetic around a whole-step graph's model passes
(actors/step_graph.py), as PyTorch references for ``step_glue_triton``.

Before the passes a step derives, per row, its block's positions, cache
slots, length and input ids from the row's start; after them it accepts a
prefix of the drafts, writes what it emitted, and moves the row's start,
last token and emit budget on. Written with PyTorch ops that is a few
dozen elementwise kernels of ~1 us each (plus the gaps between them), at
batch 1 a good part of what a speculative step adds to an autoregressive
one; on the GPU each side is one kernel (H200, batch 1: speculative step
1.20 -> 1.13 ms, autoregressive 0.95 -> 0.92 ms, results/archive/step_kernels/README.md, "Step glue").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class BlockInputs:
    """Per row ``s`` of a step whose blocks start at ``start[s]``."""

    positions: torch.Tensor  # [S, B] int64: start .. start + B - 1
    target_slots: torch.Tensor  # [S, B] int64: their target cache slots
    draft_slots: torch.Tensor | None  # [S, B] int64: their drafter cache slots
    block_len: torch.Tensor  # [S] int64: rows the block verifies, 1..B (cut by the emit budget)
    block_ids: torch.Tensor  # [S, B] int64: the drafter's block, [last, mask x (B - 1)]
    seq_lens: torch.Tensor  # [S] int64: start + B
    known_lens: torch.Tensor  # [S] int64: start + 1, the tokens known (context and last)


def slots_of(tables: torch.Tensor, positions: torch.Tensor, kv_block_size: int) -> torch.Tensor:
    """Cache slot of each position ``[S, n]`` through block tables ``[S, W]``."""
    blocks = tables.gather(1, torch.div(positions, kv_block_size, rounding_mode="floor")).long()
    return blocks * kv_block_size + positions % kv_block_size


def block_inputs_ref(start, last, budget, target_tables, draft_tables, block_size: int, kv_block_size: int,
                     mask_token_id: int) -> BlockInputs:
    """``start``, ``last``, ``budget`` ``[S]`` int64 (``budget``: tokens the
    row may still emit), tables ``[S, W]`` int32 (``draft_tables`` None
    without a drafter)."""
    B = block_size
    positions = start[:, None] + torch.arange(B, device=start.device)
    block_ids = torch.cat([last[:, None], torch.full((len(start), B - 1), mask_token_id, dtype=torch.int64,
                                                     device=start.device)], 1)
    return BlockInputs(
        positions=positions,
        target_slots=slots_of(target_tables, positions, kv_block_size),
        draft_slots=None if draft_tables is None else slots_of(draft_tables, positions, kv_block_size),
        block_len=(budget + 1).clamp(1, B),
        block_ids=block_ids,
        seq_lens=start + B,
        known_lens=start + 1,
    )


def accept_advance_ref(argmax, num_accepted, bonus, drafts, block_len, looked_up, draft_slots, start, last,
                       budget, real, history=None, history_rows=None):
    """Finish a step. Greedy (``argmax`` ``[S, B]``: the target's argmax at
    each block row): a row accepts its drafts ``[S, B - 1]`` while they equal
    the argmax, up to its ``block_len - 1``, and the bonus is the argmax after
    them; otherwise ``num_accepted`` and ``bonus`` ``[S]`` come from
    ``sampling.verify``. Then, in place: ``start`` += accepted + 1 and ``last``
    = bonus for real rows (padding rows restart at 0), ``budget`` -=
    accepted + 1, and with ``history`` ``[R, L]`` the emitted tokens are
    written at positions ``start + 1 ..`` of row ``history_rows[s]``.

    Returns ``out`` ``[S, B + 2]`` (accepted, bonus, drafted by lookup,
    drafts) and, with ``draft_slots``, the drafter's context slots
    ``[S, B]``: the block's last token and accepted drafts keep theirs, the
    rest go to the reserved slot 0."""
    S, G = drafts.shape
    B = G + 1
    rows_arange = torch.arange(B, device=drafts.device)
    if argmax is not None:
        match = (drafts == argmax[:, :G]) & (rows_arange[None, :G] < (block_len - 1)[:, None])
        num_accepted = match.int().cumprod(-1).sum(-1)
        bonus = argmax.gather(1, num_accepted[:, None]).squeeze(1)
    num_accepted, bonus = num_accepted.long(), bonus.long()
    store_slots = None
    if draft_slots is not None:
        store_slots = torch.where(rows_arange[None] <= num_accepted[:, None], draft_slots, 0)
    if history is not None:
        # Positions start + 1 .. start + B: the accepted drafts, then the
        # bonus (what lies past it is rewritten before it is read).
        emitted = torch.where(rows_arange[None] < num_accepted[:, None], torch.cat([drafts, bonus[:, None]], 1),
                              bonus[:, None])
        history.index_put_((history_rows[:, None].expand(S, B), start[:, None] + 1 + rows_arange), emitted)
    out = torch.cat([num_accepted[:, None], bonus[:, None], looked_up[:, None].long(), drafts], 1)
    start.copy_(torch.where(real, start + num_accepted + 1, 0))
    last.copy_(torch.where(real, bonus, 0))
    budget -= num_accepted + 1
    return out, store_slots
