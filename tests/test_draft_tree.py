"""Draft trees (cluster/draft_tree.py): the tree a universe gives, greedy
acceptance over it against a brute-force walk, the tree attention mask
against attention over each node's own prefix, engines that verify trees
emitting the autoregressive engine's tokens, and bench/draft_tree.py's
offline replay against serving. The CUDA kernels and engines:
test_draft_tree_gpu.py."""

from __future__ import annotations

import json

import pytest
import torch
from draft_tree_helpers import OracleDrafts, engine, is_ancestor, random_tree, tree_models
from factories import make_models, run_engine_to_end

from specray import SamplingParams
from specray.config import ConfigError
from specray.draft_tree import (
    accept_greedy,
    DraftTree,
    build,
    generic_paths,
    kv_moves,
    load_universe,
    make_universe,
    path_tokens,
    row_depths,
)
from specray.kernels.attention import paged_attention_ref
from specray.kernels.kv_move import move_kv_ref as move_kv


def test_build_picks_the_best_scoring_closed_tree():
    universe, top, tokens, tree = random_tree()
    S, G = tokens.shape
    for s in range(S):
        for j in range(G):
            p = tree.parent[s, j].item()
            assert p <= j  # parents come first (row p is node p - 1)
            depth_parent = 0 if p == 0 else tree.depth[s, p - 1].item()
            assert tree.depth[s, j].item() == depth_parent + 1
            anc = {j} | ({k for k in range(G) if is_ancestor(tree, s, p - 1, k)} if p else set())
            assert {k for k in range(G) if is_ancestor(tree, s, j, k)} == anc
        # Each node's token is its path's last rank at its depth; its score
        # (sum of the path's log-probabilities) beats every path left out.
        lp = top.values[s]
        scores = {q: sum(lp[d, r].item() for d, r in enumerate(q)) for q in universe.paths}
        chosen = []
        for j in range(G):
            ranks, row = [], j + 1
            while row:
                k = row - 1
                ranks.append(top.indices[s, tree.depth[s, k] - 1].tolist().index(tokens[s, k].item()))
                row = tree.parent[s, k].item()
            chosen.append(tuple(reversed(ranks)))
        assert len(set(chosen)) == G
        worst_in = min(scores[q] for q in chosen)
        best_out = max(v for q, v in scores.items() if q not in chosen)
        assert worst_in >= best_out - 1e-3


def brute_force_accept(argmax_row, tokens_row, parents_row, num_drafts):
    """Walk from the anchor: the real child holding the target's argmax."""
    row, path = 0, []
    while True:
        nxt = [j for j in range(num_drafts) if parents_row[j] == row and tokens_row[j] == argmax_row[row]]
        if not nxt:
            return len(path), argmax_row[row], path
        row = nxt[0] + 1
        path.append(row)


@pytest.mark.parametrize("seed", range(6))
def test_accept_greedy_equals_a_walk_down_the_tree(seed):
    universe, top, tokens, tree = random_tree(S=6, seed=seed)
    S, G = tokens.shape
    g = torch.Generator().manual_seed(100 + seed)
    # Target argmax rows that follow a random root-to-node path for a while.
    argmax = torch.randint(0, 12, (S, G + 1), generator=g)
    for s in range(S):
        node = int(torch.randint(0, G, (1,), generator=g))
        row = node + 1
        while row:
            k = row - 1
            argmax[s, tree.parent[s, k]] = tokens[s, k]
            row = tree.parent[s, k].item()
    num_drafts = torch.tensor([G, G, 3, 0, G, 1])
    acc = accept_greedy(argmax, tokens, tree, num_drafts)
    for s in range(S):
        n, bonus, path = brute_force_accept(argmax[s].tolist(), tokens[s].tolist(), tree.parent[s].tolist(),
                                            int(num_drafts[s]))
        assert acc.num_accepted[s].item() == n
        assert acc.bonus[s].item() == bonus
        assert acc.path_rows[s, :n].tolist() == path
        assert acc.path_rows[s, n:].tolist() == list(range(n + 1, G + 1))  # identity past the path
        assert acc.row_kept[s].nonzero().flatten().tolist() == [0] + path
        assert path_tokens(tokens, acc.path_rows)[s, :n].tolist() == [tokens[s, r - 1].item() for r in path]


