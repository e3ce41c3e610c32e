"""Presence, frequency and repetition penalties (vLLM's rules): greedy
output equals a step-by-step HF transformers loop that applies them by
hand, with and without the drafter, synchronous and async engines; a
verify block's rows count the drafts before them."""

from collections import Counter

import pytest
import torch

from factories import make_models, run_engine_to_end, small_engine
from specray.sampling import SamplingParams


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_models(tmp_path_factory.mktemp("penalties"), seed=4, drafter_seed=14, block_size=6, vocab_size=320)


engine, generate = small_engine, run_engine_to_end


def _prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(2, 319, (n,), generator=g).tolist() * 3 for n in (3, 5, 4)]


def hf_greedy(models, prompt, sp: SamplingParams, n: int) -> list[int]:
    """The reference: HF logits one token at a time, penalised element by
    element from the token counts (no tensor code shared with specray)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(models / "t"), dtype=torch.float32).eval()
    out = []
    for _ in range(n):
        with torch.no_grad():
            row = hf(torch.tensor([prompt + out])).logits[0, -1].tolist()
        counts = Counter(out)
        seen = set(prompt) | set(out)
        for t in range(len(row)):
            if t in seen:
                row[t] = row[t] / sp.repetition_penalty if row[t] > 0 else row[t] * sp.repetition_penalty
            row[t] -= sp.frequency_penalty * counts[t] + sp.presence_penalty * (counts[t] > 0)
        out.append(max(range(len(row)), key=row.__getitem__))
    return out


SETTINGS = [dict(repetition_penalty=1.8), dict(frequency_penalty=1.5), dict(presence_penalty=2.0),
            dict(repetition_penalty=0.7, frequency_penalty=-0.5, presence_penalty=0.5),
            # Repeats favoured, then charged for: accepted drafts whose count a later row needs.
            dict(repetition_penalty=0.5, frequency_penalty=0.3)]


def test_greedy_penalties_match_a_step_by_step_reference(models):
    """Every setting changes the free output and gives the reference's
    tokens, speculative (accepted drafts included) and autoregressive,
    synchronous and async engines; unpenalised batch-mates keep theirs."""
    ps = _prompts()
    n = 20
    free = generate(engine(models, False), ps, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)] * 3)
    accepted = 0
    for kw in SETTINGS:
        params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)] * 2 + \
                 [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)]
        want = [hf_greedy(models, p, sp, n) for p, sp in zip(ps[:2], params)]
        assert any(w != f.token_ids for w, f in zip(want, free)), kw
        for drafter, async_ in ((True, False), (False, False), (True, True)):
            outs = generate(engine(models, drafter, async_), ps, params)
            assert [o.token_ids for o in outs[:2]] == want, (kw, drafter, async_)
            assert outs[2].token_ids == free[2].token_ids
            accepted += sum(o.metrics.num_accepted_tokens for o in outs[:2])
    # Penalties that favour repeats let prompt lookups' drafts through: blocks
    # whose later rows count accepted drafts were among those checked.
    assert accepted > 0


def test_block_rows_count_the_drafts_before_them():
    """``penalize`` on a block of 4 rows with 3 drafts: row j counts the
    output and drafts[:j]; a first-token row only its prompt."""
    from specray.penalties import penalize
    from specray.request import Request

    V = 12
    sp = SamplingParams(max_tokens=8, frequency_penalty=1.0, presence_penalty=0.25, repetition_penalty=2.0)
    r = Request("a", None, [1, 2], sp, 0, ())
    r.output_token_ids = [3, 3]
    first = Request("b", None, [5], sp, 0, ())
    logits = torch.linspace(-3, 3, 5 * V).view(5, V)
    drafts = torch.tensor([[4, 3, 7]])
    got = logits.clone()
    penalize(got, [(r, [0, 1, 2, 3], 0), (first, [4], None)], drafts)
    for j in range(5):
        prompt, output = ([1, 2], [3, 3] + drafts[0, :j].tolist()) if j < 4 else ([5], [])
        c = Counter(output)
        for t in range(V):
            x = logits[j, t].item()
            if t in set(prompt) | set(output):
                x = x / 2.0 if x > 0 else x * 2.0
            x -= 1.0 * c[t] + 0.25 * (c[t] > 0)
            assert got[j, t].item() == pytest.approx(x, abs=1e-6), (j, t)


@pytest.mark.parametrize("kw", [dict(presence_penalty=2.5), dict(frequency_penalty=-3), dict(repetition_penalty=0),
                                dict(repetition_penalty=float("nan")), dict(presence_penalty="1")])
def test_bad_penalties_are_refused(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        SamplingParams(**kw)


def test_sampled_penalties_keep_the_target_distribution(tmp_path):
    """Sampled requests under all three penalties: 20k seeded requests of 3
    tokens through the speculative engine; the joint distribution of the
    triples matches the target's penalised softmax chain (chi-square over
    the 512 cells), with drafts accepted along the way."""
    from joint_sampling import chi2_p, sampled_triples

    pen = dict(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.6)
    outs, cells, joint = sampled_triples(tmp_path, [2, 5, 3], 20_000, penalties=pen)
    assert all(len(o.token_ids) == 3 for o in outs)
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0.05 * len(outs)
    assert chi2_p(cells, joint) > 1e-3
