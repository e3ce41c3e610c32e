"""Moving cached K/V between slots: a draft tree's accepted nodes were
written at their block rows' slots and belong at their depths'
(cluster/draft_tree.py). PyTorch reference for ``kv_move_triton``."""

from __future__ import annotations

import torch


def move_kv_ref(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy every layer's K and V at slots ``src`` to slots ``dst`` (``[n]``
    each; ``kv_cache`` ``[L, 2, blocks, block_size, kv_heads, D]``). Every
    source is read before any destination is written."""
    L, two, nb, bs = kv_cache.shape[:4]
    flat = kv_cache.view(L * two, nb * bs, -1)
    flat[:, dst] = flat[:, src]
