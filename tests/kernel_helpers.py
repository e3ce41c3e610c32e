"""Shared pieces of the Triton kernel tests (test_kernels.py,
test_kernels_interp.py, and the kernel tests of test_draft_tree_gpu.py,
test_linear_kernels.py, test_fused_kernels.py): random paged-attention and
DFlash-block cases, the float64 references' tolerance, and the Triton
interpreter's patches.

The reference is evaluated in float64 from the very same inputs, so the
tolerance is the kernel's own error, checked as ``|out - ref| <= atol + rtol *
|ref|``: fp32 kernels with atol = rtol = 1e-4 (measured ~1e-6), bf16 kernels
(bf16 inputs and output, fp32 accumulation) with atol = rtol = 1e-2. For bf16
the output's own rounding is up to 2^-9 relative (1.6e-2 absolute for values
near 4, which short sequences produce: a one-key row returns v itself) and
the bf16 rounding of the probabilities before the P @ V product adds up to
2^-9 * max|v|; torch's own bf16 SDPA shows errors of the same size.
"""

from __future__ import annotations

import os

import pytest
import torch

from specray.kernels.attention import dflash_block_attention_ref, paged_attention_ref

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
interp = pytest.mark.skipif(not INTERP, reason="set TRITON_INTERPRET=1 to run kernels in Triton's interpreter")
TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (1e-2, 1e-2)}  # (atol, rtol)


def assert_close(out, ref):
    """``|out - ref| <= atol + rtol * |ref|`` (``ref`` in float64); returns the
    max absolute error."""
    atol, rtol = TOL[out.dtype]
    diff = (out.double() - ref).abs()
    excess = (diff - rtol * ref.abs()).max().item()
    err = diff.max().item()
    assert excess <= atol, f"max abs err {err:.3e}, max excess over rtol*|ref| {excess:.3e} > atol {atol}"
    return err


