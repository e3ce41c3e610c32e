"""Triton kernel for the counter-based uniforms of ``specray.sampling``
(``host_uniforms`` is the definition it is tested against): one program per
(stream, row) hashes the row's ``width`` positions after its start. On the
device the hash is one kernel instead of ~20 elementwise ones, which lets
a step graph draw its own uniforms from positions the host has not seen."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _mix32(x):
    # Values stay below 2**32 and the multipliers below 2**31: int64 lanes never overflow.
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _uniforms_kernel(keys_ptr, key_stride_k, key_stride_s, start_ptr, out_ptr, S, W: tl.constexpr,
                     BLOCK_W: tl.constexpr):
    k = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1).to(tl.int64)
    key = tl.load(keys_ptr + k * key_stride_k + s * key_stride_s).to(tl.int64)
    j = tl.arange(0, BLOCK_W)
    pos = tl.load(start_ptr + s).to(tl.int64) + 1 + j
    x = _mix32(key ^ (pos & 0xFFFFFFFF))
    x = _mix32(x ^ ((pos >> 32) & 0xFFFFFFFF) ^ 0x5BD1E995)
    u = (x.to(tl.float64) + 0.5) / 4294967296.0
    tl.store(out_ptr + (k * S + s) * W + j, u, mask=j < W)


def position_uniforms(keys: torch.Tensor, starts: torch.Tensor, width: int) -> torch.Tensor:
    """``keys`` ``[3, S]`` int64 (``sampling.seed_keys``), ``starts`` ``[S]``
    -> ``[3, S, width]`` float64: the uniform of stream ``k + 1`` at
    position ``starts[s] + 1 + j``."""
    S = starts.shape[0]
    out = torch.empty(3, S, width, dtype=torch.float64, device=starts.device)
    if S and width:
        _uniforms_kernel[(3, S)](keys, keys.stride(0), keys.stride(1), starts, out, S, width,
                                 BLOCK_W=triton.next_power_of_2(width))
    return out
