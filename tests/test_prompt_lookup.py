"""Prompt-lookup drafts: the n-gram index against a plain search, the merge
with the drafter's drafts, and the engine staying lossless with them
(greedy: the autoregressive tokens; sampled: the target's distribution)."""

import random

import pytest
import torch

from factories import make_drafter, make_target
from joint_sampling import pooled_chi2_p, sampled_triples
from specray import LLM, SamplingParams
from specray.plan import DraftOutput
from specray.prompt_lookup import NgramIndex, merge_lookup_drafts
from specray.sampling import SamplingTensors


def plain_lookup(tokens, lo, hi, k):
    """The definition: longest suffix n-gram first, its most recent earlier
    occurrence, the k tokens after it."""
    L = len(tokens)
    for n in range(min(hi, L), lo - 1, -1):
        for i in range(L - n - 1, -1, -1):
            if tokens[i : i + n] == tokens[L - n :]:
                return tokens[i + n : i + n + k]
    return []


def test_index_matches_a_plain_search_as_tokens_arrive():
    rng = random.Random(0)
    for lo, hi in [(1, 3), (2, 4), (3, 3)]:
        for _ in range(20):
            prompt = [rng.randrange(6) for _ in range(rng.randrange(1, 30))]
            output, idx = [], NgramIndex(lo, hi)
            for _ in range(40):
                output += [rng.randrange(6) for _ in range(rng.randrange(1, 4))]  # a step emits 1..3 tokens
                assert idx.propose(prompt, output, 5) == plain_lookup(prompt + output, lo, hi, 5)


def _random_histories(rng, rows, width, vocab):
    """Rows of 1..width - 10 tokens from a small vocabulary (many repeats),
    each followed by junk the lookup must not read."""
    tokens = [[rng.randrange(vocab) for _ in range(rng.randrange(1, width - 10))] for _ in range(rows)]
    history = torch.tensor([[rng.randrange(vocab) for _ in range(width)] for _ in range(rows)])
    for i, t in enumerate(tokens):
        history[i, : len(t)] = torch.tensor(t)
    return tokens, history, torch.tensor([len(t) for t in tokens])


def test_device_lookup_reference_is_the_index_rule():
    """kernels/lookup.py (the asynchronous steps' lookups) drafts what the
    host's rule drafts, padded as the merge pads it."""
    from specray.kernels.lookup import ngram_lookup_ref

    rng = random.Random(1)
    for lo, hi in [(1, 3), (2, 4), (3, 3)]:
        tokens, history, lengths = _random_histories(rng, 60, 70, 5)
        drafts, found = ngram_lookup_ref(history, lengths, lo, hi, 6)
        for i, t in enumerate(tokens):
            want = plain_lookup(t, lo, hi, 6)
            assert bool(found[i]) == bool(want), (t, want)
            if want:
                assert drafts[i].tolist() == (want + [want[-1]] * 6)[:6], (t, want, drafts[i])
        assert 0 < int(found.sum()) < len(tokens)


def _lookup_case(rng, lo, hi, width, vocab, device):
    """A batch of 33 rows over a 40-row history (rows picked out of order),
    random block lengths (some 1: no lookup) and greedy rows."""
    _, history, lengths = _random_histories(rng, 40, width, vocab)
    rows = torch.randperm(40, generator=torch.Generator().manual_seed(rng.randrange(1000)))[:33]
    G = 15
    args = (history.to(device), rows.to(device), lengths[rows].to(device),
            torch.tensor([rng.choice([1, 2, 16, 16]) for _ in range(33)], device=device),
            torch.tensor([rng.random() < 0.7 for _ in range(33)], device=device),
            torch.randint(0, vocab, (33, G + 4), generator=torch.Generator().manual_seed(7))[:, :G].to(device),
            torch.randint(0, vocab, (33,), generator=torch.Generator().manual_seed(8)).to(device))
    return args, (lo, hi)


