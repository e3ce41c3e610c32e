"""Dispatch: the GPU kernel where one exists for the tensor's device, the
PyTorch reference otherwise. Models call these names only."""

from __future__ import annotations

from specray.kernels.attention import (
    dflash_block_attention_ref,
    paged_attention_ref,
    store_kv,
)

try:  # triton is optional: CPU installs run the references
    from specray.kernels import attention_triton as _triton
except Exception:  # ImportError, or a triton that cannot initialise here
    _triton = None


def paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
                    max_query_len, max_seq_len, scale, sliding_window=None):
    fn = _triton.paged_attention if _triton is not None and q.is_cuda else paged_attention_ref
    return fn(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
              max_query_len, max_seq_len, scale, sliding_window)


def dflash_block_attention(q, k_block, v_block, k_cache, v_cache, ctx_lens, block_tables,
                           max_ctx_len, block_lens, scale, causal, sliding_window=None):
    fn = _triton.dflash_block_attention if _triton is not None and q.is_cuda else dflash_block_attention_ref
    return fn(q, k_block, v_block, k_cache, v_cache, ctx_lens, block_tables,
              max_ctx_len, block_lens, scale, causal, sliding_window)


__all__ = ["store_kv", "paged_attention", "dflash_block_attention"]
