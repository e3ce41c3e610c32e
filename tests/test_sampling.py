"""Speculative rejection sampling is exact: what is emitted follows the
target's (filtered) distribution, whatever the drafter proposes."""

import numpy as np
import pytest
import torch

from joint_sampling import chi2_p, sampled_triples
from specray.sampling import (
    STREAM_DRAFT,
    STREAM_TOKEN,
    SamplingParams,
    SamplingTensors,
    cumsum_rows,
    filtered_probs,
    hash_uniform,
    host_uniforms,
    sample_draft_tokens,
    sparse_draft,
    verify,
)

N = 20_000


def test_hash_uniform_is_uniform_and_keyed():
    seeds = torch.arange(N)
    u = hash_uniform(seeds, torch.full((N,), 17), STREAM_TOKEN)
    assert 0 < u.min() and u.max() < 1
    counts = np.histogram(u.numpy(), bins=20, range=(0, 1))[0]
    assert chi2_p(counts, [1 / 20] * 20) > 1e-3
    # Neighbouring positions / streams are uncorrelated.
    v = hash_uniform(seeds, torch.full((N,), 18), STREAM_TOKEN)
    assert abs(np.corrcoef(u.numpy(), v.numpy())[0, 1]) < 0.03
    assert not torch.equal(u, hash_uniform(seeds, torch.full((N,), 17), STREAM_TOKEN + 1))
    assert torch.equal(u, hash_uniform(seeds, torch.full((N,), 17), STREAM_TOKEN))


def test_streams_are_pinned():
    """Seeded outputs stay reproducible across versions: these 32-bit hash
    values come from the implementation before the hash moved to the host,
    and the host's numpy grid of a step's uniforms gives them too."""
    seeds = torch.tensor([0, 1, 12345, 2**40 + 7, -3, 2**62 + 11])
    pos = torch.tensor([0, 5, 17, 2**33 + 1, 100000, 3])
    want = {STREAM_DRAFT: [1250586629, 4087604202, 2310695292, 2829690486, 684733640, 2212498324],
            STREAM_TOKEN: [746207062, 473599182, 1789197446, 1021569687, 2859928655, 1499017471]}
    for stream, bits in want.items():
        u = torch.tensor(bits, dtype=torch.float64).add(0.5).div(2.0**32)
        assert torch.equal(hash_uniform(seeds, pos, stream), u)
        assert torch.equal(host_uniforms(seeds.tolist(), (pos - 1).tolist(), 1)[stream - 1, :, 0], u)
    # A step's grid: [k, s, j] is stream k + 1 at position start_s + 1 + j.
    starts = torch.tensor([9, 0, 2**33 - 3, 41])
    grid = host_uniforms(seeds[:4].tolist(), starts.tolist(), 5)
    assert grid.shape == (3, 4, 5) and grid.dtype == torch.float64
    cols = starts[:, None] + 1 + torch.arange(5)[None]
    for k in range(3):
        assert torch.equal(grid[k], hash_uniform(seeds[:4, None], cols, k + 1))


@pytest.mark.parametrize(
    "temperature,top_p,top_k",
    [(1.0, 1.0, 0), (0.7, 1.0, 0), (1.0, 0.8, 0), (1.3, 1.0, 4), (0.9, 0.9, 5)],
)
def test_rejection_sampling_matches_target_distribution(temperature, top_p, top_k):
    V, G = 8, 3
    g = torch.Generator().manual_seed(1)
    target_logits = torch.randn(1, G + 1, V, generator=g) * 1.5
    draft_logits = torch.randn(1, G, V, generator=g) * 1.5  # disagrees with the target
    params = [SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)] * N
    st = SamplingTensors.build(params, list(range(N)), [10] * N, G + 1)
    drafts, idx, q = sample_draft_tokens(draft_logits.expand(N, -1, -1), st, top_k_sparse=6)
    res = verify(target_logits.expand(N, -1, -1), drafts, torch.full((N,), G), st, idx, q)
    # The first emitted token is draft 1 if accepted, else the residual
    # sample: either way it must follow the target's row-0 distribution.
    checked = []
    first = torch.where(res.num_accepted > 0, drafts[:, 0], res.bonus)
    p0 = filtered_probs(target_logits[0, :1], SamplingTensors.build(params[:1], [0], [0], 1))[0]
    counts = np.bincount(first.numpy(), minlength=V)
    assert chi2_p(counts, p0.numpy()) > 1e-3
    # So must the token emitted at each later row, among the requests that
    # reached it: the draft if accepted, else the residual sample of p_i - q_i.
    one = SamplingTensors.build(params[:1], [0], [0], 1)
    for i in range(1, G + 1):
        reached = res.num_accepted >= i
        if reached.sum() < 1000:
            continue
        token = drafts[:, i] if i < G else res.bonus
        token = torch.where(res.num_accepted > i, token, res.bonus)[reached]
        p_i = filtered_probs(target_logits[0, i : i + 1], one)[0]
        assert chi2_p(np.bincount(token.numpy(), minlength=V), p_i.numpy()) > 1e-3, i
        checked.append(i)
    # Some drafts are accepted and some rejected: both paths ran.
    assert 0.05 < (res.num_accepted > 0).float().mean() < 0.95
    assert 1 in checked, (res.num_accepted >= 1).sum()


