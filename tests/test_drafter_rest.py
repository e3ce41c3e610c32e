"""A resting drafter (drafter_rest.py): the speculative engine's
autoregressive steps stop feeding the drafter after a stretch of them, and
its context is rebuilt when speculation resumes. Tokens stay the
autoregressive engine's, and the rebuilt context is the one the drafter
would have stored step by step."""

import pytest
import torch

from factories import make_models
from specray.config import EngineConfig
from specray.drafter_rest import REST_AFTER, DrafterRest
from specray.llm import build_engine
from specray.sampling import SamplingParams

BLOCK = 6
# AR steps past the rest, one speculative choice (the wake), then speculation.
TURNS = [0] * (REST_AFTER + 4) + [BLOCK - 1] * 200


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_models(tmp_path_factory.mktemp("rest"), seed=4, drafter_seed=14, block_size=BLOCK, vocab_size=320)


def engine(root, drafter=True, **kw):
    return build_engine(EngineConfig(
        target=str(root / "t"), drafter=str(root / "d") if drafter else None, kv_block_size=4, num_kv_blocks=400,
        max_model_len=128, max_num_seqs=4, cuda_graphs=True, async_scheduling=True,
        extra={"policy_turns": TURNS} if drafter else None, **kw))


def prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(2, 319, (n,), generator=g).tolist() for n in (6, 11, 9)]


def add(eng, params):
    for i, p in enumerate(prompts()):
        eng.add_request(p, params, request_id=str(i))


def finish(eng) -> dict:
    outs = {}
    for _ in range(1000):
        if not eng.has_unfinished():
            return outs
        outs.update((o.request_id, o) for o in eng.step() if o.finished)
    raise AssertionError("did not finish")


def test_steering():
    rest = DrafterRest(supported=True)
    assert [rest.steer(0) for _ in range(REST_AFTER)] == [0] * REST_AFTER and rest.resting
    assert rest.steer(5, exploring=True) == 5 and rest.resting and not rest.waking  # a probe: no wake
    assert rest.steer(5) == 0 and rest.waking  # chosen by its rate: speculation resumes after a drained chain
    rest.woke()
    assert rest.steer(5) == 5 and not rest.resting and rest.streak == 0
    # woken soon after it rested: the next rest waits twice as long
    assert rest.rest_after == 2 * REST_AFTER
    [rest.steer(0) for _ in range(2 * REST_AFTER - 1)]
    assert not rest.resting and rest.steer(0) == 0 and rest.resting
    [rest.steer(0) for _ in range(8 * REST_AFTER)]  # a rest that lasted
    rest.steer(5)
    rest.woke()
    assert rest.rest_after == REST_AFTER
    never = DrafterRest(supported=False)
    assert [never.steer(0) for _ in range(2 * REST_AFTER)][-1] == 0 and not never.resting
    assert never.steer(5) == 5


def test_resting_drafter_keeps_the_autoregressive_tokens(models):
    params = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
    rest = engine(models)
    add(rest, params)
    got = finish(rest)
    assert rest.rest.rests >= 1 and rest.rest.refilled_tokens > 0
    assert rest.chain_breaks["the drafter wakes"] >= 1
    ar = engine(models, drafter=False)
    add(ar, params)
    want = finish(ar)
    assert {k: o.token_ids for k, o in got.items()} == {k: o.token_ids for k, o in want.items()}
    assert rest.features()["drafter_rest"] == {"on": True}


