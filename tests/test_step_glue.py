"""A step graph's index arithmetic (kernels/step_glue.py): the references
against hand-worked cases, and the Triton kernels against the references
on random rows (on the GPU, and in Triton's interpreter with
``TRITON_INTERPRET=1``)."""

import os

import pytest
import torch

from specray.kernels.step_glue import accept_advance_ref, block_inputs_ref

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
interp = pytest.mark.skipif(not INTERP, reason="set TRITON_INTERPRET=1 to run kernels in Triton's interpreter")


def i64(*values):
    return torch.tensor(values, dtype=torch.int64)


def test_block_inputs_by_hand():
    # Row 0 starts at 5 with blocks of 4 tokens: positions 5..10 cross from
    # its second table entry (block 7) into its third (block 2).
    tables = torch.tensor([[9, 7, 2, 0], [3, 0, 0, 0]], dtype=torch.int32)
    res = block_inputs_ref(i64(5, 0), i64(42, 43), i64(100, 2), tables, tables.flip(1).contiguous(), 6, 4, 99)
    assert res.positions.tolist() == [[5, 6, 7, 8, 9, 10], [0, 1, 2, 3, 4, 5]]
    assert res.target_slots.tolist() == [[29, 30, 31, 8, 9, 10], [12, 13, 14, 15, 0, 1]]
    assert res.draft_slots.tolist() == [[9, 10, 11, 28, 29, 30], [0, 1, 2, 3, 0, 1]]
    assert res.block_len.tolist() == [6, 3]  # a budget of 2 tokens: the block and 2 drafts
    assert res.block_ids.tolist() == [[42, 99, 99, 99, 99, 99], [43, 99, 99, 99, 99, 99]]
    assert res.seq_lens.tolist() == [11, 6] and res.known_lens.tolist() == [6, 1]


def test_accept_advance_greedy_by_hand():
    B = 5
    drafts = i64(11, 12, 13, 14, 21, 22, 23, 24, 31, 32, 33, 34).view(3, 4)
    argmax = i64(11, 12, 90, 14, 91, 7, 22, 23, 24, 92, 31, 32, 33, 34, 93).view(3, B)
    # Row 0 matches twice, then not; row 1 not at all; row 2 all four, but
    # its block was cut to 3 rows (2 drafts).
    block_len, looked_up = i64(5, 5, 3), torch.tensor([False, True, False])
    draft_slots = torch.arange(100, 115).view(3, B)
    start, last, budget, real = i64(10, 20, 30), i64(0, 0, 0), i64(50, 50, 2), torch.tensor([True, True, False])
    history, rows = torch.zeros(4, 40, dtype=torch.int64), i64(2, 0, 3)
    out, slots = accept_advance_ref(argmax, None, None, drafts, block_len, looked_up, draft_slots, start, last,
                                    budget, real, history, rows)
    assert out.tolist() == [[2, 90, 0, 11, 12, 13, 14], [0, 7, 1, 21, 22, 23, 24], [2, 33, 0, 31, 32, 33, 34]]
    assert slots.tolist() == [[100, 101, 102, 0, 0], [105, 0, 0, 0, 0], [110, 111, 112, 0, 0]]
    assert start.tolist() == [13, 21, 0] and last.tolist() == [90, 7, 0]  # row 2 is padding
    assert budget.tolist() == [47, 49, -1]
    assert history[2, 11:16].tolist() == [11, 12, 90, 90, 90]
    assert history[0, 21:26].tolist() == [7] * 5
    assert history[3, 31:36].tolist() == [31, 32, 33, 33, 33]


def test_accept_advance_given_acceptance():
    """Sampled steps: the acceptance comes from ``sampling.verify``; no
    drafter: blocks of one row and no drafts."""
    start, last, budget, real = i64(3, 4), i64(0, 0), i64(9, 9), torch.tensor([True, True])
    out, slots = accept_advance_ref(None, i64(0, 0), i64(5, 6), torch.zeros(2, 0, dtype=torch.int64), i64(1, 1),
                                    torch.zeros(2, dtype=torch.bool), None, start, last, budget, real)
    assert out.tolist() == [[0, 5, 0], [0, 6, 0]] and slots is None
    assert start.tolist() == [4, 5] and last.tolist() == [5, 6] and budget.tolist() == [8, 8]


