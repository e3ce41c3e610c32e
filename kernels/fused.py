"""The elementwise steps of a decoder layer, PyTorch references.

At batch 1 a small model's step is bound by its number of kernels, not by
bytes: the unfused layer of SmolLM2-135M ran 31 kernels on the H200, 4
GEMMs, 2 for attention and 25 of glue (an RMSNorm is four: cast, norm,
cast back, weight; a RoPE five), ~1.1 of the step's 1.8 ms. Each op here
is one kernel on the GPU (``fused_triton.py``):

* ``rms_norm(x, weight, eps, residual)``: the residual add and the norm;
* ``qkv_rope``: per-head q/k norm (Qwen3), RoPE, and the K/V cache write
  (or the rotated block K of a drafter, which is not cached);
* ``silu_mul``: the MLP's ``silu(gate) * up``.

They round where these references round, and the kernels copy those
roundings: the norm rounds as HF does (normalised in fp32, rounded, then
times the weight), RoPE is computed in fp32 and rounded once. In fp32 both
are HF's arithmetic exactly. These functions are what runs off the GPU,
and the numerical reference of the kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specray.kernels.attention import store_kv


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
    from ``Rotary.lookup`` (``[..., 1, head_dim]``, in ``x``'s dtype).
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
    cos_sin: tuple[torch.Tensor, torch.Tensor],
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
    output. ``cos_sin`` is ``[N, 1, D]`` each. With caches, K and V are
    written at ``slot_mapping`` and ``(q, None)`` is returned; without,
    ``(q, k)``, each ``[N, heads, D]``."""
    N, D, nkv = kv_src.shape[0], head_dim, num_kv_heads
    q = None
    if num_q_heads:
        q = q_src.reshape(N, num_q_heads, D)
        if q_norm is not None:
            q = rms_norm(q, q_norm, eps)[0]
        q = apply_rope(q, cos_sin)
    k = kv_src[:, : nkv * D].reshape(N, nkv, D)
    if k_norm is not None:
        k = rms_norm(k, k_norm, eps)[0]
    k = apply_rope(k, cos_sin)
    if k_cache is None:
        return q, k
    v = kv_src[:, nkv * D : 2 * nkv * D].reshape(N, nkv, D)
    store_kv(k_cache, v_cache, k, v, slot_mapping)
    return q, None


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up`` ``[..., 2I]`` (gate first)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
