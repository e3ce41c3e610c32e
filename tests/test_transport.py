"""Channel messages carry any mix of dtypes, odd sizes, 0-dim, empty and
non-contiguous tensors, bit for bit."""

import multiprocessing as mp
import os

import pytest
import torch
from specray.actors import transport as T


def _message():
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(3, 5, generator=g).to(torch.bfloat16),
        torch.arange(7, dtype=torch.int64),
        torch.tensor([True, False, True]),
        torch.randint(0, 9, (2, 3), dtype=torch.int32, generator=g),
        torch.zeros(0, dtype=torch.float32),
        torch.tensor(2.5),
        torch.randn(1, 1, 3, generator=g),
        torch.arange(5, dtype=torch.uint8),
        torch.randn(4, 6, generator=g)[:, ::2],  # not contiguous
    ]


def _same(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_header_round_trip():
    msg = _message()
    cmd, specs = T.decode_header(T.encode_header(7, msg))
    assert cmd == 7 and specs == [(t.dtype, tuple(t.shape)) for t in msg]


def test_header_refuses_what_it_cannot_carry():
    import pytest

    most = (T.HEADER_LEN - 2) // (2 + T._MAX_DIMS)
    T.encode_header(1, [torch.zeros(1)] * most)
    with pytest.raises(ValueError, match="too many tensors"):
        T.encode_header(1, [torch.zeros(1)] * (most + 1))
    with pytest.raises(ValueError, match="dtype torch.float64"):
        T.encode_header(1, [torch.zeros(2, dtype=torch.float64)])


def _end(rank, path, q):
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    ch = T.TorchP2PChannel(1 - rank, "cpu")
    if rank == 0:
        ch.send(3, _message())
        T.broadcast_message(4, _message()[:2], None, "cpu")
        ch.send(5, [])
    else:
        (c1, m1), (c2, m2), (c3, m3) = ch.recv(), T.receive_broadcast(None, "cpu"), ch.recv()
        try:  # checked here: tensors in a queue outlive a child only through shared memory
            assert (c1, c2, c3) == (3, 4, 5) and m3 == []
            _same(m1, _message())
            _same(m2, _message()[:2])
            q.put("ok")
        except AssertionError as e:
            q.put(f"mismatch: {e!r}")
    dist.barrier()
    dist.destroy_process_group()


def test_gloo_p2p_and_broadcast_carry_the_message(tmp_path):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_end, args=(r, str(tmp_path / "rdzv"), q)) for r in (0, 1)]
    for p in procs:
        p.start()
    verdict = q.get(timeout=120)
    for p in procs:
        p.join(timeout=60)
    assert verdict == "ok"


class _NoTraffic:
    def send_raw(self, tensors):
        raise AssertionError("a warm-up sent to a peer")

    def recv_raw(self, out):
        raise AssertionError("a warm-up received from a peer")


def test_step_graph_exchanges_skip_capture_warmups(monkeypatch):
    """A capture's warm-up calls (graphs.DecodeGraphs._capture) exchange
    nothing with a drafter or TP followers: each side captures a kind on
    its own first use, so warm-up messages would pair with the wrong
    replays. Received buffers are zeros then; outside warm-ups traffic
    flows."""
    from specray.actors import graphs
    from specray.actors.step_peers import TPLink

    def broadcast(*args, **kwargs):
        raise AssertionError("a warm-up broadcast to the TP followers")

    monkeypatch.setattr(torch.distributed, "broadcast", broadcast)
    out = [torch.ones(3), torch.ones(2, dtype=torch.int64)]
    with graphs.warming_up():
        graphs.peer_recv(_NoTraffic(), out)
        graphs.peer_send(_NoTraffic(), [torch.ones(2)])
        link = TPLink(group=None)
        link.send_verify(torch.ones(2), torch.ones(2), torch.ones(2), None, torch.ones(1, dtype=torch.int64))
        link.send_moves(torch.ones(2), torch.ones(2))
        assert link.recv(torch.ones(4, dtype=torch.int64)).eq(0).all()
    assert all(t.eq(0).all() for t in out)
    sent = []

    class Peer:
        def send_raw(self, tensors):
            sent.append(tensors)

    graphs.peer_send(Peer(), [torch.ones(2)])
    assert len(sent) == 1 and not graphs.warming()


