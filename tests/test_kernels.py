"""Triton attention and argmax kernels on CUDA against their PyTorch
references over many shapes (``@pytest.mark.gpu``: skipped without a GPU);
the CPU runs of the same attention comparisons, through Triton's
interpreter, are test_kernels_interp.py. Case builders and tolerances:
kernel_helpers.py."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import (_f64, _graph_roundtrip, _kernels, assert_close, check_dflash, check_paged, dflash_case,
                            paged_case)

from specray.kernels.attention import paged_attention_ref


# --------------------------------------------------------------------------
# GPU

# (q_lens, seq_lens): prefill chunks, verify blocks of 16 and decode rows,
# mixed in one batch; seq_lens mostly not multiples of the block size
MIXED = [
    ([1], [1]),
    ([1, 1, 1, 1], [1, 17, 1000, 4097]),
    ([16, 16, 16], [16, 100, 2049]),
    ([300, 16, 1, 16, 1, 77], [300, 531, 2000, 16, 64, 1077]),
    ([1000, 1, 16], [1500, 3000, 40]),
]


# (GQA group, head_dim): every kernel variant compiles once (~1-3 s), so the
# grid takes the three groups and both head dims without their full product
GROUPS_DIMS = [(1, 64), (3, 128), (4, 128), (4, 64)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("group,head_dim", GROUPS_DIMS)
@pytest.mark.parametrize("lens", MIXED)
def test_paged_attention_gpu(dtype, group, head_dim, lens):
    q_lens, seq_lens = lens
    check_paged(paged_case("cuda", dtype, q_lens, seq_lens, kv_heads=2, group=group, head_dim=head_dim))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window", [1, 7, 128, 1000])
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_paged_attention_window_gpu(dtype, window, num_splits):
    args = paged_case("cuda", dtype, [300, 16, 1, 16, 1], [300, 531, 2000, 16, 1077],
                      kv_heads=2, group=4, head_dim=128, window=window, seed=1)
    check_paged(args, num_splits=num_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_splits", [None, 1, 2, 5, 16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_paged_attention_padded_gpu(dtype, num_splits, block_size):
    """Loose max_query_len / max_seq_len (a padded, captured batch), a
    sequence of length 0 with no query rows, and forced KV splits. The
    batch is decode-shaped (max_query_len <= 64): the loose max_query_len
    adds q tiles that return at once (4 instead of 2), while max_seq_len is
    not read by such a launch (its splits follow the grid alone); its slack
    only widens the block table. A loose max_seq_len that changes the
    launch: ``test_paged_attention_loose_bounds_gpu``."""
    args = paged_case("cuda", dtype, [16, 1, 0, 5, 16], [16, 999, 0, 4000, 33], kv_heads=4, group=2,
                      head_dim=128, block_size=block_size, pad_q=9, pad_seq=3000, seed=2)
    check_paged(args, num_splits=num_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_paged_attention_loose_bounds_gpu(dtype, monkeypatch):
    """A prefill-shaped batch (max_query_len > 64), whose split heuristic
    reads both bounds: max_query_len sets the grid's q tiles and max_seq_len
    caps the splits at one per 4 KV tiles. Its captured (loose) bounds
    therefore pick another split count than the tight ones (on the H200:
    2 -> 6 in bf16, 3 -> 2 in fp32), with splits that own no KV tile of
    these short sequences; both launches match the reference."""
    kern = _kernels()
    picked = []
    pick = kern._pick_splits

    def spy(*a):
        picked.append(pick(*a))
        return picked[-1]

    monkeypatch.setattr(kern, "_pick_splits", spy)
    q_lens, seq_lens = [80, 1, 0, 16], [100, 300, 0, 40]
    args = paged_case("cuda", dtype, q_lens, seq_lens, kv_heads=4, group=2, head_dim=128, pad_q=100,
                      pad_seq=3000, seed=3)
    check_paged(args | {"max_query_len": max(q_lens), "max_seq_len": max(seq_lens)})  # tight
    check_paged(args)  # loose: 180 and 3300
    assert len(picked) == 2
    # The heuristic scales with the SM count; the case was tuned for the H200's 132.
    if torch.cuda.get_device_properties(0).multi_processor_count == 132:
        assert picked[0] != picked[1], f"split counts {picked}: the loose bounds no longer change the launch"


@pytest.mark.gpu
@pytest.mark.parametrize("kv_heads,group,head_dim", [(3, 3, 64), (2, 4, 128)])
@pytest.mark.parametrize("ctx_lens", [[37], [700], [1020], [37, 300, 511, 700, 1020, 1500, 2047, 4000]])
# No loose-max_seq_len variant: a decode-shaped launch (max_query_len <= 64)
# never reads max_seq_len (split count from the grid alone, tiles from one
# token), so it would repeat the tight launch. The splits vary instead: the
# heuristic's count (11 or 16 on the H200 at these small grids: at most one
# KV tile a split for the shorter contexts) and 3 forced (many tiles a split,
# as large batches get); the block and its rows get the same count.
@pytest.mark.parametrize("num_splits", [None, 3])
def test_verify_rows_are_decode_rows_gpu(kv_heads, group, head_dim, ctx_lens, num_splits):
    """A 16-token verify block's attention rows equal, bit for bit in bf16,
    those of the decode steps that would have computed the same positions
    one at a time (same sequences, each a position further): greedy
    speculative decoding then emits exactly the autoregressive tokens.
    Keys with a few large scores, as real attention has, and contexts whose
    KV tiles fall into splits differently for the block and its rows. The
    block is also checked against the reference, so that agreeing rows are
    right ones."""
    B = 16
    gen = torch.Generator().manual_seed(7)
    args = paged_case("cuda", torch.bfloat16, [B] * len(ctx_lens), [c + B for c in ctx_lens], kv_heads=kv_heads,
                      group=group, head_dim=head_dim, seed=7)
    sink = torch.randn(kv_heads, head_dim, generator=gen).to("cuda", torch.bfloat16) * 6
    args["k_cache"].view(-1, kv_heads, head_dim)[::97] = sink  # every 97th slot: a strong key
    kern = _kernels()
    block = kern.paged_attention(**args, num_splits=num_splits)
    assert_close(block, paged_attention_ref(**_f64(args)))
    q = args["q"].view(len(ctx_lens), B, *args["q"].shape[1:])
    S = len(ctx_lens)
    for i in range(B):
        seq_lens = torch.tensor([c + i + 1 for c in ctx_lens], device="cuda")
        step = kern.paged_attention(q[:, i].contiguous(), args["k_cache"], args["v_cache"],
                                    torch.arange(S + 1, device="cuda"), seq_lens, args["block_tables"], 1,
                                    int(seq_lens.max()), args["scale"], num_splits=num_splits)
        torch.testing.assert_close(block.view(S, B, *block.shape[1:])[:, i], step, atol=0, rtol=0,
                                   msg=lambda m: f"row {i}: {m}")


@pytest.mark.gpu
def test_paged_attention_prefill_2k_gpu():
    args = paged_case("cuda", torch.bfloat16, [2048, 16, 1], [2048, 2064, 4000], kv_heads=8, group=4,
                      head_dim=128, seed=3)
    check_paged(args)


@pytest.mark.gpu
def test_paged_attention_non_contiguous_q_gpu():
    """q as a strided view of a fused qkv projection, caches as views of a
    [layers, 2, ...] tensor (how the models call it)."""
    args = paged_case("cuda", torch.bfloat16, [16, 1, 40], [100, 1500, 40], kv_heads=2, group=4,
                      head_dim=128, seed=4)
    n, hq, d = args["q"].shape
    qkv = torch.randn(n, (hq + 4) * d, device="cuda", dtype=torch.bfloat16)
    q = qkv[:, : hq * d].view(n, hq, d)
    q.copy_(args["q"])
    kv = torch.stack([args["k_cache"], args["v_cache"]])[None].expand(2, -1, -1, -1, -1, -1).contiguous()
    check_paged({**args, "q": q, "k_cache": kv[1, 0], "v_cache": kv[1, 1]})


DFLASH = [
    # (ctx_lens, block_lens)
    ([5], [16]),
    ([0, 37, 1000], [16, 16, 16]),
    ([1, 100, 4000, 17], [16, 3, 1, 9]),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("group,head_dim", GROUPS_DIMS)
@pytest.mark.parametrize("causal,window", [(False, None), (True, 64)])  # the padded test takes all four
def test_dflash_block_attention_gpu(dtype, group, head_dim, causal, window):
    for seed, (ctx_lens, block_lens) in enumerate(DFLASH):
        check_dflash(dflash_case("cuda", dtype, ctx_lens, block_lens, group=group, head_dim=head_dim,
                                 causal=causal, window=window, seed=seed))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_splits", [None, 1, 3, 8])
@pytest.mark.parametrize("causal,window", [(False, None), (True, 5), (False, 3), (True, 1)])
def test_dflash_block_attention_padded_gpu(dtype, num_splits, causal, window):
    args = dflash_case("cuda", dtype, [3, 700, 2049, 64], [2, 16, 7, 1], kv_heads=8, group=4, head_dim=128,
                       causal=causal, window=window, pad_ctx=1500, seed=6)
    check_dflash(args, num_splits=num_splits)


@pytest.mark.gpu
def test_cuda_graph_capture_gpu():
    ak = _kernels()
    # paged: (q_lens, seq_lens), 34 tokens each round; dflash: (ctx_lens, block_lens)
    paged_rounds = [([16, 16, 1, 1], [40, 1000, 4000, 7]),
                    ([1, 16, 16, 1], [3500, 16, 1777, 2]),
                    ([1, 1, 16, 16], [1, 1, 3000, 4000])]
    dflash_rounds = [([10, 900, 3000], [16, 16, 16]),
                     ([3400, 1, 77], [16, 4, 1]),
                     ([0, 0, 1], [16, 1, 16])]
    _graph_roundtrip(ak, "cuda", torch.bfloat16, paged_rounds, dflash_rounds, kv_heads=4, group=4, head_dim=128)


@pytest.mark.gpu
def test_ops_dispatch_gpu():
    pytest.importorskip("triton")
    from specray.kernels import ops
    from specray.kernels.attention_triton import dflash_block_attention, paged_attention

    args = paged_case("cuda", torch.bfloat16, [16, 1], [100, 50], kv_heads=2, group=4, head_dim=128)
    torch.testing.assert_close(ops.paged_attention(**args), paged_attention(**args), atol=0, rtol=0)
    dargs = dflash_case("cuda", torch.bfloat16, [100, 50], [16, 16], kv_heads=2, group=4, head_dim=128)
    torch.testing.assert_close(ops.dflash_block_attention(**dargs), dflash_block_attention(**dargs), atol=0, rtol=0)


# ------------------------------------------------------------------ argmax
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 49152), (16, 49152), (8, 16, 49152), (3, 4097), (5, 100), (4, 151936)])
def test_argmax_gpu(dtype, shape, monkeypatch):
    from specray.kernels import argmax_triton
    from specray.kernels.argmax_triton import argmax

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(*shape, device="cuda", generator=g).to(dtype)
    rows = x.view(-1, shape[-1])
    V = shape[-1]
    # Ties inside a chunk, across chunks, and a row of -inf: the lowest index wins.
    rows[0, V // 3] = rows[0, V - 1] = rows[0, 1] = 100.0
    if rows.shape[0] > 1:
        rows[1] = float("-inf")
    if rows.shape[0] > 2:
        rows[2, V - 1] = rows[2, V - 2] = 50.0
    want = x.argmax(-1)
    assert torch.equal(argmax(x), want)

    # Which rows the chunk kernel reads: (first row's address, row stride).
    seen = []
    kernel = argmax_triton._chunk_argmax_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(r, row_stride, *rest, **kw):
                seen.append((r.data_ptr(), row_stride))
                return kernel[grid](r, row_stride, *rest, **kw)
            return launch

    monkeypatch.setattr(argmax_triton, "_chunk_argmax_kernel", Spy())
    # Rows V + 3 apart (unaligned) whose leading dims merge: the kernel
    # reads them in place, with their stride. The padding past V holds the
    # largest values, so reading past V or stepping rows by V gives other
    # indices.
    wide = torch.full((*shape[:-1], V + 3), 1000.0, device="cuda", dtype=dtype)
    wide[..., :V] = x
    assert torch.equal(argmax(wide[..., :V]), want)
    n_rows = rows.shape[0]  # a single row's stride is normalised to V by reshape, and unused
    assert seen[-1] == (wide.data_ptr(), V + 3 if n_rows > 1 else V), "the wrapper copied rows it can read in place"
    if len(shape) == 3:
        # The engine's verify logits, logits.view(S, B, V)[:, :G + 1] when
        # the blocks are cut short: at S = 1 a view, read in place; at S > 1
        # the dims do not merge and the wrapper copies (reshape) first.
        one = x[:1, :-3]
        assert torch.equal(argmax(one), one.argmax(-1))
        assert seen[-1] == (x.data_ptr(), V)
        cut = x[:, :-3]
        assert torch.equal(argmax(cut), cut.argmax(-1))
    # A transposed view (last stride != 1): the wrapper copies it first.
    t = x.view(-1, V)[:, :64].t()
    assert torch.equal(argmax(t), t.argmax(-1))