def test_engine_emits_the_target_joint_distribution(tmp_path):
    """End to end: 20k seeded requests of 3 tokens each through the
    speculative engine verifying chains (rejection sampling; trees emit the
    autoregressive samples, test_draft_tree.py); the empirical joint
    distribution of the three tokens matches the target's softmax chain
    (chi-square over all 512 cells)."""
    outs, cells, joint = sampled_triples(tmp_path, [2, 5, 3], N, draft_tree=False)
    assert len(outs) == N and all(len(o.token_ids) == 3 for o in outs)
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0.05 * N  # drafts were accepted, not only resampled
    assert chi2_p(cells, joint) > 1e-3


def test_unfiltered_rows_skip_the_sort_and_keep_the_softmax():
    """Without top-k / top-p the distribution is the plain softmax at the
    row's temperature (no sort), mixed freely with greedy rows."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 50, generator=g) * 3
    params = [SamplingParams(temperature=t) for t in (1.0, 0.5, 0.0, 2.0)]
    st = SamplingTensors.build(params, [0, 1, 2, 3], [0] * 4, 1)
    assert not st.any_filter and not st.all_greedy
    probs = filtered_probs(logits, st)
    temps = torch.tensor([1.0, 0.5, 1.0, 2.0])[:, None]
    want = (logits / temps).softmax(-1)
    want[2] = torch.nn.functional.one_hot(logits[2].argmax(), 50).float()
    torch.testing.assert_close(probs, want)
    # In a batch that filters, the rows that do not keep exactly the plain
    # softmax: a row's distribution does not depend on its batch mates (the
    # sorted path's float32 cumulative sum could drop a tail at top_p = 1).
    sorted_path = SamplingTensors.build(params, [0, 1, 2, 3], [0] * 4, 1)
    sorted_path.any_filter = True
    assert torch.equal(filtered_probs(logits, sorted_path), probs)
    mixed = SamplingTensors.build(params + [SamplingParams(top_p=0.5), SamplingParams(top_k=3)], list(range(6)),
                                  [0] * 6, 1)
    assert mixed.any_filter
    mixed_logits = torch.cat([logits, torch.randn(2, 50, generator=g) * 3])
    mixed_probs = filtered_probs(mixed_logits, mixed)
    assert torch.equal(mixed_probs[:4], probs)
    assert (mixed_probs[4:] > 0).sum(-1).tolist()[1] == 3 and (mixed_probs[4] > 0).sum() < 50
    # top_k at or above the vocabulary filters nothing; knowing the
    # vocabulary, the batch skips the sort.
    wide = [SamplingParams(top_k=50), SamplingParams(top_k=2**31 - 1)]
    huge = SamplingTensors.build(wide, [0, 1], [0, 0], 1)
    assert huge.any_filter
    assert torch.equal(filtered_probs(logits[:2] * 2, huge), (logits[:2] * 2).softmax(-1))
    assert not SamplingTensors.build(wide, [0, 1], [0, 0], 1, vocab_size=50).any_filter
    assert SamplingTensors.build([SamplingParams(top_k=49)], [0], [0], 1, vocab_size=50).any_filter
    assert SamplingTensors.build([SamplingParams(top_p=0.9)], [0], [0], 1).any_filter
    assert SamplingTensors.build([SamplingParams(top_k=5)], [0], [0], 1).any_filter
    assert not SamplingTensors.build([SamplingParams(temperature=0.0, top_k=5)], [0], [0], 1).any_filter


def test_sampled_step_hashes_nothing_on_the_device():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "sampling_ops.py"
    spec = importlib.util.spec_from_file_location("sampling_ops", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    row = mod.main(["--batch", "2", "--vocab", "64", "--block-size", "4", "--draft-top-k", "8"])["by_batch"][0]
    assert row["hash_ops_in_step"] == 0 < row["sampled_step_ops"]
    assert row["draw_ops_on_device"] > 20  # what each of the step's three draws would add
    assert row["host_uniforms_us"] > 0


def test_draft_batch_round_trip_keeps_the_uniforms():
    """The DraftBatch a separate drafter receives carries the step's
    uniforms bit for bit (as int64 bit patterns), greedy or not."""
    from specray.actors.messages import pack_draft_batch, unpack_draft_batch
    from specray.plan import DraftBatch

    S, B = 3, 5
    for params in ([SamplingParams(temperature=0)] * S,
                   [SamplingParams(temperature=0.7, top_p=0.9, top_k=4, seed=11), SamplingParams(temperature=0),
                    SamplingParams(temperature=1.3)]):
        st = SamplingTensors.build(params, [5, 6, 2**40], [3, 9, 17], B)
        batch = DraftBatch(torch.full((S, B), 7), torch.tensor([3, 9, 17]), torch.tensor([5, 5, 2]),
                           torch.zeros(S, 2, dtype=torch.int32), 17, st)
        got = unpack_draft_batch(pack_draft_batch(batch)).sampling
        assert torch.equal(got.uniforms, st.uniforms) and got.uniforms.shape == (3, S, 0 if st.all_greedy else B)
        assert torch.equal(got.temperature, st.temperature) and torch.equal(got.top_k, st.top_k)
        assert (got.all_greedy, got.any_filter) == (st.all_greedy, st.any_filter)


def test_too_few_uniforms_is_an_error_not_a_broadcast():
    st = SamplingTensors.build([SamplingParams(temperature=1.0)], [0], [0], 2)
    with pytest.raises(ValueError, match="cover 2 positions"):
        sample_draft_tokens(torch.randn(1, 3, 10), st, top_k_sparse=4)
    with pytest.raises(ValueError, match="cover 2 positions"):
        verify(torch.randn(1, 3, 10), torch.zeros(1, 2, dtype=torch.long), torch.tensor([2]), st)


def test_cumsum_rows_is_a_cumulative_sum():
    g = torch.Generator().manual_seed(0)
    for V in (7, 256, 300, 1024, 6000):
        x = torch.rand(3, V, generator=g, dtype=torch.float64)
        torch.testing.assert_close(cumsum_rows(x, chunk=256), x.cumsum(-1))


def test_sparse_draft_filters_within_its_candidates():
    """The draft distribution: the row's k most likely tokens at its
    temperature, then its top-k / top-p among them (greedy rows: the argmax,
    column 0)."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(4, 50, generator=g) * 2
    params = [SamplingParams(temperature=0.8), SamplingParams(temperature=1.0, top_p=0.5),
              SamplingParams(temperature=0.7, top_k=3), SamplingParams(temperature=0.0)]
    st = SamplingTensors.build(params, [0, 1, 2, 3], [0] * 4, 1)
    idx, q = sparse_draft(logits, st, 1, 10)
    top, want_idx = logits.topk(10, dim=-1)
    assert torch.equal(idx, want_idx)
    torch.testing.assert_close(q.sum(-1), torch.ones(4))
    torch.testing.assert_close(q[0], (top[0] / 0.8).softmax(-1))
    row1 = top[1].softmax(-1)
    kept = int(((row1.cumsum(-1) - row1) < 0.5).sum())
    assert 0 < kept < 10 and (q[1] > 0).sum() == kept
    torch.testing.assert_close(q[1, :kept], row1[:kept] / row1[:kept].sum())
    assert (q[2] > 0).sum() == 3
    assert q[3, 0] == 1 and q[3, 1:].sum() == 0


