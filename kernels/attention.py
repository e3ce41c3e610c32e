"""Paged attention, PyTorch references.

Two attention shapes exist in specray:

* target attention: variable-length causal attention of new query tokens over a
  paged KV cache that already holds them (prefill chunks and verify blocks in
  one batch);
* DFlash block attention: a fixed-size block of queries per request over
  [paged context KV ; the block's own K/V], non-causal inside the block (or
  causal with a sliding window, per drafter layer).

Cache layout: ``[num_blocks, block_size, num_kv_heads, head_dim]`` per layer
for K and for V. A slot is ``block_id * block_size + offset``.

These functions are the numerical references. GPU kernels take the same
arguments and are tested against them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``k``/``v`` ``[num_tokens, kv_heads, head_dim]`` into the paged
    caches at ``slot_mapping`` ``[num_tokens]``. Padding rows point into
    block 0, which the allocators never hand out."""
    kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_paged(
    cache: torch.Tensor, block_tables: torch.Tensor, max_len: int
) -> torch.Tensor:
    """``[num_seqs, max_len, kv_heads, head_dim]`` view-copy of each
    sequence's first ``max_len`` cached positions (rows past a sequence's
    length hold whatever its block table points at; callers mask them)."""
    block_size = cache.shape[1]
    pos = torch.arange(max_len, device=cache.device)
    blocks = block_tables[:, pos // block_size].long()
    slots = blocks * block_size + pos % block_size
    flat = cache.view(-1, *cache.shape[2:])
    return flat[slots]


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    sliding_window: int | None = None,
    tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of ``q`` ``[num_tokens, q_heads, head_dim]`` over the
    paged cache.

    Sequence ``s`` owns query rows ``query_start_loc[s]:query_start_loc[s+1]``;
    those are its last ``q_len`` positions, so row ``i`` sits at absolute
    position ``seq_lens[s] - q_len + i`` and sees keys ``<=`` that position.
    The cache must already hold the K/V of the query tokens.

    ``tree_mask`` ``[num_tokens]`` int32 narrows what a row sees among its
    sequence's new rows to those whose bit is set (a draft tree's anchor
    and ancestors: draft_tree.py); -1 leaves it causal.
    """
    num_tokens, q_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    device = q.device
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    seq_of_token = torch.repeat_interleave(
        torch.arange(num_seqs, device=device), q_lens, output_size=num_tokens
    )
    row_of_token = torch.arange(num_tokens, device=device) - query_start_loc[seq_of_token]

    q_pad = q.new_zeros(num_seqs, max_query_len, q_heads, head_dim)
    q_pad[seq_of_token, row_of_token] = q
    k = gather_paged(k_cache, block_tables, max_seq_len).to(q.dtype)
    v = gather_paged(v_cache, block_tables, max_seq_len).to(q.dtype)

    q_pos = (seq_lens - q_lens)[:, None] + torch.arange(max_query_len, device=device)[None]
    k_pos = torch.arange(max_seq_len, device=device)[None]
    visible = (k_pos[:, None, :] <= q_pos[:, :, None]) & (k_pos < seq_lens[:, None])[:, None, :]
    if sliding_window is not None:
        visible &= q_pos[:, :, None] - k_pos[:, None, :] < sliding_window
    if tree_mask is not None:
        bits = torch.full((num_seqs, max_query_len), -1, dtype=torch.int64, device=device)
        bits[seq_of_token, row_of_token] = tree_mask.long()
        j = k_pos[:, None, :] - (seq_lens - q_lens)[:, None, None]  # key's index among the new rows
        seen = ((bits[:, :, None] >> j.clamp(0, 31)) & 1).bool() | (bits[:, :, None] == -1)
        visible &= (j < 0) | seen

    out = F.scaled_dot_product_attention(
        q_pad.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=visible[:, None],
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(1, 2)[seq_of_token, row_of_token]


def dflash_block_attention_ref(
    q: torch.Tensor,
    k_block: torch.Tensor,
    v_block: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    ctx_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_ctx_len: int,
    block_lens: torch.Tensor,
    scale: float,
    causal: bool,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Attention of a draft block over [context KV ; block KV].

    ``q`` ``[num_seqs, B, q_heads, head_dim]``, ``k_block``/``v_block``
    ``[num_seqs, B, kv_heads, head_dim]`` (RoPE applied), the context of
    sequence ``s`` is its first ``ctx_lens[s]`` cached positions, and only its
    first ``block_lens[s]`` block rows are real (the rest are masked out as
    keys). Block row ``i`` sits at position ``ctx_lens[s] + i``.
    Returns ``[num_seqs, B, q_heads, head_dim]``.
    """
    num_seqs, block, q_heads, head_dim = q.shape
    device = q.device
    k_ctx = gather_paged(k_cache, block_tables, max_ctx_len).to(q.dtype)
    v_ctx = gather_paged(v_cache, block_tables, max_ctx_len).to(q.dtype)
    k = torch.cat([k_ctx, k_block.to(q.dtype)], dim=1)
    v = torch.cat([v_ctx, v_block.to(q.dtype)], dim=1)

    rows = torch.arange(block, device=device)
    ctx_idx = torch.arange(max_ctx_len, device=device)
    # Absolute positions of every key, and whether it exists.
    k_pos = torch.cat(
        [ctx_idx[None].expand(num_seqs, -1), ctx_lens[:, None] + rows[None]], dim=1
    )
    k_real = torch.cat(
        [ctx_idx[None] < ctx_lens[:, None], rows[None] < block_lens[:, None]], dim=1
    )
    q_pos = ctx_lens[:, None] + rows[None]
    visible = k_real[:, None, :].expand(-1, block, -1).clone()
    delta = q_pos[:, :, None] - k_pos[:, None, :]
    if causal:
        visible &= delta >= 0
    if sliding_window is not None:
        visible &= delta < sliding_window
        if not causal:
            visible &= -delta < sliding_window

    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=visible[:, None],
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(1, 2)