def test_lookup_drafts_reference_merges_by_the_rules():
    """A row takes its lookup draft only when found, verifying drafts and
    greedy; the block's first id is its last token."""
    from specray.kernels.lookup import lookup_drafts_ref, ngram_lookup_ref

    rng = random.Random(3)
    (history, rows, lengths, block_len, greedy, drafts, last), (lo, hi) = _lookup_case(rng, 2, 4, 70, 4, "cpu")
    ids, merged, looked_up = lookup_drafts_ref(history, rows, lengths, block_len, greedy, drafts, last, lo, hi)
    found_drafts, found = ngram_lookup_ref(history[rows], lengths, lo, hi, drafts.shape[1])
    for s in range(len(rows)):
        take = bool(found[s]) and int(block_len[s]) > 1 and bool(greedy[s])
        assert bool(looked_up[s]) == take
        assert merged[s].tolist() == (found_drafts[s] if take else drafts[s]).tolist()
        assert ids[s].tolist() == [int(last[s])] + merged[s].tolist()
    assert 0 < int(looked_up.sum()) < int(found.sum())  # some found rows are refused
    _, _, all_rows = lookup_drafts_ref(history, rows, lengths, block_len, None, drafts, last, lo, hi)
    assert torch.equal(all_rows, found & (block_len > 1))
    # agree: a row's lookup is taken only where it opens with the drafter's first draft.
    drafts[::2, 0] = found_drafts[::2, 0]
    _, merged, agreed = lookup_drafts_ref(history, rows, lengths, block_len, greedy, drafts, last, lo, hi, agree=True)
    _, _, plain = lookup_drafts_ref(history, rows, lengths, block_len, greedy, drafts, last, lo, hi)
    assert torch.equal(agreed, plain & (found_drafts[:, 0] == drafts[:, 0]))
    assert 0 < int(agreed.sum()) < int(plain.sum())
    assert torch.equal(merged, torch.where(agreed[:, None], found_drafts, drafts))


@pytest.mark.gpu
def test_device_lookup_kernel_matches_reference():
    pytest.importorskip("triton")
    from specray.kernels.lookup import lookup_drafts_ref, ngram_lookup_ref
    from specray.kernels.lookup_triton import lookup_drafts

    rng = random.Random(2)
    for lo, hi, width, vocab in [(1, 3, 70, 5), (2, 4, 1500, 3), (2, 4, 3000, 40), (3, 6, 600, 4)]:
        args, _ = _lookup_case(rng, lo, hi, width, vocab, "cuda")
        history, rows, lengths, drafts = args[0], args[1], args[2], args[5]
        drafts[::2, 0] = ngram_lookup_ref(history[rows], lengths, lo, hi, 1)[0][::2, 0]  # half the rows agree
        for greedy in (args[4], None):
            for agree in (False, True):
                a = args[:4] + (greedy,) + args[5:]
                want = lookup_drafts_ref(*a, lo, hi, agree)
                got = lookup_drafts(*a, lo, hi, agree)
                assert all(torch.equal(g, w) for g, w in zip(got, want)), (lo, hi, width, agree)
                assert int(want[2].sum()) > 0


def test_index_examples():
    idx = NgramIndex(2, 4)
    # "7 8" occurred twice: the most recent one (followed by 5) wins.
    assert idx.propose([1, 7, 8, 9, 9, 7, 8, 5, 6], [2, 7, 8], 3) == [5, 6, 2]
    assert NgramIndex(2, 4).propose([1, 2, 3], [4], 3) == []  # no repeated bigram
    # The longer match ("1 2 3", followed by 9) wins over the more recent "2 3" (followed by 7).
    assert NgramIndex(2, 4).propose([5, 1, 2, 3, 9, 0, 2, 3, 7], [1, 2, 3], 2) == [9, 0]


