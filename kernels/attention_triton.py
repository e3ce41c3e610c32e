"""Triton kernels for the two attention shapes of ``attention.py``.

Both are FlashAttention-2 style: one program owns a tile of query rows of one
sequence and one KV head, loops over KV tiles gathered through the block table
and keeps an online softmax in fp32. The rows of a tile are
``(query token, q head of the GQA group)`` pairs, so a decode step (one token)
still fills a 16-row ``tl.dot`` with the group's heads (padded rows are
masked). The KV range can be split over ``num_splits`` programs (small
batches: decode, verify, DFlash propose), each taking every
``num_splits``-th KV tile; each split then writes its partial
``(max, sum, acc)`` and ``_combine_kernel`` merges them.

Graph capture: the grid and every constexpr depend only on Python ints and
shapes; sequence lengths, block tables and query offsets are read inside the
kernels (no host sync), so one capture stays correct for new contents as long
as no sequence has more query rows than the captured ``max_query_len`` (the
grid's q tiles). ``max_seq_len`` / ``max_ctx_len`` only choose the number of
KV splits; each program loops to its own sequence's length.

Output rows that no sequence owns (``num_tokens > query_start_loc[-1]``) are
not computed: their contents are undefined.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

_NEG = tl.constexpr(-1.0e30)  # finite "minus infinity": keeps (m_old - m_new) NaN-free
_LOG2E = 1.4426950408889634


# --------------------------------------------------------------------------
# shared device helpers


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:  # fp32 inputs: exact fp32 products, not tf32
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _softmax_step(q, k, v, visible, m_i, l_i, acc, qk_scale, IEEE: tl.constexpr):
    """One online-softmax update with a ``[BLOCK_N, D]`` K/V tile; scores in
    the log2 domain (``qk_scale`` includes log2(e))."""
    s = _dot(q, tl.trans(k), IEEE) * qk_scale
    s = tl.where(visible, s, _NEG)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.where(visible, tl.exp2(s - m_new[:, None]), 0.0)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
    return m_new, l_i, acc


@triton.jit
def _load_paged_kv(
    k_cache, v_cache, bt_row, kv_head, kpos, kv_ok, offs_d, d_ok, dtype: tl.constexpr,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    BLOCK_SIZE: tl.constexpr,
):
    """K and V ``[BLOCK_N, D]`` at logical positions ``kpos`` of one
    sequence (``bt_row`` points at its block-table row). Positions with
    ``kv_ok`` false load zeros (and read block 0 of the table, never past it)."""
    blk = tl.load(bt_row + kpos // BLOCK_SIZE, mask=kv_ok, other=0).to(tl.int64)
    off = kpos % BLOCK_SIZE
    ld_mask = kv_ok[:, None] & d_ok[None, :]
    k_off = blk * stride_kb + off * stride_kt + kv_head * stride_kh
    v_off = blk * stride_vb + off * stride_vt + kv_head * stride_vh
    k = tl.load(k_cache + k_off[:, None] + offs_d[None, :] * stride_kd, mask=ld_mask, other=0.0)
    v = tl.load(v_cache + v_off[:, None] + offs_d[None, :] * stride_vd, mask=ld_mask, other=0.0)
    return k.to(dtype), v.to(dtype)


@triton.jit
def _split_tiles(lo, split, num_splits, BLOCK_N: tl.constexpr):
    """First key and stride of this split's KV tiles in ``[lo, hi)``: the
    tiles whose index is ``split`` modulo ``num_splits``. Which split owns a
    tile depends on the tile alone, not on how far the program's keys
    reach, so a query row meets its keys in the same partial sums whether
    it comes alone (a decode step) or in a verify block whose later rows
    see further (those extra tiles are masked out for it: exact no-ops)."""
    first_tile = lo // BLOCK_N
    first_tile += (split - first_tile % num_splits + num_splits) % num_splits
    return first_tile * BLOCK_N, num_splits * BLOCK_N


@triton.jit
def _finish(
    acc, m_i, l_i, out_row, row_ok, offs_d, d_ok, out_ptr, part_acc, part_m, part_l,
    split, num_rows, HEAD_DIM: tl.constexpr, SPLIT: tl.constexpr,
):
    """Write normalised rows (one split) or this split's partials.
    ``out_row`` indexes the contiguous ``[rows, HEAD_DIM]`` output."""
    mask = row_ok[:, None] & d_ok[None, :]
    if not SPLIT:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / l_safe[:, None]
        tl.store(out_ptr + out_row[:, None] * HEAD_DIM + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        prow = split.to(tl.int64) * num_rows + out_row
        tl.store(part_acc + prow[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=mask)
        tl.store(part_m + prow, m_i, mask=row_ok)
        tl.store(part_l + prow, l_i, mask=row_ok)


@triton.jit(do_not_specialize=["num_rows", "num_splits"])
def _combine_kernel(
    out_ptr, part_acc, part_m, part_l, num_rows, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Merge the per-split partials of one output row."""
    row = tl.program_id(0).to(tl.int64)
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    sp_ok = sp < num_splits
    m = tl.load(part_m + sp * num_rows + row, mask=sp_ok, other=_NEG)
    l = tl.load(part_l + sp * num_rows + row, mask=sp_ok, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.where(sp_ok, tl.exp2(m - m_max), 0.0)
    acc = tl.load(part_acc + (sp[:, None] * num_rows + row) * HEAD_DIM + d[None, :],
                  mask=sp_ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    num = tl.sum(acc * w[:, None], 0)
    den = tl.sum(l * w, 0)
    den = tl.where(den > 0.0, den, 1.0)
    tl.store(out_ptr + row * HEAD_DIM + d, (num / den).to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


# --------------------------------------------------------------------------
# target attention: varlen causal queries over the paged cache


_RUNTIME_INTS = ["window", "num_rows", "num_splits"]  # no recompiles per value


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _paged_attention_kernel(
    q_ptr, k_cache, v_cache, out_ptr, part_acc, part_m, part_l,
    query_start_loc, seq_lens, block_tables, tree_depth, tree_rows,
    qk_scale, window, num_rows, num_splits,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_bt,
    Q_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_TREE: tl.constexpr, TREE_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr,
):
    q_tile = tl.program_id(0)
    seq = tl.program_id(1)
    pid2 = tl.program_id(2)
    kv_head = pid2 // num_splits
    split = pid2 % num_splits

    q_start = tl.load(query_start_loc + seq)
    q_len = tl.load(query_start_loc + seq + 1) - q_start
    seq_len = tl.load(seq_lens + seq)
    t0 = q_tile * BLOCK_Q
    if t0 >= q_len:
        return
    ctx_len = seq_len - q_len

    # rows = (token t0 + r // GROUP, head kv_head * GROUP + r % GROUP)
    r = tl.arange(0, BLOCK_M)
    tok = t0 + r // GROUP
    head = kv_head * GROUP + r % GROUP
    row_ok = (r < BLOCK_Q * GROUP) & (tok < q_len)
    q_pos = ctx_len + tok
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q_tok = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + (q_tok * stride_qt + head * stride_qh)[:, None] + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    # A draft-tree row (one token a program) sits at its depth, and its
    # keys past the context are its ancestors, in depth order: the very
    # tiles, lanes and splits of a decode step of that token, so the same bits.
    is_tree = False
    if HAS_TREE:
        tok0 = (q_start + t0).to(tl.int64)
        depth = tl.load(tree_depth + tok0)
        is_tree = depth >= 0
        q_pos = tl.where(is_tree, ctx_len + depth, q_pos)

    # keys this tile can see: [lo, hi), causal to the tile's last row
    hi = ctx_len + tl.minimum(t0 + BLOCK_Q, q_len)
    if HAS_TREE:
        hi = tl.where(is_tree, ctx_len + depth + 1, hi)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(ctx_len + t0 - window + 1, 0)
    s_lo, step = _split_tiles(lo, split, num_splits, BLOCK_N)

    m_i = tl.full([BLOCK_M], _NEG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = block_tables + seq.to(tl.int64) * stride_bt
    for start in range(s_lo, hi, step):
        kpos = start + tl.arange(0, BLOCK_N)
        kv_ok = (kpos < hi) & (kpos >= lo)
        kphys = kpos
        if HAS_TREE:  # logical key position -> the new row holding it
            j = kpos - ctx_len
            anc = is_tree & (j >= 0) & kv_ok
            row = tl.load(tree_rows + tok0 * TREE_ROWS + tl.minimum(tl.maximum(j, 0), TREE_ROWS - 1),
                          mask=anc, other=0)
            kphys = tl.where(anc, ctx_len + row, kpos)
        k, v = _load_paged_kv(k_cache, v_cache, bt_row, kv_head, kphys, kv_ok, offs_d, d_ok, q.dtype,
                              stride_kb, stride_kt, stride_kh, stride_kd,
                              stride_vb, stride_vt, stride_vh, stride_vd, BLOCK_SIZE)
        visible = kv_ok[None, :] & (kpos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible = visible & (q_pos[:, None] - kpos[None, :] < window)
        m_i, l_i, acc = _softmax_step(q, k, v, visible, m_i, l_i, acc, qk_scale, IEEE)

    out_row = q_tok * Q_HEADS + head
    _finish(acc, m_i, l_i, out_row, row_ok, offs_d, d_ok, out_ptr, part_acc, part_m, part_l,
            split, num_rows, HEAD_DIM, SPLIT)


# --------------------------------------------------------------------------
# DFlash block attention: B queries over [paged context ; own block K/V]


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _dflash_block_attention_kernel(
    q_ptr, kb_ptr, vb_ptr, k_cache, v_cache, out_ptr, part_acc, part_m, part_l,
    ctx_lens, block_lens, block_tables,
    qk_scale, window, num_rows, num_splits,
    stride_qs, stride_qb, stride_qh, stride_qd,
    stride_kbs, stride_kbb, stride_kbh, stride_kbd,
    stride_vbs, stride_vbb, stride_vbh, stride_vbd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_bt,
    B: tl.constexpr, Q_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
    BLOCK_D: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr,
):
    q_tile = tl.program_id(0)
    seq = tl.program_id(1)
    pid2 = tl.program_id(2)
    kv_head = pid2 // num_splits
    split = pid2 % num_splits

    ctx_len = tl.load(ctx_lens + seq)
    blk_len = tl.load(block_lens + seq)
    t0 = q_tile * BLOCK_Q
    r = tl.arange(0, BLOCK_M)
    i = t0 + r // GROUP  # block row; it sits at position ctx_len + i
    head = kv_head * GROUP + r % GROUP
    row_ok = (r < BLOCK_Q * GROUP) & (i < B)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    seq64 = seq.to(tl.int64)
    q = tl.load(q_ptr + (seq64 * stride_qs + i * stride_qb + head * stride_qh)[:, None]
                + offs_d[None, :] * stride_qd, mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], _NEG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # context keys precede every block row: only the window limits them
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(ctx_len + t0 - window + 1, 0)
    s_lo, step = _split_tiles(lo, split, num_splits, BLOCK_N)
    bt_row = block_tables + seq64 * stride_bt
    for start in range(s_lo, ctx_len, step):
        kpos = start + tl.arange(0, BLOCK_N)
        kv_ok = (kpos < ctx_len) & (kpos >= lo)
        k, v = _load_paged_kv(k_cache, v_cache, bt_row, kv_head, kpos, kv_ok, offs_d, d_ok, q.dtype,
                              stride_kb, stride_kt, stride_kh, stride_kd,
                              stride_vb, stride_vt, stride_vh, stride_vd, BLOCK_SIZE)
        visible = kv_ok[None, :]
        if HAS_WINDOW:
            visible = visible & ((ctx_len + i)[:, None] - kpos[None, :] < window)
        m_i, l_i, acc = _softmax_step(q, k, v, visible, m_i, l_i, acc, qk_scale, IEEE)

    # the block's own keys (the last split takes them): delta = i - j
    if split == num_splits - 1:
        j = tl.arange(0, BLOCK_B)
        j_ok = j < tl.minimum(blk_len, B)
        ld_mask = j_ok[:, None] & d_ok[None, :]
        k = tl.load(kb_ptr + (seq64 * stride_kbs + j * stride_kbb + kv_head * stride_kbh)[:, None]
                    + offs_d[None, :] * stride_kbd, mask=ld_mask, other=0.0).to(q.dtype)
        v = tl.load(vb_ptr + (seq64 * stride_vbs + j * stride_vbb + kv_head * stride_vbh)[:, None]
                    + offs_d[None, :] * stride_vbd, mask=ld_mask, other=0.0).to(q.dtype)
        delta = i[:, None] - j[None, :]
        visible = j_ok[None, :]
        if CAUSAL:
            visible = visible & (delta >= 0)
        if HAS_WINDOW:
            visible = visible & (delta < window)
            if not CAUSAL:
                visible = visible & (-delta < window)
        m_i, l_i, acc = _softmax_step(q, k, v, visible, m_i, l_i, acc, qk_scale, IEEE)

    out_row = (seq64 * B + i) * Q_HEADS + head
    _finish(acc, m_i, l_i, out_row, row_ok, offs_d, d_ok, out_ptr, part_acc, part_m, part_l,
            split, num_rows, HEAD_DIM, SPLIT)


# --------------------------------------------------------------------------
# launchers


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# Target launches of at most this many query tokens a sequence (decode
# steps, verify blocks) tile their queries as a one-token decode step does
# and split their KV as it does, so that each row's result is bit for bit
# a decode step's: greedy speculative output is then the autoregressive
# output in bf16 too, not only in exact arithmetic. (With 64-row tiles,
# the H200 gave 16-token verify blocks attention rows that differed from
# decode steps' in the last bits, enough to flip near-ties of the
# embedded 135M target.)
DECODE_SHAPED_MAX_QUERY = 64


def _tiles(q_rows: int, group: int, dtype: torch.dtype, head_dim: int, decode_shaped: bool = False):
    """(BLOCK_M, BLOCK_Q, BLOCK_N, BLOCK_D, num_warps) for tiles whose rows
    cover ``q_rows`` query tokens times the GQA group (one token's worth
    when ``decode_shaped``)."""
    fp32 = dtype == torch.float32
    max_m = 32 if fp32 else 128  # fp32 (ieee dot) runs on FMA: keep it small
    if decode_shaped:
        q_rows = 1
    block_m = min(max_m, max(16, triton.next_power_of_2(q_rows * group)))
    block_m = max(block_m, triton.next_power_of_2(group))  # at least one token per tile
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_n = 32 if fp32 or block_d > 128 else 64
    num_warps = 8 if block_m >= (32 if fp32 else 128) else 4
    return block_m, block_m // group, block_n, block_d, num_warps


def _pick_splits(programs: int, max_kv_len: int | None, block_n: int, device: torch.device) -> int:
    """Split the KV range when the grid alone would leave most SMs idle,
    keeping at least 4 KV tiles per split (``max_kv_len=None``: a count
    that depends on the grid alone)."""
    if device.type != "cuda":
        return 1
    target = 2 * _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    splits = min(16, triton.cdiv(target, max(programs, 1)))
    if max_kv_len is not None:
        splits = min(splits, triton.cdiv(triton.cdiv(max_kv_len, block_n), 4))
    return max(1, splits)


def _partials(num_splits: int, num_rows: int, head_dim: int, device):
    if num_splits == 1:
        dummy = torch.empty(1, dtype=torch.float32, device=device)
        return dummy, dummy, dummy
    return (
        torch.empty(num_splits, num_rows, head_dim, dtype=torch.float32, device=device),
        torch.empty(num_splits, num_rows, dtype=torch.float32, device=device),
        torch.empty(num_splits, num_rows, dtype=torch.float32, device=device),
    )


def _combine(out, parts, num_splits, num_rows, head_dim, block_d):
    if num_splits > 1:
        _combine_kernel[(num_rows,)](
            out, *parts, num_rows, num_splits, HEAD_DIM=head_dim, BLOCK_D=block_d,
            BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
            num_warps=4 if block_d >= 128 else 2,
        )


def tree_rows(tree_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(depth [T] int32, rows [T, 32] int32)`` of a tree mask: a row's depth
    (its set bits less one; -1 for a causal row) and the new rows it sees, in
    order (its ancestors by depth, itself last)."""
    dev = tree_mask.device
    bits = (tree_mask.long()[:, None] >> torch.arange(32, device=dev)) & 1  # [T, 32]
    rank = bits.cumsum(1) - 1
    # Unset bits write past the end (column 32 of a padded copy).
    padded = torch.zeros(bits.shape[0], 33, dtype=torch.int32, device=dev)
    padded.scatter_(1, torch.where(bits.bool(), rank, 32),
                    torch.arange(32, dtype=torch.int32, device=dev).expand(bits.shape[0], -1).contiguous())
    rows = padded[:, :32].contiguous()
    depth = torch.where(tree_mask == -1, -1, bits.sum(1) - 1).int()
    return depth, rows


def paged_attention(
    q, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
    max_query_len, max_seq_len, scale, sliding_window=None, tree_mask=None, *, num_splits=None, tree=None,
):
    """Triton twin of ``attention.paged_attention_ref`` (same arguments;
    ``num_splits`` overrides the KV-split heuristic; ``tree``: ``tree_rows``
    of ``tree_mask``, computed once for many launches)."""
    if tree_mask is not None and tree is None:
        tree = tree_rows(tree_mask)
    num_tokens, q_heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q_heads // kv_heads
    num_seqs = seq_lens.shape[0]
    out = torch.empty(num_tokens, q_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0 or max_query_len <= 0:
        return out
    decode_shaped = max_query_len <= DECODE_SHAPED_MAX_QUERY
    block_m, block_q, block_n, block_d, num_warps = _tiles(max_query_len, group, q.dtype, head_dim, decode_shaped)
    if tree is not None:
        block_q = 1  # a tree row gathers keys of its own
    n_qt = triton.cdiv(max_query_len, block_q)
    if decode_shaped:  # the split count a decode step of these sequences gets
        ns = num_splits or _pick_splits(num_seqs * kv_heads, None, block_n, q.device)
    else:
        ns = num_splits or _pick_splits(n_qt * num_seqs * kv_heads, max_seq_len, block_n, q.device)
    num_rows = num_tokens * q_heads
    parts = _partials(ns, num_rows, head_dim, q.device)
    _paged_attention_kernel[(n_qt, num_seqs, kv_heads * ns)](
        q, k_cache, v_cache, out, *parts,
        query_start_loc, seq_lens, block_tables, *(tree if tree is not None else (seq_lens, seq_lens)),
        float(scale) * _LOG2E, int(sliding_window or 0), num_rows, ns,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), block_tables.stride(0),
        Q_HEADS=q_heads, GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        HAS_WINDOW=sliding_window is not None, HAS_TREE=tree is not None,
        TREE_ROWS=tree[1].shape[1] if tree is not None else 1,
        BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n, BLOCK_D=block_d,
        SPLIT=ns > 1, IEEE=q.dtype == torch.float32,
        num_warps=num_warps, num_stages=2,
    )
    _combine(out, parts, ns, num_rows, head_dim, block_d)
    return out


def dflash_block_attention(
    q, k_block, v_block, k_cache, v_cache, ctx_lens, block_tables, max_ctx_len,
    block_lens, scale, causal, sliding_window=None, *, num_splits=None,
):
    """Triton twin of ``attention.dflash_block_attention_ref``."""
    num_seqs, B, q_heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q_heads // kv_heads
    out = torch.empty(num_seqs, B, q_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_seqs == 0 or B == 0:
        return out
    block_m, block_q, block_n, block_d, num_warps = _tiles(B, group, q.dtype, head_dim)
    n_qt = triton.cdiv(B, block_q)
    ns = num_splits or _pick_splits(n_qt * num_seqs * kv_heads, max_ctx_len, block_n, q.device)
    num_rows = num_seqs * B * q_heads
    parts = _partials(ns, num_rows, head_dim, q.device)
    _dflash_block_attention_kernel[(n_qt, num_seqs, kv_heads * ns)](
        q, k_block, v_block, k_cache, v_cache, out, *parts,
        ctx_lens, block_lens, block_tables,
        float(scale) * _LOG2E, int(sliding_window or 0), num_rows, ns,
        *q.stride(), *k_block.stride(), *v_block.stride(),
        *k_cache.stride(), *v_cache.stride(), block_tables.stride(0),
        B=B, Q_HEADS=q_heads, GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        CAUSAL=bool(causal), HAS_WINDOW=sliding_window is not None,
        BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n,
        BLOCK_B=max(16, triton.next_power_of_2(B)), BLOCK_D=block_d,
        SPLIT=ns > 1, IEEE=q.dtype == torch.float32,
        num_warps=num_warps, num_stages=2,
    )
    _combine(out, parts, ns, num_rows, head_dim, block_d)
    return out
