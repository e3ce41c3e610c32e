"""The Triton attention kernels against their PyTorch references on CPU,
through Triton's interpreter: run only when ``TRITON_INTERPRET=1`` is set (they
need triton and take minutes), as ``TRITON_INTERPRET=1 pytest tests/test_kernels_interp.py``."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import _graph_roundtrip, _kernels, check_dflash, check_paged, dflash_case, interp, paged_case


# --------------------------------------------------------------------------
# CPU, through Triton's interpreter (TRITON_INTERPRET=1 only)


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group,head_dim", [(1, 64), (3, 64), (4, 128)])
@pytest.mark.parametrize("window", [None, 5])
def test_paged_attention_interp(dtype, group, head_dim, window):
    args = paged_case("cpu", dtype, [1, 20, 3, 1], [1, 37, 70, 133], kv_heads=2, group=group,
                      head_dim=head_dim, window=window)
    check_paged(args)


@interp
@pytest.mark.parametrize("num_splits", [1, 2, 3])
def test_paged_attention_padded_interp(num_splits):
    args = paged_case("cpu", torch.float32, [16, 0, 1, 5], [16, 0, 150, 33], kv_heads=2, group=4,
                      head_dim=64, pad_q=5, pad_seq=100, window=None, seed=2)
    check_paged(args, num_splits=num_splits)
    args = paged_case("cpu", torch.float32, [16, 1, 5], [70, 150, 33], kv_heads=1, group=3,
                      head_dim=64, block_size=32, window=20, seed=3)
    check_paged(args, num_splits=num_splits)


@interp
def test_paged_attention_prefill_tiles_interp():
    """Several q tiles per sequence (q_len > BLOCK_Q) and a decode row."""
    args = paged_case("cpu", torch.float32, [150, 1], [170, 90], kv_heads=1, group=2, head_dim=64, seed=4)
    check_paged(args)
    args = paged_case("cpu", torch.bfloat16, [300], [300], kv_heads=1, group=1, head_dim=64, window=50, seed=5)
    check_paged(args)


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group,head_dim", [(1, 64), (3, 64), (4, 128)])
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (True, 4), (False, 3)])
def test_dflash_block_attention_interp(dtype, group, head_dim, causal, window):
    args = dflash_case("cpu", dtype, [0, 37, 100], [16, 5, 1], kv_heads=2, group=group, head_dim=head_dim,
                       causal=causal, window=window)
    check_dflash(args)


@interp
@pytest.mark.parametrize("num_splits", [1, 2, 3])
@pytest.mark.parametrize("causal,window", [(False, None), (True, 20), (False, 1)])
def test_dflash_block_attention_padded_interp(num_splits, causal, window):
    args = dflash_case("cpu", torch.float32, [3, 150, 64], [2, 16, 1], kv_heads=2, group=4, head_dim=64,
                       causal=causal, window=window, pad_ctx=100, seed=6)
    check_dflash(args, num_splits=num_splits)


@interp
def test_rewritten_inputs_interp():
    """The graph test's flow (fixed shapes and bounds, new contents) in the
    interpreter, without the graph."""
    paged_rounds = [([5, 5, 1], [40, 100, 150]), ([1, 5, 5], [150, 5, 60])]
    dflash_rounds = [([10, 90], [16, 16]), ([150, 0], [3, 16])]
    _graph_roundtrip(_kernels(), "cpu", torch.float32, paged_rounds, dflash_rounds, num_blocks=40, width=12,
                     kv_heads=1, group=4, head_dim=64)
