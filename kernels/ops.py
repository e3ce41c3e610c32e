"""Dispatch: the GPU kernel where one exists for the tensor's device, the
PyTorch reference otherwise. Models call these names only."""

from __future__ import annotations

from specray.kernels.attention import (
    dflash_block_attention_ref,
    paged_attention_ref,
    store_kv,
)

paged_attention = paged_attention_ref
dflash_block_attention = dflash_block_attention_ref

__all__ = ["store_kv", "paged_attention", "dflash_block_attention"]
