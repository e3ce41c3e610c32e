"""Triton twin of ``kv_move.move_kv_ref`` for a draft tree's moves: one
launch (PyTorch's gather / scatter over a cache past 2**31 elements split
into 16 launches each, ~110 us a step on the H200)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _move_kv_kernel(cache_ptr, src_ptr, dst_ptr, stride_plane, stride_slot, ROW: tl.constexpr,
                    N: tl.constexpr, BLOCK: tl.constexpr):
    # One program per (layer, K or V) plane: the moves in order, each read
    # fenced from the previous write.
    plane = cache_ptr + tl.program_id(0).to(tl.int64) * stride_plane
    offs = tl.arange(0, BLOCK)
    ok = offs < ROW
    for i in range(N):
        s = tl.load(src_ptr + i).to(tl.int64)
        d = tl.load(dst_ptr + i).to(tl.int64)
        x = tl.load(plane + s * stride_slot + offs, mask=ok)
        tl.debug_barrier()
        tl.store(plane + d * stride_slot + offs, x, mask=ok)
        tl.debug_barrier()


def move_kv(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """``move_kv_ref`` for moves that never read a slot an earlier move
    wrote (a tree's: the node at depth k comes from a row >= k, and rows
    grow with depth), done in order within each plane."""
    L, two, nb, bs = kv_cache.shape[:4]
    row = kv_cache[0, 0, 0, 0].numel()
    n = src.shape[0]
    if n == 0:
        return
    assert kv_cache.is_contiguous()
    _move_kv_kernel[(L * two,)](kv_cache, src, dst, nb * bs * row, row, ROW=row, N=n,
                                BLOCK=triton.next_power_of_2(row), num_warps=4)