def test_merge_takes_lookup_rows_and_keeps_q_exact():
    S, G, K = 3, 4, 5
    g = torch.Generator().manual_seed(0)
    drafter = DraftOutput(torch.randint(0, 50, (S, G), generator=g), torch.randint(0, 50, (S, G, K), generator=g),
                          torch.rand(S, G, K, generator=g).softmax(-1))
    lookup = [[7, 8], [], [9, 10, 11, 12, 13]]
    sampled = SamplingTensors.build([SamplingParams(temperature=1.0)] * S, [0, 1, 2], [0, 0, 0], G + 1)
    out = merge_lookup_drafts(drafter, lookup, G, sampled, torch.device("cpu"))
    assert out.tokens.tolist() == [[7, 8, 8, 8], drafter.tokens[1].tolist(), [9, 10, 11, 12]]
    assert torch.equal(out.draft_idx[1], drafter.draft_idx[1]) and torch.equal(out.draft_q[1], drafter.draft_q[1])
    for s in (0, 2):  # the drafted token carries all the mass, whichever index names it
        q_of_draft = (out.draft_q[s] * (out.draft_idx[s] == out.tokens[s][:, None])).sum(-1)
        assert torch.equal(q_of_draft, torch.ones(G))
    greedy = SamplingTensors.build([SamplingParams(temperature=0)] * S, [0, 1, 2], [0, 0, 0], G + 1)
    assert merge_lookup_drafts(DraftOutput(drafter.tokens, None, None), lookup, G, greedy,
                               torch.device("cpu")).draft_idx is None
    # Every row looked up: no drafter output is needed.
    alone = merge_lookup_drafts(None, [[1], [2, 3], [4]], G, sampled, torch.device("cpu"))
    assert alone.tokens.tolist() == [[1] * 4, [2, 3, 3, 3], [4] * 4] and torch.equal(alone.draft_q, torch.ones(S, G, 1))
    with pytest.raises(AssertionError):
        merge_lookup_drafts(None, [[1], []], G, sampled, torch.device("cpu"))


def test_agreeing_merge_takes_only_lookups_that_open_with_the_drafters_token():
    S, G, K = 3, 4, 5
    g = torch.Generator().manual_seed(1)
    drafter = DraftOutput(torch.tensor([[7, 1, 2, 3], [9, 1, 2, 3], [4, 5, 6, 7]]),
                          torch.randint(0, 50, (S, G, K), generator=g), torch.rand(S, G, K, generator=g).softmax(-1))
    lookup = [[7, 8], [10, 11], []]  # row 0 agrees, row 1 does not, row 2 has none
    cpu = torch.device("cpu")
    greedy = SamplingTensors.build([SamplingParams(temperature=0)] * S, [0, 1, 2], [0, 0, 0], G + 1)
    out = merge_lookup_drafts(DraftOutput(drafter.tokens, None, None), lookup, G, greedy, cpu, agree=True)
    assert out.tokens.tolist() == [[7, 8, 8, 8], [9, 1, 2, 3], [4, 5, 6, 7]]
    # A sampled row keeps the plain rule (its drafter token is a draw from q, not a choice to agree with).
    mixed = SamplingTensors.build([SamplingParams(temperature=0), SamplingParams(temperature=1.0),
                                   SamplingParams(temperature=0)], [0, 1, 2], [0, 0, 0], G + 1)
    out = merge_lookup_drafts(drafter, lookup, G, mixed, cpu, agree=True)
    assert out.tokens.tolist() == [[7, 8, 8, 8], [10, 11, 11, 11], [4, 5, 6, 7]]
    assert torch.equal(out.draft_idx[2], drafter.draft_idx[2]) and torch.equal(out.draft_q[1, :, 0], torch.ones(G))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("lookup")
    hf = make_target(root / "t", seed=4, vocab_size=64)
    make_drafter(root / "d", hf.config, block_size=6)
    return root


