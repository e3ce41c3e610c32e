"""Triton kernels for ``linear.py``: a projection of at most ``MAX_ROWS``
rows (a decode step's, a verify block's), one kernel that streams the
weight once.

Each program owns ``BLOCK_N`` output columns (weight rows) and walks the
whole ``K``; there is no split-K, so no second kernel reduces partial sums.
The input rows are built in the loop from what the kernel reads: a
normed residual stream (``norm_linear``: a first pass over the row sums its
squares; every program does it, the row is a few KiB out of L2) or the MLP's
``silu(gate) * up`` (``silu_mul_linear``), rounded where ``fused.py``
rounds. Program 0 writes the residual stream.

Graph capture: the grid depends on shapes only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 16
DOT_ROWS = 4  # more rows than this: a 16-row block through tl.dot
PLAIN, NORM, SILU = 0, 1, 2

# (N, K, BLOCK_M) -> (BLOCK_N, BLOCK_K, num_warps, num_stages), the fastest
# measured (bench/linear_kernels.py); other shapes take ``_default_config``.
CONFIGS: dict[tuple[int, int, int], tuple[int, int, int, int]] = {}


@triton.jit
def _inv_rms(x_rows, r_rows, row_ok, K, eps, dt, HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_K: tl.constexpr):
    """``1 / rms`` of each row of the residual stream (``x + r``, rounded)."""
    kk = tl.arange(0, BLOCK_K)
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        xm = row_ok[:, None] & (k < K)[None, :]
        a = tl.load(x_rows + k[None, :], mask=xm, other=0.0).to(tl.float32)
        if HAS_RES:
            a = (a + tl.load(r_rows + k[None, :], mask=xm, other=0.0).to(tl.float32)).to(dt).to(tl.float32)
        ss += tl.sum(a * a, axis=1)
    return 1.0 / tl.sqrt_rn(ss / K + eps)


@triton.jit
def _input_tile(x_rows, r_rows, s_rows, g_ptr, inv, k, xm, write_s, K, dt, PRO: tl.constexpr,
                HAS_RES: tl.constexpr):
    """Columns ``k`` of the input rows ``[BLOCK_M, BLOCK_K]`` (fp32 holding
    ``dt`` values): the loaded rows, their norm (writing the residual
    stream where ``write_s``), or ``silu(gate) * up``."""
    if PRO == 2:
        gate = tl.load(x_rows + k[None, :], mask=xm, other=0.0).to(tl.float32)
        up = tl.load(x_rows + K + k[None, :], mask=xm, other=0.0).to(tl.float32)
        a = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
        a = (a * up).to(dt).to(tl.float32)
    else:
        a = tl.load(x_rows + k[None, :], mask=xm, other=0.0).to(tl.float32)
        if PRO == 1:
            if HAS_RES:
                s = (a + tl.load(r_rows + k[None, :], mask=xm, other=0.0).to(tl.float32)).to(dt)
                tl.store(s_rows + k[None, :], s, mask=xm & write_s)
                a = s.to(tl.float32)
            gw = tl.load(g_ptr + k, mask=k < K, other=0.0).to(tl.float32)
            a = ((a * inv[:, None]).to(dt).to(tl.float32) * gw[None, :]).to(dt).to(tl.float32)
    return a


@triton.jit
def _projection_kernel(x_ptr, r_ptr, s_ptr, g_ptr, w_ptr, b_ptr, y_ptr, M, N, K, x_stride, r_stride, eps,
                       PRO: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                       DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    dt = y_ptr.dtype.element_ty
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    kk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_stride
    r_rows = r_ptr + rows.to(tl.int64)[:, None] * r_stride
    s_rows = s_ptr + rows.to(tl.int64)[:, None] * K
    w_rows = w_ptr + n.to(tl.int64)[:, None] * K
    inv = tl.zeros([BLOCK_M], dtype=tl.float32)
    if PRO == 1:
        inv = _inv_rms(x_rows, r_rows, row_ok, K, eps, dt, HAS_RES, BLOCK_M, BLOCK_K)
    # Up to a few rows the products are summed elementwise across the loop
    # and reduced once at the end (no cross-lane reduction per tile); a
    # block of rows (a verify block) goes through the tensor cores.
    if DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        if EVEN_K:
            xm = row_ok[:, None]
            wv = tl.load(w_rows + k[None, :], mask=n_ok[:, None], other=0.0)
        else:
            xm = row_ok[:, None] & (k < K)[None, :]
            wv = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & (k < K)[None, :], other=0.0)
        a = _input_tile(x_rows, r_rows, s_rows, g_ptr, inv, k, xm, pid == 0, K, dt, PRO, HAS_RES)
        if DOT:
            acc = tl.dot(a.to(dt), tl.trans(wv), acc)
        else:
            acc += a[:, None, :] * wv.to(tl.float32)[None, :, :]
    if DOT:
        y = acc
    else:
        y = tl.sum(acc, axis=2)
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * N + n[None, :], y.to(dt), mask=row_ok[:, None] & n_ok[None, :])


def _default_config(N: int, K: int, block_m: int) -> tuple[int, int, int, int]:
    """Enough programs to fill the GPU twice over (a program per
    ``BLOCK_N`` weight rows), each loading ``BLOCK_K``-wide tiles; the
    running sums (``BLOCK_M * BLOCK_N * BLOCK_K``) at 32 a thread. A block
    of rows: 32-column tiles through the tensor cores."""
    if block_m > DOT_ROWS:
        return 32, min(128, max(32, triton.next_power_of_2(K))), 4, 3
    block_k = min(512, max(64, triton.next_power_of_2(K)))
    block_n = 4
    while block_n < 32 and N // (2 * block_n) >= 512:
        block_n *= 2
    warps = 4
    while block_m * block_n * block_k > 32 * 32 * warps:
        if warps < 8:
            warps *= 2
        elif block_k > 64:
            block_k //= 2
        else:
            block_n //= 2
    return block_n, block_k, warps, 3


def config(N: int, K: int, rows: int) -> tuple[int, int, int, int]:
    """The tuned configuration of ``(N, K, rows)``; the one tuned for a
    single row where more rows fit its running sums; else the default."""
    block_m = _block_m(rows)
    tuned = CONFIGS.get((N, K, block_m))
    if tuned is None and block_m <= DOT_ROWS and (one := CONFIGS.get((N, K, 1))) and \
            block_m * one[0] * one[1] <= 32 * 32 * one[2]:
        tuned = one
    return tuned or _default_config(N, K, block_m)


def _block_m(rows: int) -> int:
    return triton.next_power_of_2(rows) if rows <= DOT_ROWS else 16


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _launch(pro, x, w, b, K, r=None, s=None, g=None, eps=0.0) -> torch.Tensor:
    M, N = x.shape[0], w.shape[0]
    assert 0 < M <= MAX_ROWS and w.shape[1] == K and w.is_contiguous() and w.dtype == x.dtype
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    block_n, block_k, warps, stages = config(N, K, M)
    block_m = _block_m(M)
    _projection_kernel[(triton.cdiv(N, block_n),)](
        x, x if r is None else r, y if s is None else s, w if g is None else g, w, w if b is None else b, y,
        M, N, K, x.stride(0), x.stride(0) if r is None else r.stride(0), eps,
        PRO=pro, HAS_RES=r is not None, HAS_BIAS=b is not None, EVEN_K=K % block_k == 0,
        DOT=block_m > DOT_ROWS, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
    )
    return y


def linear(x, w, b=None):
    x = _rows(x)
    return _launch(PLAIN, x, w, b, x.shape[1])


def norm_linear(x, norm_weight, eps, residual, w, b=None):
    x = _rows(x)
    if residual is None:
        return _launch(NORM, x, w, b, x.shape[1], g=norm_weight, eps=eps), x
    r = _rows(residual)
    s = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return _launch(NORM, x, w, b, x.shape[1], r=r, s=s, g=norm_weight, eps=eps), s


def silu_mul_linear(gate_up, w, b=None):
    gate_up = _rows(gate_up)
    return _launch(SILU, gate_up, w, b, gate_up.shape[1] // 2)