def test_a_chain_tree_accepts_what_a_chain_accepts():
    S, G = 3, 5
    j, rows = torch.arange(G), torch.arange(G + 1)
    tree = DraftTree(j.expand(S, -1), (j + 1).expand(S, -1), ((1 << (rows + 1)) - 1).int().expand(S, -1))
    tokens = torch.tensor([[1, 2, 3, 4, 5]] * S)
    argmax = torch.tensor([[1, 2, 9, 4, 5, 6], [1, 2, 3, 4, 5, 6], [7, 2, 3, 4, 5, 6]])
    acc = accept_greedy(argmax, tokens, tree, torch.tensor([G, 3, G]))
    assert acc.num_accepted.tolist() == [2, 3, 0]
    assert acc.bonus.tolist() == [9, 4, 7]
    assert tree.masks[0].tolist() == [(1 << (i + 1)) - 1 for i in range(G + 1)]
    assert row_depths(tree)[0].tolist() == list(range(G + 1))


def test_kv_moves_put_the_accepted_path_at_its_depths():
    L, blocks, bs = 2, 3, 4
    cache = torch.arange(L * 2 * blocks * bs * 2 * 3, dtype=torch.float32).view(L, 2, blocks, bs, 2, 3)
    before = cache.clone()
    row_slots = torch.tensor([[4, 5, 6, 7, 8]])  # a block of 5 rows, slots 4..8
    path_rows = torch.tensor([[2, 4, 3, 4]])  # depth 1 at row 2, depth 2 at row 4; past the path: identity
    move_kv(cache, *kv_moves(row_slots, path_rows))
    flat, old = cache.view(L, 2, -1, 2, 3), before.view(L, 2, -1, 2, 3)
    assert torch.equal(flat[:, :, 5], old[:, :, 6]) and torch.equal(flat[:, :, 6], old[:, :, 8])
    assert torch.equal(flat[:, :, 7], old[:, :, 7]) and torch.equal(flat[:, :, 8], old[:, :, 8])
    assert torch.equal(flat[:, :, 4], old[:, :, 4])


