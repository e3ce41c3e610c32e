"""Log probabilities of generated tokens (``SamplingParams.logprobs``):
the target's raw distribution at each emitted position, checked against
HF transformers run on the finished sequence, the same with and without a
drafter, through stops, min_tokens, sampled requests and async engines."""

import pytest
import torch

from factories import make_models, run_engine_to_end, small_engine
from specray.sampling import SamplingParams


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_models(tmp_path_factory.mktemp("logprobs"), seed=4, drafter_seed=14, block_size=6, vocab_size=320)


engine = small_engine


def generate(eng, prompts, params):
    seen: dict[str, list] = {}

    def check(o):  # every output carries its new tokens' entries, the last one all of them
        if o.delta_logprobs is None:
            assert o.logprobs is None
            return
        assert [e.token_id for e in o.delta_logprobs] == o.delta_token_ids
        seen.setdefault(o.request_id, []).extend(o.delta_logprobs)
        if o.finished:
            assert o.logprobs == seen[o.request_id] and len(o.logprobs) == len(o.token_ids)
        else:
            assert o.logprobs is None

    return run_engine_to_end(eng, prompts, params, on_output=check)


def _prompts():
    g = torch.Generator().manual_seed(5)
    # A repeated phrase gives prompt lookups something to draft, so blocks
    # with accepted drafts are among the checked rows.
    return [torch.randint(2, 319, (n,), generator=g).tolist() * 3 for n in (3, 5, 4)]


def reference(models, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """HF's log-softmax ``[len(tokens), vocab]`` of each generated position."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(models / "t"), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0]
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)].double(), -1)


def check_against_reference(models, prompt, out, k):
    ref = reference(models, prompt, out.token_ids)
    assert [e.token_id for e in out.logprobs] == out.token_ids
    for i, e in enumerate(out.logprobs):
        assert e.logprob == pytest.approx(ref[i, e.token_id].item(), abs=2e-4)
        assert len(e.top) == k
        vals, ids = ref[i].topk(k)
        assert [t for t, _ in e.top] == ids.tolist()
        assert [v for _, v in e.top] == pytest.approx(vals.tolist(), abs=2e-4)


def test_logprobs_are_the_targets_with_and_without_the_drafter(models):
    """Greedy and sampled requests, one stopped by a stop token inside a
    verify block and one under min_tokens: every generated token has its
    entry, and entries equal HF's log-softmax of the finished sequence
    (raw: before temperature, top-k and the min_tokens mask), for both
    engines; on greedy requests the speculative engine reports what the
    autoregressive one does."""
    ps = _prompts()
    free = generate(engine(models, False), ps, [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)] * 3)
    params = [
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=5,
                       stop_token_ids=[free[0].token_ids[9]]),
        SamplingParams(max_tokens=24, temperature=0.8, top_k=20, seed=7, ignore_eos=True, logprobs=3),
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=0,
                       stop_token_ids=[free[2].token_ids[1]], min_tokens=6),
    ]
    spec_eng = engine(models, True)
    spec = generate(spec_eng, ps, params)
    ar = generate(engine(models, False), ps, params)
    assert spec[0].finish_reason == "stop" and len(spec[0].token_ids) <= 10
    assert len(spec[2].token_ids) > 6  # min_tokens held its stop token back
    # Blocks with accepted drafts were among the rows read.
    assert sum(o.metrics.num_accepted_tokens for o in spec) > 0
    for o_spec, o_ar in (zip(spec[::2], ar[::2])):  # the greedy ones (sampled tokens differ by design)
        assert o_spec.token_ids == o_ar.token_ids
        for a, b in zip(o_spec.logprobs, o_ar.logprobs):
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-5)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
    for prompt, o_spec, o_ar, k in zip(ps, spec, ar, (5, 3, 0)):
        check_against_reference(models, prompt, o_spec, k)
        check_against_reference(models, prompt, o_ar, k)
    # Raw figures: at position 1 of the third request min_tokens masked the
    # token the free run took there (the argmax), so a figure taken after
    # the mask would be renormalised away from HF's, checked above.
    assert spec[2].token_ids[1] != params[2].stop_token_ids[0]


def test_logprob_requests_run_synchronous_steps_in_an_async_engine(models):
    """An async engine runs a request that asks for log probabilities in
    synchronous steps (the step graphs compute none) and gives the tokens
    and entries of the synchronous engine; its batch-mates without them
    get ``logprobs`` None and their usual tokens."""
    ps = _prompts()
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=2 if i == 1 else None)
              for i in range(3)]
    sync = generate(engine(models, True), ps, params)
    eng = engine(models, True, async_=True)
    asyn = generate(eng, ps, params)
    assert [o.token_ids for o in asyn] == [o.token_ids for o in sync]
    assert asyn[0].logprobs is None and asyn[2].logprobs is None
    assert [(e.token_id, e.top[0][0]) for e in asyn[1].logprobs] == [(e.token_id, e.top[0][0]) for e in sync[1].logprobs]
    # Alone, requests without logprobs do chain asynchronous steps.
    before = eng.num_async_steps
    generate(eng, ps, [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)] * 3)
    assert eng.num_async_steps > before


@pytest.mark.parametrize("bad", [-1, 21, True, 2.0, "3"])
def test_bad_logprobs_are_refused(bad):
    with pytest.raises(ValueError, match="logprobs must be an integer from 0 to 20"):
        SamplingParams(logprobs=bad)
