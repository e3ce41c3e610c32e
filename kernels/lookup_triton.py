"""Triton kernel for ``lookup.lookup_drafts_ref``: one program per row
scans the row's tokens once per n-gram length, in chunks, for the most
recent earlier occurrence of its suffix, then writes the row's block
input ids. A few microseconds a step, instead of the reference's dozen
small kernels."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _suffix_match(row, L, MIN_N: tl.constexpr, MAX_N: tl.constexpr, BLOCK: tl.constexpr):
    """Where the longest suffix n-gram of ``row[:L]`` last occurred before:
    the position just after that occurrence, or -1."""
    start = L * 0 - 1
    for n in tl.static_range(MAX_N, MIN_N - 1, -1):
        best = L * 0 - 1
        for c in range(0, L, BLOCK):
            ends = c + tl.arange(0, BLOCK)
            m = (ends >= n) & (ends <= L - 1)
            for i in tl.static_range(n):
                src_pos = tl.where(m, ends - 1 - i, 0)
                tok = tl.load(row + src_pos, mask=m, other=-1)
                m = m & (tok == tl.load(row + tl.maximum(L - 1 - i, 0)))
            best = tl.maximum(best, tl.max(tl.where(m, ends, -1), axis=0))
        start = tl.where((start < 0) & (best >= 0), best, start)
    return start


@triton.jit
def _lookup_drafts_kernel(hist_ptr, hist_stride, rows_ptr, len_ptr, block_len_ptr, greedy_ptr, drafts_ptr,
                          drafts_stride, last_ptr, ids_ptr, merged_ptr, looked_ptr,
                          G: tl.constexpr, MIN_N: tl.constexpr, MAX_N: tl.constexpr, HAS_GREEDY: tl.constexpr,
                          AGREE: tl.constexpr, BLOCK: tl.constexpr, BLOCK_G: tl.constexpr):
    s = tl.program_id(0).to(tl.int64)
    row = hist_ptr + tl.load(rows_ptr + s).to(tl.int64) * hist_stride
    L = tl.load(len_ptr + s).to(tl.int64)
    start = _suffix_match(row, L, MIN_N, MAX_N, BLOCK)
    hit = (start >= 0) & (tl.load(block_len_ptr + s) > 1)
    if HAS_GREEDY:
        hit = hit & (tl.load(greedy_ptr + s) != 0)
    j = tl.arange(0, BLOCK_G)
    jm = j < G
    drafted = tl.load(drafts_ptr + s * drafts_stride + j, mask=jm, other=0)
    if AGREE:
        first = tl.load(row + tl.maximum(start, 0), mask=hit, other=-1)
        hit = hit & (first == tl.load(drafts_ptr + s * drafts_stride))
    found = tl.load(row + tl.minimum(tl.maximum(start, 0) + j, L - 1), mask=jm & hit, other=0)
    tok = tl.where(hit, found, drafted)
    tl.store(merged_ptr + s * G + j, tok, mask=jm)
    tl.store(ids_ptr + s * (G + 1) + 1 + j, tok, mask=jm)
    tl.store(ids_ptr + s * (G + 1), tl.load(last_ptr + s))
    tl.store(looked_ptr + s, hit)


def lookup_drafts(history, rows, lengths, block_len, greedy, drafts, last, min_n, max_n, agree=False):
    S, G = drafts.shape
    dev = drafts.device
    assert history.stride(1) == 1 and drafts.stride(1) == 1
    ids = torch.empty(S, G + 1, dtype=torch.int64, device=dev)
    merged = torch.empty(S, G, dtype=torch.int64, device=dev)
    looked_up = torch.empty(S, dtype=torch.bool, device=dev)
    if S:
        _lookup_drafts_kernel[(S,)](
            history, history.stride(0), rows, lengths, block_len, drafts if greedy is None else greedy, drafts,
            drafts.stride(0), last, ids, merged, looked_up, G, min_n, max_n, HAS_GREEDY=greedy is not None,
            AGREE=bool(agree), BLOCK=512, BLOCK_G=triton.next_power_of_2(max(G, 1)),
        )
    return ids, merged, looked_up