def _patch_interpreter():
    """Three gaps of Triton 3.6's interpreter, patched for the interp tests only:
    it turns a scalar into a Python int (``range`` bounds read from memory)
    with ``int(array_of_shape_1)``, which numpy >= 2.4 refuses; and its
    ``tl.dot`` multiplies bf16 operands as their raw uint16 bit patterns;
    and it casts fp32 to bf16 by truncation. Use ``.item()``, widen bf16
    operands to fp32 (exact) before the matmul, which is what the tensor
    cores compute, and round casts to nearest even, as the GPU does."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    if getattr(interpreter, "_specray_patched", False):
        return
    interpreter._specray_patched = True
    orig_patch = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        orig_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch_lang_tensor
    builder_cls = interpreter.InterpreterBuilder
    orig_dot = builder_cls.create_dot

    def widen(h):
        if h.dtype.scalar == tl.bfloat16:
            data = (h.data.astype(np.uint32) << 16).view(np.float32)
            return interpreter.TensorHandle(data, tl.float32)
        return h

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return orig_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    builder_cls.create_dot = create_dot
    orig_cast = builder_cls.cast_impl

    def cast_impl(self, src, dst_type):
        # fp32 -> bf16 truncates in the interpreter; the GPU rounds to
        # nearest even, which the fused kernels' bit-exact tests rely on.
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            u = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32).astype(np.uint64)
            rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
            return interpreter.TensorHandle(rounded, tl.bfloat16)
        return orig_cast(self, src, dst_type)

    builder_cls.cast_impl = cast_impl


def _kernels():
    pytest.importorskip("triton")
    if INTERP:
        _patch_interpreter()
    from specray.kernels import attention_triton

    return attention_triton


# --------------------------------------------------------------------------
# case builders


def _cache_and_tables(gen, device, dtype, lens, width, block_size, kv_heads, head_dim, num_blocks=None):
    """Random K/V caches and block tables: each sequence gets its blocks in
    random, non-contiguous order from a shuffled pool; block 0 is padding."""
    need = [-(-n // block_size) for n in lens]
    num_blocks = num_blocks or 1 + sum(need) + 3
    assert num_blocks > sum(need)
    pool = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    for s, n in enumerate(need):
        tables[s, :n] = torch.tensor([pool.pop() for _ in range(n)], dtype=torch.int32)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    return k_cache, v_cache, tables.to(device)


def paged_case(device, dtype, q_lens, seq_lens, kv_heads=2, group=1, head_dim=64, block_size=16,
               window=None, pad_q=0, pad_seq=0, seed=0, num_blocks=None, width=None):
    """Arguments of ``paged_attention``; ``pad_q`` / ``pad_seq`` make
    ``max_query_len`` / ``max_seq_len`` loose upper bounds (as in a captured,
    padded batch)."""
    gen = torch.Generator().manual_seed(seed)
    max_seq_len = max(seq_lens) + pad_seq
    width = width or -(-max_seq_len // block_size) + 1
    k_cache, v_cache, tables = _cache_and_tables(gen, device, dtype, seq_lens, width, block_size, kv_heads,
                                                 head_dim, num_blocks)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int64)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    q = torch.randn(int(qsl[-1]), kv_heads * group, head_dim, generator=gen).to(device=device, dtype=dtype)
    return dict(
        q=q, k_cache=k_cache, v_cache=v_cache, query_start_loc=qsl.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device), block_tables=tables,
        max_query_len=max(q_lens) + pad_q, max_seq_len=max_seq_len, scale=head_dim**-0.5,
        sliding_window=window,
    )


def dflash_case(device, dtype, ctx_lens, block_lens, B=16, kv_heads=2, group=1, head_dim=64, block_size=16,
                causal=False, window=None, pad_ctx=0, seed=0, num_blocks=None, width=None):
    gen = torch.Generator().manual_seed(seed)
    S = len(ctx_lens)
    max_ctx_len = max(ctx_lens) + pad_ctx
    width = width or -(-max_ctx_len // block_size) + 1
    k_cache, v_cache, tables = _cache_and_tables(gen, device, dtype, ctx_lens, width, block_size, kv_heads,
                                                 head_dim, num_blocks)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    return dict(
        q=rnd(S, B, kv_heads * group, head_dim), k_block=rnd(S, B, kv_heads, head_dim),
        v_block=rnd(S, B, kv_heads, head_dim), k_cache=k_cache, v_cache=v_cache,
        ctx_lens=torch.tensor(ctx_lens, dtype=torch.int64, device=device), block_tables=tables,
        max_ctx_len=max_ctx_len, block_lens=torch.tensor(block_lens, dtype=torch.int64, device=device),
        scale=head_dim**-0.5, causal=causal, sliding_window=window,
    )


def _f64(args):
    return {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in args.items()}


def check_paged(args, **kw):
    out = _kernels().paged_attention(**args, **kw)
    ref = paged_attention_ref(**_f64(args))
    assert out.shape == ref.shape and out.dtype == args["q"].dtype
    return assert_close(out, ref)


def check_dflash(args, **kw):
    out = _kernels().dflash_block_attention(**args, **kw)
    ref = dflash_block_attention_ref(**_f64(args))
    assert out.shape == ref.shape and out.dtype == args["q"].dtype
    return assert_close(out, ref)


def _graph_roundtrip(ak, device, dtype, paged_rounds, dflash_rounds, num_blocks=600, width=300, **shape):
    """Capture one call of each kernel with the first round's inputs, then
    for each later round copy new *contents* (lengths, q_lens regrouped within
    num_tokens, block tables, caches, q) into the captured tensors, replay and
    compare with the reference. Returns the max errors."""
    fixed = dict(num_blocks=num_blocks, width=width, **shape)
    # captured bounds: the largest lengths of any round
    pad_q = max(max(r[0]) for r in paged_rounds) - max(paged_rounds[0][0])
    pad_seq = max(max(r[1]) for r in paged_rounds) - max(paged_rounds[0][1])
    pad_ctx = max(max(r[0]) for r in dflash_rounds) - max(dflash_rounds[0][0])
    p = paged_case(device, dtype, *paged_rounds[0], seed=0, pad_q=pad_q, pad_seq=pad_seq, **fixed)
    d = dflash_case(device, dtype, *dflash_rounds[0], seed=0, pad_ctx=pad_ctx, **fixed)
    cuda = device != "cpu"
    for _ in range(2):  # compile and warm up outside the capture
        ak.paged_attention(**p)
        ak.dflash_block_attention(**d)
    if cuda:
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            p_out = ak.paged_attention(**p)
            d_out = ak.dflash_block_attention(**d)
    errs = []
    for rnd, (pl, dl) in enumerate(zip(paged_rounds[1:], dflash_rounds[1:]), start=1):
        p2 = paged_case(device, dtype, *pl, seed=rnd, **fixed)
        d2 = dflash_case(device, dtype, *dl, seed=rnd, **fixed)
        for src, dst in ((p2, p), (d2, d)):
            for name, t in src.items():
                if torch.is_tensor(t):
                    dst[name].copy_(t)
            dst["sliding_window"] = src["sliding_window"]
        if cuda:
            graph.replay()
            torch.cuda.synchronize()
        else:  # the interpreter has no graphs: a plain call with the captured bounds
            p_out = ak.paged_attention(**p)
            d_out = ak.dflash_block_attention(**d)
        errs.append(assert_close(p_out, paged_attention_ref(**_f64(p))))
        errs.append(assert_close(d_out, dflash_block_attention_ref(**_f64(d))))
    return errs
