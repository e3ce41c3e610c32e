"""Triton kernels for ``fused.py``: one kernel per op, one program per row
(or per (token, head)). Values are widened to fp32 and rounded back to the
activation dtype wherever the reference rounds, so that the kernels give the
reference's bits but for the order of fp32 sums and FMA contraction (an ulp
of an fp32 intermediate, which moves a 16-bit output rarely).

Graph capture: grids depend on shapes only; slots are read in the kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, s_ptr, y_ptr, w_ptr, x_stride, r_stride, H, eps,
                     HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < H
    dt = y_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * x_stride + cols, mask=m, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(r_ptr + row * r_stride + cols, mask=m, other=0.0).to(tl.float32)
        s = (x + r).to(dt)
        tl.store(s_ptr + row * H + cols, s, mask=m)
        x = s.to(tl.float32)
    inv = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / H + eps)
    n = (x * inv).to(dt).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * H + cols, (n * w).to(dt), mask=m)


@triton.jit
def _norm_rope_half(src, w_ptr, c_ptr, s_ptr, eps, HAS_NORM: tl.constexpr, D: tl.constexpr, dt: tl.constexpr):
    """One head ``[D]`` at ``src``: optional RMSNorm, then RoPE with the fp32
    table rows at ``c_ptr`` / ``s_ptr`` (rounded to ``dt`` first, as the
    reference's gathered cos/sin are); the two rotated halves in ``dt``."""
    HALF: tl.constexpr = D // 2
    d = tl.arange(0, HALF)
    x1 = tl.load(src + d).to(tl.float32)
    x2 = tl.load(src + HALF + d).to(tl.float32)
    if HAS_NORM:
        inv = 1.0 / tl.sqrt_rn((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / D + eps)
        x1 = ((x1 * inv).to(dt).to(tl.float32) * tl.load(w_ptr + d).to(tl.float32)).to(dt).to(tl.float32)
        x2 = ((x2 * inv).to(dt).to(tl.float32) * tl.load(w_ptr + HALF + d).to(tl.float32)).to(dt).to(tl.float32)
    c1 = tl.load(c_ptr + d).to(dt).to(tl.float32)
    c2 = tl.load(c_ptr + HALF + d).to(dt).to(tl.float32)
    s1 = tl.load(s_ptr + d).to(dt).to(tl.float32)
    s2 = tl.load(s_ptr + HALF + d).to(dt).to(tl.float32)
    o1 = (x1 * c1 - x2 * s1).to(dt)
    o2 = (x2 * c2 + x1 * s2).to(dt)
    return o1, o2


@triton.jit
def _qkv_rope_kernel(q_ptr, kv_ptr, q_stride, kv_stride, cos_ptr, sin_ptr, pos_ptr, cs_stride, qw_ptr, kw_ptr, eps,
                     q_out, k_out, v_out, slot_ptr, NQ, NKV, kv_layer_stride, kw_layer_stride, cache_layer_stride,
                     HAS_NORM: tl.constexpr, STORE: tl.constexpr, D: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    # Layers (grid axis 2) of a drafter's context store: each reads its
    # columns of one GEMM's output, its k_norm row and its cache.
    layer = tl.program_id(2).to(tl.int64)
    kv_ptr += layer * kv_layer_stride
    kw_ptr += layer * kw_layer_stride
    k_out += layer * cache_layer_stride
    v_out += layer * cache_layer_stride
    dt = k_out.dtype.element_ty
    HALF: tl.constexpr = D // 2
    d = tl.arange(0, HALF)
    pos = tl.load(pos_ptr + n).to(tl.int64)
    c_ptr = cos_ptr + pos * cs_stride
    s_ptr = sin_ptr + pos * cs_stride
    if STORE:
        row = tl.load(slot_ptr + n)  # the cache row (slot) of token n
    else:
        row = n
    if j < NQ:
        o1, o2 = _norm_rope_half(q_ptr + n * q_stride + j * D, qw_ptr, c_ptr, s_ptr, eps, HAS_NORM, D, dt)
        dst = q_out + (n * NQ + j) * D
        tl.store(dst + d, o1)
        tl.store(dst + HALF + d, o2)
    elif j < NQ + NKV:
        h = j - NQ
        o1, o2 = _norm_rope_half(kv_ptr + n * kv_stride + h * D, kw_ptr, c_ptr, s_ptr, eps, HAS_NORM, D, dt)
        dst = k_out + (row * NKV + h) * D
        tl.store(dst + d, o1)
        tl.store(dst + HALF + d, o2)
    else:  # a V head: copied into the cache
        h = j - NQ - NKV
        dd = tl.arange(0, D)
        v = tl.load(kv_ptr + n * kv_stride + (NKV + h) * D + dd)
        tl.store(v_out + (row * NKV + h) * D + dd, v)


@triton.jit
def _silu_mul_kernel(x_ptr, y_ptr, x_stride, I, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < I
    dt = y_ptr.dtype.element_ty
    g = tl.load(x_ptr + row * x_stride + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * x_stride + I + cols, mask=m, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(y_ptr + row * I + cols, (s * u).to(dt), mask=m)


# --------------------------------------------------------------- launchers
def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[rows, last]`` with a unit last stride (a view when it can be)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x, weight, eps, residual=None):
    H = x.shape[-1]
    x2 = _rows(x)
    N = x2.shape[0]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if residual is None:
        s, r2 = x, x2
    else:
        r2 = _rows(residual)
        s = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if N:
        _rms_norm_kernel[(N,)](x2, r2, s, y, weight, x2.stride(0), r2.stride(0), H, eps,
                               HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(H), num_warps=4)
    return y, s


def _rope_args(rope, N: int, D: int, dtype: torch.dtype):
    """The kernel's view of ``RopeRows`` for ``N`` tokens of head dim ``D``:
    the cos and sin tables and the positions, contiguous."""
    cos, sin, positions = rope.cos_table, rope.sin_table, rope.positions.contiguous()
    assert cos.shape[-1] == D and cos.stride(-1) == 1 and sin.stride() == cos.stride()
    assert positions.shape == (N,) and rope.dtype == dtype
    return cos, sin, positions


def qkv_rope(q_src, kv_src, num_q_heads, num_kv_heads, head_dim, rope, q_norm, k_norm, eps,
             k_cache=None, v_cache=None, slot_mapping=None):
    N, D, nq, nkv = kv_src.shape[0], head_dim, num_q_heads, num_kv_heads
    dev, dt = kv_src.device, kv_src.dtype
    cos, sin, positions = _rope_args(rope, N, D, dt)
    assert kv_src.stride(-1) == 1
    assert not nq or (q_norm is None) == (k_norm is None), "q and k are normed together or not at all"
    q = torch.empty(N, nq, D, dtype=dt, device=dev) if nq else None
    store = k_cache is not None
    if store:
        assert k_cache.is_contiguous() and v_cache.is_contiguous()
        k_out, v_out, heads = k_cache, v_cache, nq + 2 * nkv
    else:
        k_out = torch.empty(N, nkv, D, dtype=dt, device=dev)
        v_out, heads = k_out, nq + nkv
    if N:
        q_in = q_src if nq else kv_src
        has_norm = k_norm is not None
        _qkv_rope_kernel[(N, heads, 1)](
            q_in, kv_src, q_in.stride(0), kv_src.stride(0), cos, sin, positions, cos.stride(0),
            q_norm if (has_norm and nq) else k_out, k_norm if has_norm else k_out, eps,
            q if nq else k_out, k_out, v_out, slot_mapping if store else kv_src, nq, nkv, 0, 0, 0,
            HAS_NORM=has_norm, STORE=store, D=D, num_warps=1,
        )
    return q, (None if store else k_out)


def context_kv(kv_all, num_kv_heads, head_dim, rope, k_norms, eps, kv_cache, slot_mapping):
    L, N, D, nkv = kv_cache.shape[0], kv_all.shape[0], head_dim, num_kv_heads
    assert kv_cache.is_contiguous() and kv_all.stride(-1) == 1 and kv_all.shape[1] == L * 2 * nkv * D
    assert k_norms is None or (k_norms.shape == (L, D) and k_norms.is_contiguous())
    cos, sin, positions = _rope_args(rope, N, D, kv_all.dtype)
    if N:
        k_cache, v_cache = kv_cache[0, 0], kv_cache[0, 1]
        _qkv_rope_kernel[(N, 2 * nkv, L)](
            kv_all, kv_all, kv_all.stride(0), kv_all.stride(0), cos, sin, positions, cos.stride(0),
            k_cache, k_cache if k_norms is None else k_norms, eps, k_cache, k_cache, v_cache, slot_mapping,
            0, nkv, 2 * nkv * D, 0 if k_norms is None else D, kv_cache.stride(0),
            HAS_NORM=k_norms is not None, STORE=True, D=D, num_warps=1,
        )


def silu_mul(gate_up):
    I = gate_up.shape[-1] // 2
    x2 = _rows(gate_up)
    N = x2.shape[0]
    y = torch.empty(*gate_up.shape[:-1], I, dtype=gate_up.dtype, device=gate_up.device)
    BLOCK = min(1024, triton.next_power_of_2(I))
    if N:
        _silu_mul_kernel[(N, triton.cdiv(I, BLOCK))](x2, y, x2.stride(0), I, BLOCK=BLOCK, num_warps=4)
    return y
