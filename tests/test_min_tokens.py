"""``min_tokens`` (vLLM's rule): no stop token or stop string ends a request
before it has generated that many tokens; stop tokens get no probability
there, so the speculative engine's output stays the autoregressive one's,
and the asynchronous engine's stays the synchronous one's."""

import pytest
import torch

from factories import make_models, run_engine_to_end, small_engine
from specray.sampling import SamplingParams


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_models(tmp_path_factory.mktemp("min_tokens"), seed=4, drafter_seed=14, block_size=6, vocab_size=320)


engine, generate = small_engine, run_engine_to_end


def _prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(2, 319, (n,), generator=g).tolist() for n in (6, 11, 4)]


def test_min_tokens_holds_stops_back_and_stays_lossless(models):
    """Stop tokens the free run emits early (one is the first token) are
    masked until min_tokens: the output has at least that many tokens, none
    of them a stop token, then stops at the first one after; speculative
    and autoregressive, synchronous and asynchronous engines agree; a stop
    string is not looked for before min_tokens."""
    ps = _prompts()
    free = generate(engine(models, False), ps, [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)] * 3)
    stops = [[o.token_ids[0], o.token_ids[3]] for o in free]
    plain = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop_token_ids=s) for s in stops]
    early = generate(engine(models, False), ps, plain)
    assert all(len(o.token_ids) <= 4 and o.finish_reason == "stop" for o in early)  # the stops do end them early
    mins = (8, 12, 30)
    held = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop_token_ids=s, min_tokens=m)
            for s, m in zip(stops, mins)]
    masked = generate(engine(models, False), ps, held)
    # Add the token the masked run emits right after min_tokens: the run
    # (changed where that token was an earlier argmax) may stop past it.
    for o, s, m in zip(masked[:2], stops, mins):
        s.append(o.token_ids[m + 1])
    held = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop_token_ids=s, min_tokens=m)
            for s, m in zip(stops, mins)]
    want = generate(engine(models, False), ps, held)
    for o, s, sp in zip(want, stops, held):
        assert len(o.token_ids) > sp.min_tokens or len(o.token_ids) == sp.max_tokens
        assert not set(o.token_ids[: sp.min_tokens]) & set(s), (o.token_ids, s)
        if o.finish_reason == "stop":  # at the first stop token past min_tokens
            assert o.token_ids[-1] in s and not set(o.token_ids[:-1]) & set(s)
    assert "stop" in [o.finish_reason for o in want[:2]] and want[2].finish_reason == "length"
    for drafter, async_ in ((True, False), (True, True), (False, True)):
        got = generate(engine(models, drafter, async_), ps, held)
        assert [o.token_ids for o in got] == [o.token_ids for o in want], (drafter, async_)
        assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    # A stop string inside the first min_tokens tokens' text does not stop.
    text = free[1].text
    stop_str = text[len(text) // 4:][:2]
    assert stop_str.strip()
    cut = generate(engine(models, False), ps[1:2], [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True,
                                                                   stop=stop_str)])[0]
    kept = generate(engine(models, False), ps[1:2], [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True,
                                                                    stop=stop_str, min_tokens=30)])[0]
    assert cut.finish_reason == "stop" and len(cut.token_ids) < 30
    assert kept.finish_reason == "length" and kept.token_ids == free[1].token_ids


def test_sampled_rows_never_stop_before_min_tokens(models):
    """Sampled requests, speculative engine: the stop token the free run
    samples first never appears before min_tokens."""
    ps = _prompts()
    sampled = lambda **kw: [SamplingParams(max_tokens=24, temperature=1.0, seed=s, ignore_eos=True, **kw)  # noqa: E731
                            for s in (1, 2, 3)]
    free = generate(engine(models, True), ps, sampled())
    stops = sorted({o.token_ids[0] for o in free} | {o.token_ids[1] for o in free})
    got = generate(engine(models, True), ps, sampled(stop_token_ids=stops, min_tokens=16))
    for o in got:
        assert len(o.token_ids) >= 17 or o.finish_reason == "length"
        assert not set(o.token_ids[:16]) & set(stops)


@pytest.mark.parametrize("bad", [-1, 31, 2.0, True, "3"])
def test_min_tokens_is_validated(bad):
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=30, min_tokens=bad)
