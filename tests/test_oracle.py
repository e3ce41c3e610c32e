"""Oracle acceptance (oracle.py): drafts are the target's recorded greedy
continuation cut by a profile; the output stays the target's greedy output
and the measured acceptance is the profile's."""

import dataclasses

import pytest
import torch

from factories import make_models, run_engine_to_end
from specray.config import ConfigError, EngineConfig
from specray.llm import build_engine
from specray.oracle import ORACLE_ENGINE_SETTINGS, PROFILES, Oracle, get_profile, install_oracle
from specray.sampling import SamplingParams

B = 8  # the drafter's block: 7 drafts a step
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_models(tmp_path_factory.mktemp("oracle"), seed=3, drafter_seed=13, block_size=B, vocab_size=320)


def engine(root, drafter: bool, async_: bool = False, **kw):
    # Fixed chains unless a test asks for the adaptive policy: every step's draw is checked.
    if drafter:
        kw = dict(ORACLE_ENGINE_SETTINGS, adaptive_speculation=False) | kw
    return build_engine(EngineConfig(
        target=str(root / "t"), drafter=str(root / "d") if drafter else None, kv_block_size=4, num_kv_blocks=400,
        max_model_len=128, max_num_seqs=8, cuda_graphs=True, async_scheduling=async_, **kw))