def test_a_warmup_stand_in_for_a_draft_tree_keeps_the_acceptance_in_bounds():
    """Rank 0's warm-up gets no proposal (the test above): its received tree
    must still be one, since the acceptance scatters by depth - 1 (all-zero
    depths sent it to row -1: on the H100 a device assert in rank 0's
    capture with the drafter in its own process)."""
    from specray.actors import graphs
    from specray.actors.step_parts import drafted_buffers, placeholder_drafted, unpack_drafted
    from specray.draft_tree import accept_greedy

    n, B = 3, 8
    got = drafted_buffers(n, B, tree=True, sampled=False, top_k=4, dev="cpu")
    with graphs.warming_up():
        graphs.peer_recv(_NoTraffic(), got)
        with pytest.raises((RuntimeError, IndexError)):  # zeros: no tree
            accept_greedy(torch.zeros(n, B, dtype=torch.int64), *_tree_args(unpack_drafted(got, B), n, B))
        graphs.peer_recv(_NoTraffic(), got, lambda ts: placeholder_drafted(ts, B))
    drafted = unpack_drafted(got, B)
    assert drafted.shape.depth.tolist() == [list(range(1, B))] * n  # a chain
    acc = accept_greedy(torch.zeros(n, B, dtype=torch.int64), *_tree_args(drafted, n, B))
    assert acc.num_accepted.tolist() == [B - 1] * n  # zero drafts matching a zero target: the whole chain
    assert acc.path_rows.tolist() == [list(range(1, B))] * n


def test_a_proposal_garbled_by_an_aborted_receive_keeps_the_acceptance_in_bounds():
    """A receive ended by an abort (the drafter lost mid-step) leaves the
    channel's stale bytes in rank 0's buffers, and its step's kernels run on
    them before the host drops the results: ``bound_drafted`` puts every
    index in range (a device assert would end rank 0's CUDA context) and
    leaves a real proposal as it was."""
    from specray.actors.step_parts import (
        bound_drafted,
        drafted_bounds,
        drafted_buffers,
        placeholder_drafted,
        unpack_drafted,
    )
    from specray.draft_tree import accept_greedy

    n, B, V = 3, 8, 50
    real = drafted_buffers(n, B, tree=True, sampled=False, top_k=4, dev="cpu")
    for t in real:
        t.zero_()
    placeholder_drafted(real, B)
    real[0][:, :B] = torch.randint(0, V, (n, B))
    want = [t.clone() for t in real]
    bound_drafted(real, drafted_bounds(B, V, True, "cpu"), V)
    assert all(torch.equal(a, b) for a, b in zip(real, want))

    g = torch.Generator().manual_seed(0)
    garbled = drafted_buffers(n, B, tree=True, sampled=False, top_k=4, dev="cpu")
    garbled[0].copy_(torch.randint(-2**40, 2**40, garbled[0].shape, generator=g))
    bound_drafted(garbled, drafted_bounds(B, V, True, "cpu"), V)
    drafted = unpack_drafted(garbled, B)
    assert int(drafted.input_ids.min()) >= 0 and int(drafted.input_ids.max()) < V
    accept_greedy(torch.zeros(n, B, dtype=torch.int64), *_tree_args(drafted, n, B))  # in bounds: no IndexError

    sampled = drafted_buffers(n, B, tree=False, sampled=True, top_k=4, dev="cpu")
    sampled[0].copy_(torch.randint(-2**40, 2**40, sampled[0].shape, generator=g))
    sampled[1].copy_(torch.randint(-2**40, 2**40, sampled[1].shape, generator=g))
    sampled[2].copy_(torch.tensor([float("nan"), float("inf"), -3.0, 7.0]).repeat(n, B - 1, 1))
    bound_drafted(sampled, drafted_bounds(B, V, False, "cpu"), V)
    assert int(sampled[1].min()) >= 0 and int(sampled[1].max()) < V
    assert bool(torch.isfinite(sampled[2]).all())


