"""A decoder layer's projections at a few rows, PyTorch references.

A decode step at batch 1 reads every weight once for one row: its GEMMs are
matrix-vector products bound by memory bandwidth, and the norms and the
MLP's activation between them are kernels of a few microseconds each that
read a row. On the GPU (``linear_triton.py``) each of these is one kernel
that streams the weight and computes its input row on the fly:

* ``linear(x, w, b)``: ``x @ w.T + b``;
* ``norm_linear``: the residual add and RMSNorm (``fused.rms_norm``), then
  the projection (the attention's QKV, the MLP's gate/up);
* ``silu_mul_linear``: ``silu(gate) * up`` (``fused.silu_mul``), then the
  projection (the MLP's down).

The norm and activation round where ``fused.py`` does; the product sums in
fp32 in the kernel's own order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specray.kernels.fused import rms_norm, silu_mul


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, w, b)


def norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
                w: torch.Tensor, b: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, s)``: ``s`` the residual stream ``residual + x`` (``x`` itself
    without a residual), ``y`` its norm projected by ``w``."""
    y, s = rms_norm(x, norm_weight, eps, residual)
    return F.linear(y, w, b), s


def silu_mul_linear(gate_up: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up`` ``[rows, 2I]`` projected by ``w`` ``[N, I]``."""
    return F.linear(silu_mul(gate_up), w, b)