def _filtered_reference(logits: np.ndarray, temperature: float, top_p: float, top_k: int) -> np.ndarray:
    """What a sampled row's distribution is, written from the definition in
    float64: softmax of logits / temperature, the top-k tokens kept, then
    the smallest most-likely prefix whose mass reaches top-p, renormalised."""
    z = logits.astype(np.float64) / temperature
    order = np.argsort(-z, kind="stable")
    if 0 < top_k < len(z):
        z[order[top_k:]] = -np.inf
    p = np.exp(z - z.max())
    p /= p.sum()
    ps = p[order]
    before = np.cumsum(ps) - ps
    ps = np.where((before < top_p) | (np.arange(len(ps)) == 0), ps, 0.0)
    out = np.zeros_like(p)
    out[order] = ps / ps.sum()
    return out


def test_filtered_probs_match_a_float64_reference():
    """Temperature with top-k and top-p, against an independent definition
    (the other sampling tests compare the engine's path with itself)."""
    rows = [(0.5, 1.0, 0), (1.7, 1.0, 5), (0.7, 0.9, 0), (1.3, 0.6, 0), (0.4, 0.8, 20), (2.0, 0.3, 7),
            (1.0, 0.95, 0), (0.8, 1.0, 1)]
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(len(rows), 3000, generator=g) * 3
    params = [SamplingParams(temperature=t, top_p=p, top_k=k) for t, p, k in rows]
    st = SamplingTensors.build(params, list(range(len(rows))), [0] * len(rows), 1)
    got = filtered_probs(logits, st).double().numpy()
    for i, (t, p, k) in enumerate(rows):
        want = _filtered_reference(logits[i].numpy(), t, p, k)
        assert np.abs(got[i] - want).max() < 1e-5, (t, p, k)
        if p < 1 or k > 0:  # the same kept set (unfiltered rows: float32 underflows the far tail)
            assert ((got[i] > 0) == (want > 0)).all(), (t, p, k)
