"""Draft trees on CUDA (``@pytest.mark.gpu``: skipped without a GPU): the
tree attention, KV-move, tree-build and top-logprobs kernels against their
references, tree rows bit for bit a decode launch's, and engines that verify
trees on the GPU emitting the autoregressive engine's tokens."""

from __future__ import annotations

import pytest
import torch
from draft_tree_helpers import OracleDrafts, engine, is_ancestor, random_tree, tree_models
from factories import run_engine_to_end

from specray import SamplingParams
from specray.draft_tree import generic_paths, kv_moves, load_universe, make_universe, row_depths
from specray.kernels.attention import paged_attention_ref
from specray.kernels.kv_move import move_kv_ref as move_kv


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tree_models(tmp_path_factory)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_tree_attention_kernel_matches_the_reference(dtype):
    from kernel_helpers import _f64, _kernels, assert_close, paged_case

    _, _, _, tree = random_tree(S=3, G=15, K=4, vocab=40, seed=4)
    # Three verify blocks of 16 rows and a prefill chunk (causal, -1) in one batch.
    args = paged_case("cuda", dtype, [16, 16, 16, 37], [16 + 40, 16 + 3, 16 + 200, 37 + 9], kv_heads=2, group=3)
    mask = torch.cat([tree.masks.reshape(-1), torch.full((37,), -1, dtype=torch.int32)]).cuda()
    out = _kernels().paged_attention(**args, tree_mask=mask)
    ref = paged_attention_ref(**_f64(args), tree_mask=mask)
    assert_close(out, ref)
    plain = paged_attention_ref(**_f64(args))
    assert (ref[:48] - plain[:48]).abs().max() > 1e-3  # the mask changed the tree rows
    torch.testing.assert_close(ref[48:], plain[48:])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_trees_emit_the_autoregressive_tokens(models, dtype):
    prompts = [[5, 17, 30, 41], [9, 8, 7, 6, 5, 4, 3], [100, 3, 77]]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (40, 33, 21)]
    ar = run_engine_to_end(engine(models, drafter=None, device="cuda", dtype=dtype, cuda_graphs=False),
                           prompts, params)
    # Eager: the oracle patches Python calls. The drafter's nodes alone.
    eng = engine(models, device="cuda", dtype=dtype, cuda_graphs=False, prompt_lookup_min=0)
    OracleDrafts(eng, [p + o.token_ids for p, o in zip(prompts, ar)])
    outs = run_engine_to_end(eng, prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ar]
    assert min(o.metrics.mean_acceptance_length for o in outs) >= 2.0
    # Graphs and async steps (the drafter's own trees) against the CPU's tokens.
    cpu = run_engine_to_end(engine(models), prompts, params)
    for kw in ({"cuda_graphs": True, "async_scheduling": False}, {"cuda_graphs": True, "async_scheduling": True}):
        if dtype == "float32":
            eng = engine(models, device="cuda", dtype=dtype, **kw)
            assert [o.token_ids for o in run_engine_to_end(eng, prompts, params)] == [o.token_ids for o in cpu]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_tree_rows_are_decode_rows_bit_for_bit(dtype):
    """Each tree row of a verify launch gives the bits of a one-token decode
    launch of the same token over its own prefix (context, then its
    ancestors at consecutive positions): speculative greedy output stays the
    autoregressive engine's on the GPU too."""
    from kernel_helpers import _kernels, paged_case

    kern = _kernels()
    S, B = 3, 16
    _, _, _, tree = random_tree(S=S, G=B - 1, K=4, vocab=40, seed=7)
    ctx = [40, 3, 300]
    args = paged_case("cuda", dtype, [B] * S, [c + B for c in ctx], kv_heads=3, group=3, head_dim=64, pad_seq=64)
    mask = tree.masks.reshape(-1).cuda()
    out = kern.paged_attention(**args, tree_mask=mask)
    depths = row_depths(tree)
    bs = args["k_cache"].shape[1]
    tables = args["block_tables"].long().cpu()

    def slot(s, pos):
        return int(tables[s, pos // bs]) * bs + pos % bs

    for i in range(B):
        k, v = args["k_cache"].clone(), args["v_cache"].clone()
        for s in range(S):
            anc = [0] + [j + 1 for j in range(B - 1) if i and is_ancestor(tree, s, i - 1, j)]
            for d, row in enumerate(anc):
                k.view(-1, *k.shape[2:])[slot(s, ctx[s] + d)] = args["k_cache"].view(-1, *k.shape[2:])[slot(s, ctx[s] + row)]
                v.view(-1, *v.shape[2:])[slot(s, ctx[s] + d)] = args["v_cache"].view(-1, *v.shape[2:])[slot(s, ctx[s] + row)]
        q = args["q"].view(S, B, *args["q"].shape[1:])[:, i].contiguous()
        seq_lens = torch.tensor([c + int(depths[s, i]) + 1 for s, c in enumerate(ctx)], device="cuda")
        dec = kern.paged_attention(q, k, v, torch.arange(S + 1, device="cuda"), seq_lens, args["block_tables"],
                                   1, args["max_seq_len"], args["scale"])
        assert torch.equal(dec, out.view(S, B, *out.shape[1:])[:, i]), f"row {i}"


@pytest.mark.gpu
def test_gpu_kv_move_kernel_matches_the_reference():
    from specray.kernels.kv_move_triton import move_kv as move_kv_triton

    torch.manual_seed(0)
    cache = torch.randn(3, 2, 9, 4, 3, 64, device="cuda", dtype=torch.bfloat16)
    ref = cache.clone()
    # Two rows' trees: depth k comes from a row >= k, identity past the path.
    row_slots = torch.tensor([[8, 9, 10, 11, 12, 13], [20, 21, 22, 23, 24, 25]], device="cuda")
    path_rows = torch.tensor([[2, 3, 5, 4, 5], [1, 4, 3, 4, 5]], device="cuda")
    src, dst = kv_moves(row_slots, path_rows)
    move_kv(ref, src, dst)
    move_kv_triton(cache, src, dst)
    assert torch.equal(cache, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("lookup", [False, True])
def test_gpu_tree_build_kernel_matches_the_reference(lookup):
    from specray.default_model import default_drafter_dir
    from specray.kernels.tree import build_tree_ref
    from specray.kernels.tree_triton import build_tree as build_tree_triton

    for universe in (load_universe(default_drafter_dir(), 15), make_universe(generic_paths(15), 15)):
        u = universe.to("cuda")
        g = torch.Generator().manual_seed(11)
        S, G, V = 5, 15, 300
        top = (torch.randn(S, G, V, generator=g) * 3).log_softmax(-1).topk(u.top_k, -1)
        lp, ids = top.values.cuda(), top.indices.cuda()
        lk = has = None
        if lookup:
            lk = torch.randint(0, V, (S, 6), generator=g).cuda()
            has = torch.tensor([True, False, True, True, False]).cuda()
        args = (lp, ids, u.path_index, u.anc_index, u.depth, u.rank, u.parent, G, lk, has)
        for got, want in zip(build_tree_triton(*args), build_tree_ref(*args)):
            assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_top_logprobs_kernel_matches_the_reference(dtype):
    from specray.kernels.tree import top_logprobs_ref
    from specray.kernels.tree_triton import top_logprobs

    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(2, 15, 49152, generator=g) * 4).to(device="cuda", dtype=dtype)
    lp, idx = top_logprobs(logits, 8)
    ref_lp, ref_idx = top_logprobs_ref(logits, 8)
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
    # bf16 logits tie often (11 % of these indices): the kernel puts the
    # lower index first, as a stable descending sort does; torch.topk's
    # order among ties is its own, so only the values are compared with it.
    assert torch.equal(idx, torch.sort(logits, dim=-1, descending=True, stable=True).indices[..., :8])
    assert torch.equal(logits.gather(-1, idx), logits.gather(-1, ref_idx))