def random_case(device, S, B, greedy, drafter, history, seed):
    g = torch.Generator().manual_seed(seed)
    G, W, kvb, V = B - 1, 12, 16, 7  # a vocabulary of 7: drafts often match
    start = torch.randint(0, W * kvb - 2 * B, (S,), generator=g)
    drafts = torch.randint(0, V, (S, G), generator=g)
    args = dict(
        start=start, last=torch.randint(0, V, (S,), generator=g), budget=torch.randint(-1, 2 * B, (S,), generator=g),
        target_tables=torch.randint(0, 50, (S, W), generator=g, dtype=torch.int32),
        draft_tables=torch.randint(0, 50, (S, W), generator=g, dtype=torch.int32) if drafter else None)
    after = dict(
        argmax=torch.where(torch.rand(S, B, generator=g) < 0.7,
                           torch.cat([drafts, torch.randint(0, V, (S, 1), generator=g)], 1),
                           torch.randint(0, V, (S, B), generator=g)) if greedy else None,
        num_accepted=None if greedy else torch.randint(0, B, (S,), generator=g),
        bonus=None if greedy else torch.randint(0, V, (S,), generator=g),
        drafts=drafts, looked_up=torch.rand(S, generator=g) < 0.5, real=torch.rand(S, generator=g) < 0.8,
        history=torch.randint(0, V, (S + 1, W * kvb + B), generator=g) if history else None,
        history_rows=torch.randperm(S + 1, generator=g)[:S] if history else None)
    move = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in (args | after).items()}
    if not greedy and not drafter:
        # As a separate drafter's mirror passes them: columns of the step's
        # packed result (step_peers.build_drafter_graphs), strided.
        packed = torch.stack([move["num_accepted"], move["bonus"]], 1)
        move["num_accepted"], move["bonus"] = packed[:, 0], packed[:, 1]
        assert not move["num_accepted"].is_contiguous()
    return {k: move[k] for k in args}, {k: move[k] for k in after}, kvb


def check_kernels(device, S, B, greedy, drafter, history):
    from specray.kernels import step_glue_triton as tri

    for seed in range(3):
        pre, post, kvb = random_case(device, S, B, greedy, drafter, history, seed)
        want = block_inputs_ref(*pre.values(), B, kvb, 99)
        got = tri.block_inputs(*pre.values(), B, kvb, 99)
        for name in ("positions", "target_slots", "draft_slots", "block_len", "block_ids", "seq_lens", "known_lens"):
            w, x = getattr(want, name), getattr(got, name)
            assert (w is None and x is None) or torch.equal(w, x), name
        states = [{k: v.clone() for k, v in pre.items() if v is not None} | {"history": post["history"]}
                  for _ in range(2)]
        outs = []
        for fn, state in zip((accept_advance_ref, tri.accept_advance), states):
            if state["history"] is not None:
                state["history"] = state["history"].clone()
            outs.append(fn(post["argmax"], post["num_accepted"], post["bonus"], post["drafts"], want.block_len,
                           post["looked_up"], want.draft_slots, state["start"], state["last"], state["budget"],
                           post["real"], state["history"], post["history_rows"]))
        (out_w, slots_w), (out_g, slots_g) = outs
        assert torch.equal(out_w, out_g), (seed, out_w, out_g)
        assert (slots_w is None and slots_g is None) or torch.equal(slots_w, slots_g)
        for name in ("start", "last", "budget", "history"):
            w, x = states[0][name], states[1][name]
            assert (w is None and x is None) or torch.equal(w, x), name


CASES = [  # S, B, greedy, drafter, history
    (7, 16, True, True, True), (5, 16, False, True, True), (3, 6, True, True, False), (4, 16, False, True, False),
    (6, 1, True, False, False), (2, 1, False, False, False), (1, 16, True, True, True),
    (5, 16, False, False, True), (6, 8, False, False, False),  # a separate drafter's mirror of rank 0's step
]


@pytest.mark.gpu
@pytest.mark.parametrize("S,B,greedy,drafter,history", CASES)
def test_step_glue_kernels_gpu(S, B, greedy, drafter, history):
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    check_kernels("cuda", S, B, greedy, drafter, history)


@interp
@pytest.mark.parametrize("S,B,greedy,drafter,history", CASES)
def test_step_glue_kernels_interp(S, B, greedy, drafter, history):
    check_kernels("cpu", S, B, greedy, drafter, history)