def prompts(n=6, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 319, (int(torch.randint(4, 20, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.fixture(scope="module")
def recorded(models):
    """The AR greedy outputs of the prompts (pass 1)."""
    ps = prompts()
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)] * len(ps)
    return ps, params, run_engine_to_end(engine(models, drafter=False), ps, params)


def oracle_run(models, recorded, profile, limit=None, max_tokens=MAX_TOKENS, **kw):
    """The prompts' oracle run (the first ``limit``; ``max_tokens``: of the
    recorded ``MAX_TOKENS``)."""
    ps, params, ar = (x[:limit] for x in recorded)
    params = [dataclasses.replace(p, max_tokens=max_tokens) for p in params]
    eng = engine(models, drafter=True, **kw)
    oracle = Oracle(profile, eng.target_spec.vocab_size)
    oracle.record_outputs(ar)
    install_oracle(eng, oracle)
    outs = run_engine_to_end(eng, ps, params)
    assert [o.token_ids for o in outs] == [o.token_ids[:max_tokens] for o in ar]  # lossless, whatever the drafts
    assert oracle.stats.diverged == set() and oracle.stats.unrecorded == 0
    assert_steps_follow_draws(outs, oracle, max_tokens)
    return outs, oracle


def assert_steps_follow_draws(outs, oracle, max_tokens):
    """Every step emits exactly its draw's k correct drafts + the bonus
    (fewer only where max_tokens cuts the block): verification accepts the
    recorded tokens and rejects the first wrong one."""
    for o in outs:
        key = torch.tensor([oracle.key(o.prompt_token_ids)])
        pos, emitted, want = len(o.prompt_token_ids), 1, []  # the first block's anchor: the prefill's token
        while emitted < max_tokens:
            k = int(oracle.profile.accept_counts(key, torch.tensor([pos]), B - 1)[0])
            want.append(min(k + 1, max_tokens - emitted))
            emitted += want[-1]
            pos += want[-1]
        assert o.metrics.acceptance_lengths == want


def full_block_steps(outs):
    """Acceptance lengths of steps whose block was not cut by max_tokens."""
    out = []
    for o in outs:
        emitted = 1  # the prefill's token
        for a in o.metrics.acceptance_lengths:
            if MAX_TOKENS - emitted >= B:
                out.append(a)
            emitted += a
    return out


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_profile_one_accepts_every_block(models, recorded, async_):
    outs, _ = oracle_run(models, recorded, "const:1.0", async_=async_)
    steps = full_block_steps(outs)
    assert steps and all(a == B for a in steps)


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_profile_zero_accepts_nothing(models, recorded, async_):
    outs, _ = oracle_run(models, recorded, "const:0", limit=2, max_tokens=12, async_=async_)
    assert all(a == 1 for o in outs for a in o.metrics.acceptance_lengths)


@pytest.mark.parametrize("profile,async_", [("const:0.7", False), ("paper-qwen3-8b-gsm8k", True)])
def test_mean_acceptance_matches_profile(models, recorded, profile, async_):
    outs, oracle = oracle_run(models, recorded, profile, async_=async_)
    if async_:  # chains of asynchronous steps drafted on the device
        assert oracle.stats.steps < sum(len(o.metrics.acceptance_lengths) for o in outs)
    steps = full_block_steps(outs)
    want = get_profile(profile).expected_length(B - 1)
    assert len(steps) >= 25
    mean = sum(steps) / len(steps)
    # oracle_run checked each step against its draw; the draws' law is
    # test_accept_counts_follow_the_profile's (20000 of them). Here a few
    # dozen steps (sd ~2-3 each): within ~3 standard errors. Deterministic.
    assert abs(mean - want) < 3 * 2.6 / len(steps) ** 0.5, (mean, want)


def test_sync_and_async_steps_draw_the_same(models, recorded):
    a, _ = oracle_run(models, recorded, "const:0.6", limit=3, max_tokens=24)
    b, _ = oracle_run(models, recorded, "const:0.6", limit=3, max_tokens=24, async_=True)
    assert [o.metrics.acceptance_lengths for o in a] == [o.metrics.acceptance_lengths for o in b]


def test_accept_counts_follow_the_profile():
    """Many draws: P(k >= i) is the profile's survival."""
    prof = get_profile("paper-qwen3-8b-gsm8k")
    assert abs(prof.expected_length(15) - 6.5) < 0.01
    n = 20000
    keys = torch.arange(n, dtype=torch.int64) * 7919 + 1
    k = prof.accept_counts(keys, torch.full((n,), 37, dtype=torch.int64), 15)
    for i, s in enumerate(prof.survival_for(15), 1):
        assert abs((k >= i).double().mean().item() - s) < 0.015
    assert abs(1 + k.double().mean().item() - 6.5) < 0.05


def test_profiles_registry():
    assert set(PROFILES) >= {"paper-qwen3-8b-gsm8k", "embedded-eval"}
    # The run it comes from measured 2.445 (its blocks cut short near max_tokens: a little lower).
    assert abs(get_profile("embedded-eval").expected_length(15) - 2.445) < 0.02
    assert get_profile("const:0.5").expected_length(3) == 1 + 0.5 + 0.25 + 0.125
    for bad in ("const:1.5", "const:x", "nope"):
        with pytest.raises(ValueError):
            get_profile(bad)


def test_adaptive_autoregressive_steps_and_shorter_chains_keep_the_oracle_exact(models, recorded, monkeypatch):
    """The adaptive policy's AR steps and shorter chains (forced here to
    take turns with whole blocks) verify no drafts or the first of them; each
    speculative step still emits its position's draw, cut at the chain's
    length, and the output stays the target's."""
    import itertools

    from specray.spec_policy import SpecPolicy

    flips, chosen = itertools.cycle([B - 1, 3, B - 1, 0]), []
    monkeypatch.setattr(SpecPolicy, "choose", lambda self, n, kind: chosen.append(next(flips)) or chosen[-1])
    ps, params, ar = recorded
    eng = engine(models, drafter=True, async_=True, adaptive_speculation=True)
    assert eng.policy is not None and eng.policy.options == (B - 1, 3, 1, 0)
    oracle = Oracle("const:0.8", eng.target_spec.vocab_size)
    oracle.record_outputs(ar)
    install_oracle(eng, oracle)
    outs = run_engine_to_end(eng, ps, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ar]
    assert oracle.stats.diverged == set() and oracle.stats.unrecorded == 0
    whole = short = 0
    for o in outs:
        key = torch.tensor([oracle.key(o.prompt_token_ids)])
        pos, emitted = len(o.prompt_token_ids), 1
        for n in o.metrics.acceptance_lengths:
            k = int(oracle.profile.accept_counts(key, torch.tensor([pos]), B - 1)[0])
            want = [min(d + 1, MAX_TOKENS - emitted) for d in (k, min(k, 3))]
            assert n == 1 or n in want, (o.metrics.acceptance_lengths, pos, want)
            whole += n == want[0] != want[1]
            short += n == want[1] != want[0]  # the draw cut at 3 drafts
            emitted, pos = emitted + n, pos + n
    assert whole > 0 and short > 0 and chosen.count(0) > 0


def test_refuses_settings_that_bypass_drafts(models):
    eng = build_engine(EngineConfig(target=str(models / "t"), drafter=str(models / "d"), kv_block_size=4,
                                    num_kv_blocks=100, max_model_len=64, max_num_seqs=2, prompt_lookup_min=2,
                                    draft_tree=False))
    with pytest.raises(ConfigError, match="prompt_lookup_min=0"):
        install_oracle(eng, Oracle("const:1.0", 320))


@pytest.mark.gpu
@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_oracle_on_cuda_graphs(models, async_):
    """On the GPU: the drafter's propose graphs (sync) or the whole-step
    graphs with the oracle's drafting captured inside (async)."""
    ps = prompts()
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)] * len(ps)
    ar = run_engine_to_end(engine(models, drafter=False, async_=True, device="cuda"), ps, params)
    eng = engine(models, drafter=True, async_=async_, device="cuda")
    oracle = Oracle("const:0.8", eng.target_spec.vocab_size)
    oracle.record_outputs(ar)
    install_oracle(eng, oracle)
    outs = run_engine_to_end(eng, ps, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ar]
    assert oracle.stats.diverged == set()
    assert_steps_follow_draws(outs, oracle, MAX_TOKENS)
