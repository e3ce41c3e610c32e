"""Triton kernels for ``linear.py``: a projection of at most ``MAX_ROWS``
rows (a decode step's, a verify block's), one kernel that streams the
weight once.

Each program owns ``BLOCK_N`` output columns (weight rows) of one 16-row
tile and walks the whole ``K`` through the tensor cores (``tl.dot``, the
16-row MMA); there is no split-K, so no second kernel reduces partial sums.
The input rows are built in the loop from what the kernel reads: a normed
residual stream (``norm_linear``: a first pass over the rows sums their
squares; every program does it, the rows are a few KiB out of L2) or the
MLP's ``silu(gate) * up`` (``silu_mul_linear``), rounded where ``fused.py``
rounds. Program 0 of each row tile writes the residual stream.

A row's bits do not depend on the rows beside it or on the tile widths:
every row tile is 16 rows, an output sums its products 16 columns of ``K``
at a time, in order, and the norm sums fixed-width chunks (the number of
warps may change how a chunk is summed). So a position gets the
same logits as a decode row and as a row of a verify block (section 8 of
docs/architecture.md), as long as both stay within ``MAX_ROWS`` (batch
1: a decode row and a 16-row verify block). More rows, in 16-row tiles,
lost to cuBLAS 3-6x on SmolLM2's shapes (64 and 128 rows).

Graph capture: the grid depends on shapes only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 16
ROW_TILE = 16
PLAIN, NORM, SILU = 0, 1, 2

# (N, K) -> (BLOCK_N, BLOCK_K, num_warps, num_stages), the fastest measured
# (bench/linear_kernels.py); other shapes take ``_default_config``.
CONFIGS: dict[tuple[int, int], tuple[int, int, int, int]] = {}


@triton.jit
def _inv_rms(x_rows, r_rows, row_ok, K, eps, dt, HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr):
    """``1 / rms`` of each row of the residual stream (``x + r``, rounded),
    summed in chunks of a fixed width whatever the tiles."""
    NORM_K: tl.constexpr = 128
    kk = tl.arange(0, NORM_K)
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, NORM_K):
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
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # Row tiles vary fastest: the tiles of one weight slice run together
    # and read it from L2 after the first.
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m, pid_n = tl.program_id(0) % num_m, tl.program_id(0) // num_m
    dt = y_ptr.dtype.element_ty
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    kk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_stride
    r_rows = r_ptr + rows.to(tl.int64)[:, None] * r_stride
    s_rows = s_ptr + rows.to(tl.int64)[:, None] * K
    w_rows = w_ptr + n.to(tl.int64)[:, None] * K
    inv = tl.zeros([BLOCK_M], dtype=tl.float32)
    if PRO == 1:
        inv = _inv_rms(x_rows, r_rows, row_ok, K, eps, dt, HAS_RES, BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        if EVEN_K:
            xm = row_ok[:, None]
            wv = tl.load(w_rows + k[None, :], mask=n_ok[:, None], other=0.0)
        else:
            xm = row_ok[:, None] & (k < K)[None, :]
            wv = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & (k < K)[None, :], other=0.0)
        a = _input_tile(x_rows, r_rows, s_rows, g_ptr, inv, k, xm, pid_n == 0, K, dt, PRO, HAS_RES)
        acc = tl.dot(a.to(dt), tl.trans(wv), acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * N + n[None, :], acc.to(dt), mask=row_ok[:, None] & n_ok[None, :])


def _default_config(N: int, K: int) -> tuple[int, int, int, int]:
    """About two programs per SM (a program per ``BLOCK_N`` weight rows of a
    row tile), each loading ``BLOCK_K``-wide tiles, pipelined."""
    block_n = 16
    while block_n < 64 and N // (2 * block_n) >= 256:
        block_n *= 2
    return block_n, min(256, max(32, triton.next_power_of_2(K))), 4, 4


def config(N: int, K: int) -> tuple[int, int, int, int]:
    return CONFIGS.get((N, K)) or _default_config(N, K)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _launch(pro, x, w, b, K, r=None, s=None, g=None, eps=0.0) -> torch.Tensor:
    M, N = x.shape[0], w.shape[0]
    assert 0 < M <= MAX_ROWS and w.shape[1] == K and w.is_contiguous() and w.dtype == x.dtype
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    block_n, block_k, warps, stages = config(N, K)
    _projection_kernel[(triton.cdiv(M, ROW_TILE) * triton.cdiv(N, block_n),)](
        x, x if r is None else r, y if s is None else s, w if g is None else g, w, w if b is None else b, y,
        M, N, K, x.stride(0), x.stride(0) if r is None else r.stride(0), eps,
        PRO=pro, HAS_RES=r is not None, HAS_BIAS=b is not None, EVEN_K=K % block_k == 0,
        BLOCK_M=ROW_TILE, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
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