def test_tree_attention_is_attention_over_each_nodes_prefix():
    torch.manual_seed(0)
    _, _, tokens, tree = random_tree(S=2, G=7)
    S, B, H, KVH, D, ctx, bs = 2, 8, 4, 2, 16, 5, 4
    blocks_per_seq = 4
    k_cache = torch.randn(1 + S * blocks_per_seq, bs, KVH, D)
    v_cache = torch.randn_like(k_cache)
    tables = torch.arange(1, 1 + S * blocks_per_seq, dtype=torch.int32).view(S, blocks_per_seq)
    q = torch.randn(S * B, H, D)
    qsl = torch.arange(0, S * B + 1, B)
    seq_lens = torch.full((S,), ctx + B)
    mask = tree.masks.reshape(-1)
    out = paged_attention_ref(q, k_cache, v_cache, qsl, seq_lens, tables, B, ctx + B, D ** -0.5, tree_mask=mask)
    flat_k, flat_v = k_cache.view(-1, KVH, D), v_cache.view(-1, KVH, D)
    for s in range(S):
        slots = [int(tables[s, p // bs]) * bs + p % bs for p in range(ctx + B)]
        for i in range(B):
            bits = int(mask[s * B + i]) & 0xFFFFFFFF
            seen = list(range(ctx)) + [ctx + j for j in range(B) if bits >> j & 1]
            if i:  # a node sees the anchor, its ancestors and itself
                anc = [j + 1 for j in range(B - 1) if is_ancestor(tree, s, i - 1, j)]
                assert seen == list(range(ctx)) + [ctx] + [ctx + a for a in anc]
            k = flat_k[[slots[p] for p in seen]].repeat_interleave(H // KVH, 1)
            v = flat_v[[slots[p] for p in seen]].repeat_interleave(H // KVH, 1)
            w = torch.einsum("hd,khd->hk", q[s * B + i], k).mul(D ** -0.5).softmax(-1)
            torch.testing.assert_close(out[s * B + i], torch.einsum("hk,khd->hd", w, v))


def test_universe_errors_and_the_shipped_file(tmp_path):
    with pytest.raises(ValueError, match="before its parent"):
        make_universe([[0, 1], [0]], 4)
    with pytest.raises(ValueError, match="twice"):
        make_universe([[0], [0]], 4)
    with pytest.raises(ValueError, match="1..4 ranks"):
        make_universe([[0, 0, 0, 0, 0]], 4)
    (tmp_path / "draft_tree.json").write_text(json.dumps({"paths": [[0], [1], [0, 0], [0, 0, 0]]}))
    assert load_universe(str(tmp_path), 2).paths == [(0,), (1,), (0, 0)]  # deeper paths than the block are dropped
    assert len(load_universe(None, 3).paths) == len(generic_paths(3))
    from specray.default_model import default_drafter_dir

    shipped = load_universe(default_drafter_dir(), 15)
    assert shipped.paths[0] == (0,) and len(shipped.paths) == 128


# ----------------------------------------------------------------- engines


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tree_models(tmp_path_factory)


@pytest.mark.parametrize("mode", ["eager", "graphs", "async"])
def test_trees_emit_the_autoregressive_tokens(models, mode):
    prompts = [[5, 17, 30, 41], [9, 8, 7, 6, 5, 4, 3], [100, 3, 77]]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (40, 33, 21)]
    ar = run_engine_to_end(engine(models, drafter=None), prompts, params)
    kw = {"eager": {}, "graphs": {"cuda_graphs": True}, "async": {"cuda_graphs": True, "async_scheduling": True}}[mode]
    kw["prompt_lookup_min"] = 0  # the drafter's nodes alone
    eng = engine(models, **kw)
    assert eng.tree is not None
    OracleDrafts(eng, [p + o.token_ids for p, o in zip(prompts, ar)])
    outs = run_engine_to_end(eng, prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ar]
    # The decoys fill every chain's first draft: only trees accept anything.
    assert min(o.metrics.mean_acceptance_length for o in outs) >= 2.0
    if mode == "async":
        assert eng.num_async_steps > 5
    chain_eng = engine(models, draft_tree=False, **kw)
    OracleDrafts(chain_eng, [p + o.token_ids for p, o in zip(prompts, ar)])
    chained = run_engine_to_end(chain_eng, prompts, params)
    assert [o.token_ids for o in chained] == [o.token_ids for o in ar]
    assert max(o.metrics.mean_acceptance_length for o in chained) < 1.5


def test_a_lookup_takes_the_lowest_scoring_nodes_as_a_chain():
    universe, top, plain, plain_tree = random_tree(S=2, G=7, seed=1)
    lookup = torch.tensor([[50, 51, 52], [60, 61, 62]])
    tokens, tree = build(top.values, top.indices, universe, 7, lookup, torch.tensor([True, False]))
    assert tokens[0, 4:].tolist() == [50, 51, 52]
    assert tree.parent[0, 4:].tolist() == [0, 5, 6] and tree.depth[0, 4:].tolist() == [1, 2, 3]
    assert [is_ancestor(tree, 0, 6, k) for k in range(7)] == [False] * 4 + [True] * 3
    assert not any(is_ancestor(tree, 0, i, k) for i in range(4) for k in range(4, 7))
    # The drafter keeps its best four nodes (a closed tree) in row 0, all seven in row 1.
    kept, _ = build(top.values, top.indices, universe, 4)
    assert tokens[0, :4].tolist() == kept[0].tolist()
    assert torch.equal(tokens[1], plain[1]) and torch.equal(tree.parent[1], plain_tree.parent[1])


@pytest.mark.parametrize("async_", [False, True])
def test_trees_with_lookup_branches_emit_the_autoregressive_tokens(models, async_):
    prompts = [[5, 6, 7, 8, 9] * 4, [9, 8, 7, 6, 5, 4, 3] * 3]
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)] * 2
    ar = run_engine_to_end(engine(models, drafter=None), prompts, params)
    eng = engine(models, prompt_lookup_min=1, cuda_graphs=True, async_scheduling=async_)
    outs = run_engine_to_end(eng, prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ar]
    assert sum(o.metrics.num_lookup_steps for o in outs) > 0


SAMPLED = [SamplingParams(temperature=1.0, seed=3, max_tokens=30, ignore_eos=True),
           SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=4, max_tokens=25, ignore_eos=True),
           SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
           SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=22, ignore_eos=True)]


@pytest.mark.parametrize("mode", ["eager", "graphs", "async"])
def test_sampled_trees_emit_the_autoregressive_samples(models, mode):
    """A sampled row walks its tree with the target's own samples (the
    uniform of each position), so its output is token for token the
    autoregressive engine's with the same seed; greedy rows share the step."""
    prompts = [[5, 17, 30, 41], [9, 8, 7, 6, 5, 4, 3], [100, 3, 77], [12, 13]]
    ar = run_engine_to_end(engine(models, drafter=None), prompts, SAMPLED)
    kw = {"eager": {}, "graphs": {"cuda_graphs": True}, "async": {"cuda_graphs": True, "async_scheduling": True}}[mode]
    kw["prompt_lookup_min"] = 0
    eng = engine(models, **kw)
    calls = []
    propose = eng.drafter.propose
    eng.drafter.propose = lambda batch: calls.append(batch.tree) or propose(batch)
    OracleDrafts(eng, [p + o.token_ids for p, o in zip(prompts, ar)])
    outs = run_engine_to_end(eng, prompts, SAMPLED)
    assert all(calls) and (calls or mode == "async")  # sampled rows draft trees (async: in the step graphs)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ar]
    # The decoys fill every chain's first draft: only the trees accept them
    # (the row at T=0.8 scores its paths at 0.8, which trusts the decoys more).
    assert min(o.metrics.mean_acceptance_length for o in outs[:3]) >= 1.8
    if mode == "async":  # the step graphs drafted and walked the trees themselves
        assert eng.num_async_steps > 5