def context_rows(eng, r, n: int) -> torch.Tensor:
    """The drafter's context K/V of request ``r``'s positions 0 .. n-1."""
    cache = eng.drafter.kv_cache  # [L, 2, blocks, block_size, kv_heads, D]
    slots = torch.tensor(r.draft_blocks.slots(0, n))
    bs = cache.shape[3]
    return cache[:, :, slots // bs, slots % bs]


def test_rebuilt_context_is_the_stored_one(models):
    """After the wake, each request's drafter context equals that of an
    engine whose drafter never rested, position for position."""
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    rest, kept = engine(models), engine(models, drafter_rest=False)
    for eng in (rest, kept):
        add(eng, params)
    for _ in range(400):
        rest.step()
        if rest.rest.refilled_tokens and not rest.rest.resting:
            break
    rest.step()
    live = {r.request_id: r for r in rest.scheduler.running}
    assert live and kept.rest.rests == 0
    for _ in range(400):
        ref = {r.request_id: r for r in kept.scheduler.running}
        if all(k in ref and ref[k].num_computed >= r.num_computed for k, r in live.items()):
            break
        kept.step()
    for k, r in live.items():
        n = r.num_computed
        assert n > REST_AFTER + len(r.prompt_token_ids)  # the gap was there
        torch.testing.assert_close(context_rows(rest, r, n), context_rows(kept, ref[k], n), atol=1e-4, rtol=1e-4)


def test_sampled_rows_rest_and_wake(models):
    params = SamplingParams(max_tokens=80, temperature=1.0, top_p=0.9, ignore_eos=True, seed=3)
    eng = engine(models)
    add(eng, params)
    outs = finish(eng)
    assert eng.rest.rests >= 1 and eng.rest.refilled_tokens > 0
    assert all(len(o.token_ids) == 80 for o in outs.values())


def test_refused_where_the_drafter_is_apart_or_off(models):
    off = engine(models, drafter_rest=False)
    assert off.features()["drafter_rest"] == {"on": False, "reason": "turned off (drafter_rest=False)"}
    fixed = engine(models, adaptive_speculation=False)
    assert fixed.features()["drafter_rest"]["reason"] == "needs adaptive_speculation"


def test_probes_while_resting_keep_tokens_and_stay_out_of_the_acceptance(models):
    """The policy's probes run on the resting drafter's context, holes and
    all: no wake, the target's tokens, and their acceptance kept out of the
    policy's means."""
    params = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
    eng = engine(models)
    turns = iter([0] * (REST_AFTER + 2) + ([BLOCK - 1] * 3 + [0] * 5) * 100)
    policy = eng.policy

    def choose(n_padded, kind):
        drafts = next(turns)
        policy.exploring = drafts > 0  # every speculative turn a probe
        policy.choices[drafts] = policy.choices.get(drafts, 0) + 1
        return drafts

    policy.choose = choose
    add(eng, params)
    got = finish(eng)
    assert eng.rest.rests == 1 and eng.rest.probe_steps >= 3 and eng.rest.resting
    assert eng.chain_breaks["the drafter wakes"] == 0 and eng.rest.refilled_tokens == 0
    assert policy.survival == {}  # no speculative step's rows reached the policy
    ar = engine(models, drafter=False)
    add(ar, params)
    want = finish(ar)
    assert {k: o.token_ids for k, o in got.items()} == {k: o.token_ids for k, o in want.items()}


def test_a_rest_returns_the_recent_acceptance_to_the_settled_one(models):
    """While the drafter rests, each step moves the policy's recent
    acceptance toward its settled one (spec_policy.SpecPolicy.resting), and
    the settled one stays: a dip that turned speculation off does not keep
    the drafter asleep."""
    from specray.spec_policy import scripted

    eng = engine(models)
    policy = eng.policy
    policy.choose = scripted(policy, [0])
    key = ("greedy", "chain")
    policy.survival[key], policy.settled[key] = [0.1] * (BLOCK - 1), [0.9] * (BLOCK - 1)
    add(eng, SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True))
    finish(eng)
    assert eng.rest.rests == 1 and eng.rest.resting
    assert all(0.85 < x < 0.9 for x in policy.survival[key]) and policy.settled[key] == [0.9] * (BLOCK - 1)


def test_trial_wakes_come_further_apart_until_the_policy_keeps_one(monkeypatch):
    import specray.drafter_rest as dr

    monkeypatch.setattr(dr, "TRIAL_AFTER", 8)
    rest = DrafterRest(supported=True, trial_after=8)
    for _ in range(REST_AFTER):
        rest.steer(0)
    assert rest.resting and not rest.waking
    steps = [rest.steer(0) for _ in range(8)]
    assert steps == [0] * 8 and rest.waking and rest.trial and rest.trials == 1
    assert rest.woke() and rest.trial_after == 16 and rest.rest_after == REST_AFTER  # a trial leaves rest_after
    for _ in range(REST_AFTER + 16):  # the trial's steps were not kept: rest, then a trial twice as far
        rest.steer(0)
    assert rest.waking and rest.trials == 2
    rest.woke()
    assert rest.steer(5, exploring=True) == 5 and rest.trial_after == 32  # the trial's held steps
    assert rest.steer(5) == 5 and rest.trial_after == 8  # chosen by its rate: trials start over
    for _ in range(REST_AFTER + 2):
        rest.steer(0)
    rest.steer(5)
    assert rest.waking and not rest.woke()  # a wake the policy chose is no trial


def test_a_trial_wake_reads_the_acceptance_again(models, monkeypatch):
    """A rest the policy never ends by its rates (its settled acceptance
    below break-even) is broken by trial wakes: the context refilled, a
    few speculative steps whose rows reach the policy, then a rest again,
    the next trial twice as far; the tokens stay the target's."""
    import specray.drafter_rest as dr

    monkeypatch.setattr(dr, "TRIAL_AFTER", 8)
    eng = engine(models)
    eng.rest.trial_after = 8
    policy = eng.policy
    policy.choose = type(policy).choose.__get__(policy)  # the real choice, past the test's script
    policy._choose = lambda n, kind: (0, False)  # every rate says autoregressive
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    add(eng, params)
    got = finish(eng)
    assert eng.rest.trials >= 2 and eng.rest.trial_after == 8 * 2 ** eng.rest.trials
    assert eng.rest.refilled_tokens > 0 and eng.chain_breaks["the drafter wakes"] == eng.rest.trials
    assert policy.choices.get(BLOCK - 1, 0) >= 4 * dr.TRIAL_STEPS // 2  # the trials' steps speculated
    assert ("greedy", "chain") in policy.survival or ("greedy", "tree") in policy.survival  # their rows counted
    ar = engine(models, drafter=False)
    add(ar, params)
    want = finish(ar)
    assert {k: o.token_ids for k, o in got.items()} == {k: o.token_ids for k, o in want.items()}
