"""A lone prompt chunk runs padded to a captured length (eagerly off CUDA):
the same tokens, acceptance and drafter context as the unpadded forward,
for first and later chunks of a chunked prefill."""

import pytest

from factories import make_drafter, make_target
from specray import LLM, SamplingParams


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefill")
    hf = make_target(root / "t", vocab_size=64, seed=3)
    make_drafter(root / "d", hf.config, seed=13, block_size=8)
    return root


@pytest.mark.parametrize("drafter", [True, False], ids=["spec", "ar"])
def test_padded_prefill_equals_eager(ckpt, drafter):
    prompts = [[5 + (7 * i) % 50 for i in range(n)] for n in (3, 21, 50, 70)]
    # Sampled, seeded: with this random drafter greedy drafts are never
    # accepted, so equal acceptance would say nothing about its context.
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=0, ignore_eos=True)
    kw = dict(max_model_len=160, max_num_batched_tokens=24, prompt_lookup_min=0)  # chunks of <= 24 tokens
    d = ckpt / "d" if drafter else None
    eager = LLM(ckpt / "t", d, **kw)
    graphed = LLM(ckpt / "t", d, cuda_graphs=True, **kw)
    worker = graphed.engine.target
    assert sorted(worker.prefill_graphs) == [16, 32]
    used = []
    run = worker._execute_prefill_graph
    worker._execute_prefill_graph = lambda batch, rows: used.append(rows) or run(batch, rows)
    accepted = []
    for p in prompts:  # one at a time: each chunk is alone in its step
        want, got = eager.generate([p], params)[0], graphed.generate([p], params)[0]
        assert got.token_ids == want.token_ids
        assert got.metrics.acceptance_lengths == want.metrics.acceptance_lengths
        accepted += got.metrics.acceptance_lengths
    assert not drafter or max(accepted) > 1
    # 3 -> 16; 21 -> 32; 50 -> 24+24+2 -> 32, 32, 16; 70 -> 24+24+22 -> 32 x3
    assert used == [16, 32, 32, 32, 16, 32, 32, 32]


def test_a_prefill_graphs_warm_up_writes_only_the_padding_block(ckpt):
    """A capture's warm-ups run on the graph's padding (graphs.warm_up,
    target.chunk_padding): a chunk of its own rows into the reserved slot
    0, which the forward takes at every captured length (the longest hold
    more rows than the model has positions), after a prompt's real
    prefill, leaving its K/V and the graph's buffers as they were."""
    import torch

    llm = LLM(ckpt / "t", None, max_model_len=160, cuda_graphs=True)
    llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    worker = llm.engine.target
    kv = worker.kv_cache.clone()
    assert kv[:, :, 1:].abs().sum() > 0
    for graphs in worker.prefill_graphs.values():
        before = {k: v.clone() for k, v in graphs.buffers.items()}
        graphs.warm_up(1)
        assert all(torch.equal(graphs.buffers[k], v) for k, v in before.items())  # given back
    assert torch.equal(worker.kv_cache[:, :, 1:], kv[:, :, 1:])
