"""Micro-batch lanes (``overlap=True``): a batch runs as two chains of
asynchronous steps, each from its own graphs and state (on the CPU in
turn), with the tokens one chain gives."""

import pytest

from test_async_decode import engine, pair, prompts, run
from specray.sampling import SamplingParams


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return pair(tmp_path_factory.mktemp("lanes"))


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_a_batch_whose_prompts_prefill_together_runs_as_two_lanes(models, temperature):
    """Prompts admitted in one step start their chain from the prefill
    (chain_admit.chain_from_prefill); with lanes on, that chain must split,
    not run as one lane that later requests join (sampled batches never
    split before: every chain began there)."""
    ps = prompts()[:5]
    params = [SamplingParams(max_tokens=24, temperature=temperature, top_p=0.9 if i % 2 else 1.0, seed=i,
                             ignore_eos=True) for i in range(len(ps))]
    one = engine(models, True, True)
    want = run(one, ps, params)
    two = engine(models, True, True, overlap=True, overlap_min_batch=2)
    for i, (p, sp) in enumerate(zip(ps, params)):
        two.add_request(p, sp, request_id=str(i))
    outs = {}
    while not two._inflight:  # the prefill, then the chain it starts
        outs |= {o.request_id: o for o in two.step() if o.finished}
    assert len(two._inflight) == 2, [len(s.requests) for s in two._inflight]
    got = run(two, [], [])
    got |= outs
    assert any(key[1] == 1 for key in two._step_graphs), sorted(two._step_graphs)
    assert {k: o.token_ids for k, o in got.items()} == {k: o.token_ids for k, o in want.items()}
    assert {k: o.metrics.acceptance_lengths for k, o in got.items()} == \
        {k: o.metrics.acceptance_lengths for k, o in want.items()}
    sched = two.scheduler
    assert sched.target_pool.num_free == sched.target_pool.capacity
