"""Dispatch: the GPU kernel where one exists for the tensor's device, the
PyTorch reference otherwise. Models call these names only."""

from __future__ import annotations

import os

import torch

from specray.kernels import fused
from specray.kernels import linear as fused_linear
from specray.kernels.attention import (
    dflash_block_attention_ref,
    paged_attention_ref,
    store_kv,
)
from specray.kernels.kv_move import move_kv_ref
from specray.kernels.tree import build_tree_ref, top_logprobs_ref
from specray.kernels.lookup import lookup_drafts_ref
from specray.kernels.step_glue import accept_advance_ref, block_inputs_ref

try:  # triton is optional: CPU installs run the references
    from specray.kernels import attention_triton as _triton
    from specray.kernels import fused_triton as _fused
    from specray.kernels import lookup_triton as _lookup
    from specray.kernels import argmax_triton as _argmax
    from specray.kernels import step_glue_triton as _glue
    from specray.kernels import kv_move_triton as _kv_move
    from specray.kernels import tree_triton as _tree
    from specray.kernels import linear_triton as _linear
except Exception:  # ImportError, or a triton that cannot initialise here
    _triton = _fused = _lookup = _argmax = _glue = _kv_move = _tree = _linear = None

# The fused elementwise kernels copy the reference's roundings in 16-bit
# dtypes; fp32 runs the references, so fp32 on a GPU gives the CPU's bits
# (the compiler may contract an fp32 a*b + c*d into an FMA).
_FUSED_DTYPES = (torch.bfloat16, torch.float16)


def _fused_ok(x: torch.Tensor) -> bool:
    return _fused is not None and x.is_cuda and x.dtype in _FUSED_DTYPES


def paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
                    max_query_len, max_seq_len, scale, sliding_window=None, tree_mask=None, tree=None):
    """``tree``: ``tree_rows(tree_mask)``, computed once for a forward's layers."""
    if _triton is not None and q.is_cuda:
        return _triton.paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
                                       max_query_len, max_seq_len, scale, sliding_window, tree_mask, tree=tree)
    return paged_attention_ref(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
                               max_query_len, max_seq_len, scale, sliding_window, tree_mask)


def move_kv(kv_cache, src, dst):
    fn = _kv_move.move_kv if _kv_move is not None and kv_cache.is_cuda else move_kv_ref
    return fn(kv_cache, src, dst)


def build_tree(top_logprobs, top_ids, path_index, anc_index, depth, rank, parent, num_nodes, lookup=None,
               has_lookup=None):
    fn = _tree.build_tree if _tree is not None and top_ids.is_cuda else build_tree_ref
    return fn(top_logprobs, top_ids, path_index, anc_index, depth, rank, parent, num_nodes, lookup, has_lookup)


def top_logprobs(logits, k):
    fn = _tree.top_logprobs if _tree is not None and logits.is_cuda else top_logprobs_ref
    return fn(logits, k)


def tree_rows(tree_mask):
    """What the GPU kernel reads of a draft tree's mask (depths and ancestor
    rows; ``attention_triton.tree_rows``); None where the reference runs."""
    if tree_mask is None or _triton is None or not tree_mask.is_cuda:
        return None
    return _triton.tree_rows(tree_mask)


def dflash_block_attention(q, k_block, v_block, k_cache, v_cache, ctx_lens, block_tables,
                           max_ctx_len, block_lens, scale, causal, sliding_window=None):
    fn = _triton.dflash_block_attention if _triton is not None and q.is_cuda else dflash_block_attention_ref
    return fn(q, k_block, v_block, k_cache, v_cache, ctx_lens, block_tables,
              max_ctx_len, block_lens, scale, causal, sliding_window)


def _rms_norm_fn(x):
    return _fused.rms_norm if _fused_ok(x) else fused.rms_norm


def rms_norm(x, weight, eps, residual=None):
    return _rms_norm_fn(x)(x, weight, eps, residual)


def qkv_rope(q_src, kv_src, num_q_heads, num_kv_heads, head_dim, rope, q_norm, k_norm, eps,
             k_cache=None, v_cache=None, slot_mapping=None):
    pow2 = head_dim >= 2 and head_dim & (head_dim - 1) == 0
    fn = _fused.qkv_rope if _fused_ok(kv_src) and pow2 else fused.qkv_rope
    return fn(q_src, kv_src, num_q_heads, num_kv_heads, head_dim, rope, q_norm, k_norm, eps,
              k_cache, v_cache, slot_mapping)