def test_a_proposal_crosses_the_channel_field_for_field():
    """What the drafter packs (``pack_drafted``) rank 0 unpacks into the same
    proposal from buffers of ``drafted_buffers``' shapes: a tree's and a
    sampled chain's."""
    from specray.actors.step_parts import Drafted, drafted_buffers, pack_drafted, unpack_drafted
    from specray.draft_tree import DraftTree

    n, B, K, V = 3, 6, 4, 50
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (n, B), generator=g)
    looked_up = torch.tensor([True, False, True])
    tree = DraftTree(torch.randint(0, B - 1, (n, B - 1), generator=g), torch.randint(1, B, (n, B - 1), generator=g),
                     torch.randint(0, 2**B, (n, B), generator=g, dtype=torch.int32))
    idx, q = torch.randint(0, V, (n, B - 1, K), generator=g), torch.rand(n, B - 1, K, generator=g)
    for sent, is_tree, sampled in [(Drafted(ids, looked_up, tree), True, False),
                                   (Drafted(ids, looked_up, None, idx, q), False, True)]:
        got = drafted_buffers(n, B, is_tree, sampled, K, "cpu")
        for buf, t in zip(got, pack_drafted(sent), strict=True):
            buf.copy_(t)
        back = unpack_drafted(got, B)
        assert torch.equal(back.input_ids, ids) and torch.equal(back.looked_up, looked_up)
        if is_tree:
            for a, b in zip((back.shape.parent, back.shape.depth, back.shape.masks), (tree.parent, tree.depth, tree.masks)):
                assert torch.equal(a, b) and a.dtype == b.dtype
        else:
            assert back.shape is None and torch.equal(back.draft_idx, idx) and torch.equal(back.draft_q, q)


def _tree_args(drafted, n: int, B: int) -> tuple:
    return drafted.drafts, drafted.shape, torch.full((n,), B - 1)


def test_a_capture_warm_up_gives_back_the_buffers_and_the_state_it_keeps():
    """A step that hands state to the next step outside its buffers (a
    separate drafter's ``prev`` positions and slots) declares it ``keep``:
    the warm-up calls give it back, or the replay after a capture stored
    its context where the warm-ups' step would have (H100: wrong context,
    the drafter's gathers out of bounds)."""
    from specray.actors import graphs

    buf, state = torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64)
    seen = []

    def step(n):
        seen.append(graphs.warming())
        buf[:n] += 1
        state[:n] += 10
        return ()

    g = graphs.DecodeGraphs(step, {"x": buf}, {"x": 1}, {"x": 0}, 4, torch.device("cpu"), keep=(state,))
    g.warm_up(4)
    assert seen == [True, True] and not graphs.warming()
    assert buf.eq(0).all() and state.eq(0).all()


def test_a_capture_warm_up_runs_on_padding_rows_only():
    """A capture may come before its first inputs (``capture_all`` when a
    step kind is first used), while the buffers hold the last chain's rows:
    the warm-up calls execute, so what they write must go to the padding
    block, not to blocks the new requests hold (H100: a chain's first
    sampled step's warm-ups wrote the drafter's context over new prompts)."""
    from specray.actors import graphs

    slots = torch.tensor([5, 9, 0, 0])  # the last chain's rows: blocks handed on since
    cache = torch.zeros(16, dtype=torch.int64)
    history = torch.arange(5)  # padded with None: a padding row's row is the last

    def step(n):
        cache.index_fill_(0, slots[:n], 1)
        history[4] = 7
        return ()

    g = graphs.DecodeGraphs(step, {"slots": slots, "history": history}, {"slots": 1, "history": 1},
                            {"slots": 0, "history": None}, 4, torch.device("cpu"))
    g.warm_up(4)
    assert cache[1:].eq(0).all(), cache
    assert slots.tolist() == [5, 9, 0, 0]
    assert history.tolist() == [0, 1, 2, 3, 7]  # neither filled nor given back


@pytest.mark.gpu
def test_gpu_graph_families_capture_on_streams_of_their_own():
    """Each lane's step graphs and the target's are captured on streams of
    their own (cuBLAS keeps a workspace per stream, which a graph holds):
    one stream a family, reused by its later captures."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from specray.actors.graphs import DecodeGraphs, capture_stream

    dev = torch.device("cuda", 0)
    streams = {f: capture_stream(dev, f) for f in ("static", ("step", 0), ("step", 1))}
    assert len({s.cuda_stream for s in streams.values()}) == 3
    assert capture_stream(dev, ("step", 1)).cuda_stream == streams[("step", 1)].cuda_stream
    x = torch.zeros(4, device=dev)
    w = torch.randn(64, 64, device=dev)
    g = DecodeGraphs(lambda n: ((x[:n, None] + w[:n]) @ w,), {"x": x}, {"x": 1}, {"x": 0}, 4, dev, family=("step", 1))
    g.run(4, {"x": torch.ones(4)})
    torch.cuda.synchronize()
    assert torch.allclose(g.outputs[4][0], (1 + w[:4]) @ w)
