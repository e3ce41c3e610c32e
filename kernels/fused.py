"""The elementwise steps of a decoder layer, PyTorch references.

At batch 1 a small model's step is bound by its number of kernels, not by
bytes: the unfused layer of SmolLM2-135M ran 31 kernels on the H200, 4
GEMMs, 2 for attention and 25 of glue (an RMSNorm is four: cast, norm,
cast back, weight; a RoPE five), ~1.1 of the step's 1.8 ms. Each op here
is one kernel on the GPU (``fused_triton.py``):

* ``rms_norm(x, weight, eps, residual)``: the residual add and the norm;
* ``qkv_rope``: per-head q/k norm (Qwen3), RoPE, and the K/V cache write
  (or the rotated block K of a drafter, which is not cached);
* ``silu_mul``: the MLP's ``silu(gate) * up``;
* ``context_kv``: ``qkv_rope``'s cache write for every layer of a DFlash
  drafter's context store at once.

They round where these references round, and the kernels copy those
roundings: the norm rounds as HF does (normalised in fp32, rounded, then
times the weight), RoPE is computed in fp32 and rounded once. In fp32 both
are HF's arithmetic exactly. These functions are what runs off the GPU,
and the numerical reference of the kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from specray.kernels.attention import store_kv


@dataclass
class RopeRows:
    """RoPE angles of ``positions`` ``[N]``: the fp32 tables ``[P, D]`` and
    the positions, gathered where they are used. The GPU kernel
    (``kernels.fused_triton.qkv_rope``) reads its rows from the tables: a
    gather ahead of it was four small kernels per forward (two gathers, two
    casts), twelve in a speculative step that ropes three times."""

    cos_table: torch.Tensor
    sin_table: torch.Tensor
    positions: torch.Tensor
    dtype: torch.dtype

    @cached_property
    def cos_sin(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[N, 1, D]`` in ``dtype`` (the rounding the kernel
        applies to the rows it reads)."""
        return tuple(t[self.positions].unsqueeze(-2).to(self.dtype) for t in (self.cos_table, self.sin_table))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, s)``: the residual stream ``s = residual + x`` (``x`` itself
    without a residual) and ``y = weight * norm(s)``, over the last dim."""
    s = x if residual is None else residual + x
    # fp32 statistics, cast back before the weight: the order HF uses, which
    # parity at 1e-4 depends on.
    y = weight * F.rms_norm(s.float(), (s.shape[-1],), eps=eps).to(s.dtype)
    return y, s


def apply_rope(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate-half (NeoX) RoPE of ``x`` ``[..., heads, head_dim]``; ``cos_sin``
    ``[..., 1, head_dim]`` each, in ``x``'s dtype (``RopeRows.cos_sin``).
    Computed in fp32 and rounded once (HF rounds the two products and the
    sum in ``x``'s dtype; a compiler fuses those roundings away, so the
    kernel could not promise them)."""
    cos, sin = cos_sin
    half = x.shape[-1] // 2
    xf = x.float()
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos.float() + rotated * sin.float()).to(x.dtype)


def qkv_rope(
    q_src: torch.Tensor | None,
    kv_src: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rope: RopeRows,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Queries and keys of ``N`` tokens, normed per head (when norms are
    given) and rotated.

    ``q_src`` ``[N, nq*D]`` (None when ``num_q_heads`` is 0) and ``kv_src``
    ``[N, >= nkv*D]``: K in its first ``nkv*D`` columns, V after them (a
    cache write reads V there); rows may be strided views of one GEMM's
    output. ``rope``: the angles of the ``N`` tokens. With caches, K and V are
    written at ``slot_mapping`` and ``(q, None)`` is returned; without,
    ``(q, k)``, each ``[N, heads, D]``."""
    N, D, nkv = kv_src.shape[0], head_dim, num_kv_heads
    q = None
    if num_q_heads:
        q = q_src.reshape(N, num_q_heads, D)
        if q_norm is not None:
            q = rms_norm(q, q_norm, eps)[0]
        q = apply_rope(q, rope.cos_sin)
    k = kv_src[:, : nkv * D].reshape(N, nkv, D)
    if k_norm is not None:
        k = rms_norm(k, k_norm, eps)[0]
    k = apply_rope(k, rope.cos_sin)
    if k_cache is None:
        return q, k
    v = kv_src[:, nkv * D : 2 * nkv * D].reshape(N, nkv, D)
    store_kv(k_cache, v_cache, k, v, slot_mapping)
    return q, None


def context_kv(
    kv_all: torch.Tensor,
    num_kv_heads: int,
    head_dim: int,
    rope: RopeRows,
    k_norms: torch.Tensor | None,
    eps: float,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Every layer's K/V of ``N`` context tokens into its cache: ``kv_all``
    ``[N, L * 2 * nkv * D]`` holds layer ``l``'s K then V in its ``l``-th
    ``2 * nkv * D`` columns; ``k_norms`` ``[L, D]``; ``kv_cache``
    ``[L, 2, blocks, block_size, nkv, D]``. ``qkv_rope`` for each layer
    (one kernel for all of them on the GPU)."""
    width = 2 * num_kv_heads * head_dim
    for li in range(kv_cache.shape[0]):
        qkv_rope(None, kv_all[:, li * width:(li + 1) * width], 0, num_kv_heads, head_dim, rope,
                 None, None if k_norms is None else k_norms[li], eps, kv_cache[li, 0], kv_cache[li, 1], slot_mapping)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up`` ``[..., 2I]`` (gate first)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