def context_kv(kv_all, num_kv_heads, head_dim, rope, k_norms, eps, kv_cache, slot_mapping):
    pow2 = head_dim >= 2 and head_dim & (head_dim - 1) == 0
    fn = _fused.context_kv if _fused_ok(kv_all) and pow2 else fused.context_kv
    return fn(kv_all, num_kv_heads, head_dim, rope, k_norms, eps, kv_cache, slot_mapping)


def _silu_mul_fn(gate_up):
    return _fused.silu_mul if _fused_ok(gate_up) else fused.silu_mul


def silu_mul(gate_up):
    return _silu_mul_fn(gate_up)(gate_up)


# Opt-in: the few-row projection kernels lost to cuBLAS and the glue kernels
# on SmolLM2's shapes (H100, 1.5x a layer's projection time at one row,
# results/h100_linear_kernels_smollm2.json); on the 8B shape not measured yet.
FEW_ROW_KERNELS = os.environ.get("SPECRAY_FEW_ROW_KERNELS") == "1"


def _skinny_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """A few rows (a decode step's, a verify block's): one kernel streams
    the weight and builds its input rows (``linear_triton``); more rows go
    to cuBLAS."""
    return (FEW_ROW_KERNELS and _linear is not None and x.is_cuda and x.dtype in _FUSED_DTYPES
            and w.dtype == x.dtype and 0 < x.shape[0] <= _linear.MAX_ROWS and x.dim() == 2 and w.is_contiguous())


def linear(x, w, b=None):
    """``x @ w.T + b`` of ``x`` ``[rows, K]``."""
    return (_linear.linear if _skinny_ok(x, w) else fused_linear.linear)(x, w, b)


def norm_linear(x, norm_weight, eps, residual, w, b=None):
    """``(y, s)``: ``rms_norm(x, norm_weight, eps, residual)`` projected by
    ``w``, and the residual stream ``s``."""
    if _skinny_ok(x, w):
        return _linear.norm_linear(x, norm_weight, eps, residual, w, b)
    y, s = _rms_norm_fn(x)(x, norm_weight, eps, residual)  # not rms_norm: benches wrap the names models call
    return fused_linear.linear(y, w, b), s


def silu_mul_linear(gate_up, w, b=None):
    """``silu_mul(gate_up)`` projected by ``w``."""
    if _skinny_ok(gate_up, w):
        return _linear.silu_mul_linear(gate_up, w, b)
    return fused_linear.linear(_silu_mul_fn(gate_up)(gate_up), w, b)


def argmax(x):
    """``x.argmax(-1)``: on a GPU a chunked kernel (a row per SM is slow
    for a handful of vocabulary-long rows)."""
    return _argmax.argmax(x) if _argmax is not None and x.is_cuda and x.shape[-1] > 0 else x.argmax(-1)


def lookup_drafts(history, rows, lengths, block_len, greedy, drafts, last, min_n, max_n, agree=False):
    fn = _lookup.lookup_drafts if _lookup is not None and history.is_cuda else lookup_drafts_ref
    return fn(history, rows, lengths, block_len, greedy, drafts, last, min_n, max_n, agree)


def block_inputs(start, last, budget, target_tables, draft_tables, block_size, kv_block_size, mask_token_id):
    fn = _glue.block_inputs if _glue is not None and start.is_cuda else block_inputs_ref
    return fn(start, last, budget, target_tables, draft_tables, block_size, kv_block_size, mask_token_id)


def accept_advance(argmax, num_accepted, bonus, drafts, block_len, looked_up, draft_slots, start, last, budget,
                   real, history=None, history_rows=None):
    fn = _glue.accept_advance if _glue is not None and start.is_cuda else accept_advance_ref
    return fn(argmax, num_accepted, bonus, drafts, block_len, looked_up, draft_slots, start, last, budget, real,
              history, history_rows)


__all__ = ["store_kv", "paged_attention", "dflash_block_attention", "rms_norm", "qkv_rope", "context_kv", "silu_mul",
           "linear", "norm_linear", "silu_mul_linear", "argmax", "lookup_drafts",
           "block_inputs", "accept_advance", "move_kv", "tree_rows", "build_tree", "top_logprobs"]