# Repetitive prompts, so that lookups fire from the first step.
PROMPTS = [[5, 6, 7, 8] * 6, list(range(2, 40)) * 2, [3, 9, 3, 9, 11], [20, 21]]


def test_greedy_with_lookup_is_the_autoregressive_output(ckpt):
    greedy = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    ar = [o.token_ids for o in LLM(ckpt / "t").generate(PROMPTS, greedy)]
    for static in (False, True):
        spec = LLM(ckpt / "t", ckpt / "d", cuda_graphs=static, prompt_lookup_min=1).generate(PROMPTS, greedy)
        assert [o.token_ids for o in spec] == ar
        assert sum(o.metrics.num_lookup_steps for o in spec) > 10
    off = LLM(ckpt / "t", ckpt / "d", prompt_lookup_min=0).generate(PROMPTS, greedy)
    assert [o.token_ids for o in off] == ar and all(o.metrics.num_lookup_steps == 0 for o in off)
    agree = LLM(ckpt / "t", ckpt / "d", prompt_lookup_min=1, prompt_lookup_agree=True).generate(PROMPTS, greedy)
    assert [o.token_ids for o in agree] == ar


def test_sampled_with_lookup_keeps_the_target_distribution(tmp_path):
    """20k seeded 3-token requests through the engine with lookups on (and
    firing): the joint distribution of the tokens is the target's."""
    N = 20_000
    outs, cells, joint = sampled_triples(tmp_path, [2, 5, 3, 2, 6], N, prompt_lookup_min=1,
                                         prompt_lookup_sampled=True)
    assert len(outs) == N and sum(o.metrics.num_lookup_steps for o in outs) > 0.2 * N
    assert pooled_chi2_p(cells, joint) > 1e-3


def test_prompt_lookup_bench_reports_identical_tokens(ckpt, tmp_path):
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "prompt_lookup.py"
    spec = importlib.util.spec_from_file_location("prompt_lookup_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"t-{c}-0{i}", "prompt": [5, 6, 7, 8] * (i + 2)}) + "\n"
                               for i, c in enumerate(["code", "chat", "code"])))
    report = mod.main(["--target", str(ckpt / "t"), "--drafter", str(ckpt / "d"), "--prompts", str(prompts),
                       "--max-tokens", "24", "--settings", "2,4", "1,3"])
    assert report["n"] == 3 and set(report["drafter_alone"]["by_category"]) == {"code", "chat"}
    for r in report["with_lookup"]:
        assert r["identical_to_drafter_alone"] == 3 and r["lookup_step_fraction"] > 0


def test_agreeing_lookups_default_to_the_async_engine():
    """``prompt_lookup_agree`` left unset follows ``async_scheduling`` (its
    step graphs run the drafter every step anyway); a setting given wins."""
    from specray.config import EngineConfig

    assert EngineConfig("t", cuda_graphs=True, async_scheduling=True).prompt_lookup_agree is True
    assert EngineConfig("t").prompt_lookup_agree is False
    assert EngineConfig("t", cuda_graphs=True, async_scheduling=True, prompt_lookup_agree=False).prompt_lookup_agree is False
    assert EngineConfig("t", prompt_lookup_agree=True).prompt_lookup_agree is True


def test_sampled_requests_skip_lookups_unless_asked(ckpt):
    sampled = SamplingParams(max_tokens=30, temperature=0.8, seed=3, ignore_eos=True)
    plain = LLM(ckpt / "t", ckpt / "d", prompt_lookup_min=1).generate(PROMPTS, sampled)
    assert all(o.metrics.num_lookup_steps == 0 for o in plain)
    asked = LLM(ckpt / "t", ckpt / "d", prompt_lookup_min=1, prompt_lookup_sampled=True).generate(PROMPTS, sampled)
    assert sum(o.metrics.num_lookup_steps for o in asked) > 0


