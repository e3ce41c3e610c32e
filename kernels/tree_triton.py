"""Triton twin of ``tree.build_tree_ref``: one program per row builds its
draft tree in registers (about forty small PyTorch kernels otherwise, most
of a tree step's added time at batch 1 on the H200)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _build_tree_kernel(lp_ptr, ids_ptr, pidx_ptr, aidx_ptr, depth_ptr, rank_ptr, parent_ptr, lookup_ptr, has_ptr,
                       scratch_ptr, tok_ptr, par_ptr, dep_ptr, mask_ptr, U,
                       GK: tl.constexpr, K: tl.constexpr, D: tl.constexpr, N: tl.constexpr, L: tl.constexpr,
                       BLOCK_U: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr):
    s = tl.program_id(0).to(tl.int64)
    u = tl.arange(0, BLOCK_U)
    u_ok = u < U
    d = tl.arange(0, BLOCK_D)
    ud_ok = u_ok[:, None] & (d < D)[None, :]
    pidx = tl.load(pidx_ptr + u[:, None] * D + d[None, :], mask=ud_ok, other=-1)
    lp = tl.load(lp_ptr + s * GK + tl.maximum(pidx, 0), mask=pidx >= 0, other=0.0)
    depth = tl.load(depth_ptr + u, mask=u_ok, other=1)
    score = tl.sum(lp, 1) - 1e-4 * depth.to(tl.float32)
    score = tl.where(u_ok, score, float("-inf"))
    n_keep = N
    if L > 0:
        has = tl.load(has_ptr + s)
        n_keep = tl.where(has != 0, N - L, N)
    # The best n_keep paths: the highest score first, ties to the lower index.
    kept = u < 0
    for n in range(N):
        m = tl.max(score, 0)
        first = tl.min(tl.where(score == m, u, BLOCK_U), 0)
        kept = kept | ((u == first) & (n < n_keep))
        score = tl.where(u == first, float("-inf"), score)
    kept_i = kept.to(tl.int32)
    row_of = tl.cumsum(kept_i, 0) * kept_i  # block row of each kept path, in universe order
    tl.store(scratch_ptr + s * BLOCK_U + u, row_of)
    tl.debug_barrier()
    rank = tl.load(rank_ptr + u, mask=u_ok, other=0)
    parent = tl.load(parent_ptr + u, mask=u_ok, other=-1)
    tok = tl.load(ids_ptr + s * GK + (depth - 1) * K + rank, mask=kept, other=0)
    prow = tl.load(scratch_ptr + s * BLOCK_U + tl.maximum(parent, 0), mask=kept & (parent >= 0), other=0)
    aidx = tl.load(aidx_ptr + u[:, None] * D + d[None, :], mask=ud_ok, other=-1)
    arow = tl.load(scratch_ptr + s * BLOCK_U + tl.maximum(aidx, 0), mask=kept[:, None] & (aidx >= 0), other=0)
    one = tl.full([BLOCK_U, BLOCK_D], 1, tl.int64)
    bits = tl.sum(tl.where(aidx >= 0, one << arow.to(tl.int64), 0), 1) | 1
    node = tl.maximum(row_of - 1, 0)
    tl.store(tok_ptr + s * N + node, tok, mask=kept)
    tl.store(par_ptr + s * N + node, prow.to(tl.int64), mask=kept)
    tl.store(dep_ptr + s * N + node, depth, mask=kept)
    tl.store(mask_ptr + s * (N + 1) + row_of, bits.to(tl.int32), mask=kept)
    tl.store(mask_ptr + s * (N + 1), 1)
    if L > 0:
        c = tl.arange(0, BLOCK_L)
        on = (c < L) & (has != 0)
        row = N - L + 1 + c
        lk = tl.load(lookup_ptr + s * L + c, mask=on, other=0)
        tl.store(tok_ptr + s * N + row - 1, lk, mask=on)
        tl.store(par_ptr + s * N + row - 1, tl.where(c == 0, 0, row - 1).to(tl.int64), mask=on)
        tl.store(dep_ptr + s * N + row - 1, (c + 1).to(tl.int64), mask=on)
        one_l = tl.full([BLOCK_L], 1, tl.int64)
        chain = ((one_l << (row + 1).to(tl.int64)) - 1) & ~((one_l << (N - L + 1)) - 1)
        tl.store(mask_ptr + s * (N + 1) + row, (chain | 1).to(tl.int32), mask=on)


def build_tree(top_logprobs, top_ids, path_index, anc_index, depth, rank, parent, num_nodes: int,
               lookup=None, has_lookup=None):
    S, G, K = top_ids.shape
    U, D = path_index.shape
    N, dev = num_nodes, top_ids.device
    L = 0 if lookup is None else lookup.shape[1]
    block_u = triton.next_power_of_2(U)
    tokens = torch.empty(S, N, dtype=torch.int64, device=dev)
    parents = torch.empty(S, N, dtype=torch.int64, device=dev)
    depths = torch.empty(S, N, dtype=torch.int64, device=dev)
    masks = torch.empty(S, N + 1, dtype=torch.int32, device=dev)
    scratch = torch.empty(S, block_u, dtype=torch.int32, device=dev)
    if S == 0:
        return tokens, parents, depths, masks
    lk = lookup.contiguous() if L else tokens
    has = has_lookup.to(torch.int32) if L else tokens
    _build_tree_kernel[(S,)](
        top_logprobs.float().contiguous(), top_ids.contiguous(), path_index, anc_index, depth, rank, parent, lk, has,
        scratch, tokens, parents, depths, masks, U,
        GK=G * K, K=K, D=D, N=N, L=L, BLOCK_U=block_u, BLOCK_D=triton.next_power_of_2(D),
        BLOCK_L=triton.next_power_of_2(max(L, 1)), num_warps=4,
    )
    return tokens, parents, depths, masks


_CHUNK = 4096


@triton.jit
def _chunk_top_kernel(x_ptr, row_stride, V, vals_ptr, idx_ptr, m_ptr, s_ptr, num_chunks,
                      K: tl.constexpr, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row * row_stride + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    m = tl.max(x, 0)
    part = row * num_chunks + c
    tl.store(m_ptr + part, m)
    tl.store(s_ptr + part, tl.sum(tl.exp(x - m), 0))
    for k in range(K):
        best, i = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(vals_ptr + part * K + k, best)
        tl.store(idx_ptr + part * K + k, c * CHUNK + i)
        x = tl.where(tl.arange(0, CHUNK) == i, float("-inf"), x)


@triton.jit
def _merge_top_kernel(vals_ptr, idx_ptr, m_ptr, s_ptr, out_lp_ptr, out_idx_ptr, num_chunks,
                      K: tl.constexpr, BLOCK: tl.constexpr, BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    c_ok = c < num_chunks
    m = tl.load(m_ptr + row * num_chunks + c, mask=c_ok, other=float("-inf"))
    s = tl.load(s_ptr + row * num_chunks + c, mask=c_ok, other=0.0)
    top_m = tl.max(m, 0)
    lse = top_m + tl.log(tl.sum(tl.where(c_ok, s * tl.exp(m - top_m), 0.0), 0))
    j = tl.arange(0, BLOCK)
    j_ok = j < num_chunks * K
    v = tl.load(vals_ptr + row * num_chunks * K + j, mask=j_ok, other=float("-inf"))
    ix = tl.load(idx_ptr + row * num_chunks * K + j, mask=j_ok, other=2**31 - 1)
    for k in range(K):
        best = tl.max(v, 0)
        pick = tl.min(tl.where(v == best, ix, 2**31 - 1), 0)  # ties: the lower vocabulary index
        tl.store(out_lp_ptr + row * K + k, best - lse)
        tl.store(out_idx_ptr + row * K + k, pick.to(tl.int64))
        v = tl.where(ix == pick, float("-inf"), v)


def top_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``tree.top_logprobs_ref`` in two launches (``torch.topk`` and a
    log-sum-exp took eight, ~50 us for a block of SmolLM2 rows)."""
    V = logits.shape[-1]
    rows = logits.reshape(-1, V) if logits.stride(-1) == 1 else logits.contiguous().reshape(-1, V)
    R, dev = rows.shape[0], logits.device
    lp = torch.empty(R, k, dtype=torch.float32, device=dev)
    idx = torch.empty(R, k, dtype=torch.int64, device=dev)
    if R:
        C = triton.cdiv(V, _CHUNK)
        vals = torch.empty(R, C, k, dtype=torch.float32, device=dev)
        ids = torch.empty(R, C, k, dtype=torch.int32, device=dev)
        m = torch.empty(R, C, dtype=torch.float32, device=dev)
        s = torch.empty(R, C, dtype=torch.float32, device=dev)
        _chunk_top_kernel[(R, C)](rows, rows.stride(0), V, vals, ids, m, s, C, K=k, CHUNK=_CHUNK)
        _merge_top_kernel[(R,)](vals, ids, m, s, lp, idx, C, K=k, BLOCK=triton.next_power_of_2(C * k),
                                BLOCK_C=triton.next_power_of_2(C))
    return lp.view(*logits.shape[:-1], k), idx.view(*logits.shape[:-1], k)