def test_rows_that_read_verify_rows_keep_sampled_batches_on_chains(models):
    eng = engine(models)
    params = [SamplingParams(temperature=1.0, seed=3, max_tokens=12, logprobs=1), SAMPLED[0]]
    calls = []
    propose = eng.drafter.propose
    eng.drafter.propose = lambda batch: calls.append(batch.tree) or propose(batch)
    run_engine_to_end(eng, [[5, 17, 30, 41], [9, 8, 7]], params)
    assert calls and not all(calls)  # steps with the logprobs row draft chains


def test_draft_tree_where_it_cannot_run_is_refused(tmp_path):
    root = make_models(tmp_path, block_size=8)
    with pytest.raises(ConfigError, match="draft_tree"):
        engine(root, draft_tree=True, num_speculative_tokens=1)
    assert engine(root, num_speculative_tokens=1).tree is None  # unset: chains where trees cannot run


def tree_bench():
    """bench/draft_tree.py as a module."""
    import importlib.util
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "bench"
    sys.path.insert(0, str(bench))
    try:
        spec = importlib.util.spec_from_file_location("draft_tree_bench", bench / "draft_tree.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(bench))
    return mod


def test_replay_follows_a_lookup_branch_that_repeats_a_drafter_token():
    """The drafter's first choice and the lookup both open with token 7; only
    the lookup continues with 8: the replay must accept both (the engine's
    deepest accepted node), not stop in the drafter's subtree."""
    mod = tree_bench()
    G = 3
    top_ids = torch.tensor([[[7, 1], [2, 3], [4, 5]]]).expand(3, -1, -1).contiguous()  # every anchor alike
    top_lp = torch.tensor([[[-0.1, -2.0], [-0.1, -2.0], [-0.1, -2.0]]]).expand(3, -1, -1).contiguous()
    # The prompt is [0]; its first output token 5 is the first step's anchor, 7 8 9 follow.
    seq = {"tokens": [0, 5, 7, 8, 9], "prompt_len": 1, "top_ids": top_ids, "top_lp": top_lp,
           "lookup": torch.tensor([[7, 8, 9], [9, 9, 9], [9, 9, 9]]), "has_lookup": torch.tensor([True, False, False])}
    universe = make_universe(generic_paths(G, 1), G)
    # The drafter's tree is its chain 7, 2, 4: 7 accepted (2 tokens), then the last token alone.
    assert mod.replay([seq], universe, 0) == 1.5
    assert mod.replay([seq], universe, 1) == 1.5  # a lookup branch [7] adds nothing
    # A branch [7, 8] beside the drafter's [7]: accepted to depth 2 below the repeated 7, in one step.
    assert mod.replay([seq], universe, 2) == 3.0


def test_offline_tree_replay_matches_serving(models, tmp_path):
    """bench/draft_tree.py replays chains and trees against the greedy
    continuation; for the universe a drafter ships, with and without a
    lookup branch, it must give what serving measures."""
    import shutil

    from specray import LLM
    from specray.draft_tree import lookup_nodes

    mod = tree_bench()
    drafter = tmp_path / "d"
    shutil.copytree(models / "d", drafter)
    (drafter / "draft_tree.json").write_text(json.dumps({"paths": [list(p) for p in generic_paths(7, 2)]}))
    prompts_file = tmp_path / "p.jsonl"
    prompts = [[5, 6, 7, 8, 9] * 3, [9, 8, 7, 6, 5, 4, 3] * 2, [100, 3, 77, 12]]
    prompts_file.write_text("".join(json.dumps({"id": f"t-{i}", "prompt": p}) + "\n" for i, p in enumerate(prompts)))
    L = lookup_nodes(7)
    report = mod.main(["--target", str(models / "t"), "--drafter", str(drafter), "--prompts", str(prompts_file),
                       "--max-tokens", "30", "--universe", str(drafter / "draft_tree.json"), "--lookup-nodes", str(L)])
    replayed = report["mean_acceptance_length"]
    params = SamplingParams(temperature=0, max_tokens=30)
    for name, kw in (("chain", dict(draft_tree=False, prompt_lookup_min=0)),
                     (str(drafter / "draft_tree.json"), dict(prompt_lookup_min=0)),
                     (f"{drafter / 'draft_tree.json'} + lookup branch of {L}", dict(prompt_lookup_min=1))):
        outs = LLM(models / "t", drafter, max_model_len=96, **kw).generate(prompts, params)
        lengths = [x for o in outs for x in o.metrics.acceptance_lengths]
        assert replayed[name] == round(sum(lengths) / len(lengths), 3), name