def test_offline_policy_replay_matches_serving(ckpt, tmp_path):
    """bench/draft_policies.py scores drafts against the greedy continuation
    and replays steps offline; for the drafter alone and for the engine's
    own rule (lookup first) it must give what serving measures."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "draft_policies.py"
    spec = importlib.util.spec_from_file_location("draft_policies", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"t-{c}-{i}", "prompt": p}) + "\n"
                               for i, (c, p) in enumerate(zip(["a", "b", "a", "b"], PROMPTS))))
    report = mod.main(["--target", str(ckpt / "t"), "--drafter", str(ckpt / "d"), "--prompts", str(prompts),
                       "--max-tokens", "40", "--feed", "1"])
    params = SamplingParams(temperature=0, max_tokens=40)
    for name, lookup_min in (("drafter", 0), ("lookup 2..4 first", 2)):
        outs = LLM(ckpt / "t", ckpt / "d", prompt_lookup_min=lookup_min, draft_tree=False).generate(PROMPTS, params)
        steps = sum(len(o.metrics.acceptance_lengths) for o in outs)
        served = sum(sum(o.metrics.acceptance_lengths) for o in outs) / steps
        got = report["policies"][name]
        assert got["steps"] == steps and got["mean_acceptance_length"] == round(served, 3), (name, got, served)
    pol = report["policies"]
    assert pol["oracle: any"]["mean_acceptance_length"] >= max(
        v["mean_acceptance_length"] for k, v in pol.items() if not k.startswith("oracle"))
    assert set(report["teacher_forced_all_anchors"]) == {"one pass", "second pass shown 1"}


def test_lookup_minimum_defaults_to_one_only_where_lookups_must_agree():
    """A one-token suffix is a weak cue unless the drafter vets it: the
    default minimum is 1 under agreeing lookups (the async default) and 2
    where a lookup replaces the drafter; an explicit value wins."""
    from specray.config import ConfigError, EngineConfig

    assert EngineConfig(target="t").prompt_lookup_min == 2
    assert EngineConfig(target="t", prompt_lookup_agree=True).prompt_lookup_min == 1
    assert EngineConfig(target="t", cuda_graphs=True, async_scheduling=True).prompt_lookup_min == 1
    assert EngineConfig(target="t", cuda_graphs=True, async_scheduling=True,
                        prompt_lookup_agree=False).prompt_lookup_min == 2
    assert EngineConfig(target="t", prompt_lookup_agree=True, prompt_lookup_min=3).prompt_lookup_min == 3
    assert EngineConfig(target="t", prompt_lookup_min=0).prompt_lookup_min == 0
    with pytest.raises(ConfigError, match="prompt_lookup_min"):
        EngineConfig(target="t", prompt_lookup_min=-1)


def test_history_rows_go_to_requests_that_look_up():
    """The step graphs' token history (step_buffers.HistorySlots): a greedy
    request gets a row of its own and its tokens uploaded once; a sampled
    one, whose rows never look up, the padding row and no uploads."""
    from specray.request import Request
    from specray.step_buffers import HistorySlots

    greedy = Request("g", None, [5, 6, 7], SamplingParams(temperature=0), 0, ())
    sampled = Request("s", None, [8, 9], SamplingParams(temperature=1.0), 0, ())
    slots = HistorySlots(4)
    rows, uploads = slots.prepare([sampled, greedy], [sampled, greedy])
    assert rows.tolist() == [4, 0] and sampled.history_slot is None
    assert uploads.tolist() == [[0, 0, 0], [0, 1, 2], [5, 6, 7]]
    greedy.output_token_ids.append(11)
    rows, uploads = slots.prepare([greedy, sampled], [sampled, greedy])
    assert rows.tolist() == [0, 4] and uploads.tolist() == [[0], [3], [11]]  # only what the row lacks
    rows, uploads = slots.prepare([sampled], [sampled])
    assert rows.tolist() == [4] and uploads.shape == (3, 0)
