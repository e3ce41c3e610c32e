"""The CUDA IPC drafter channel (rank 0 and a drafter on one GPU): how a
message is cut into slots, the two ends as threads over the host reference
(CPU), and on a GPU two processes exchanging messages eagerly and from
CUDA graphs, against the bytes sent, and an abort that ends a wait."""

import multiprocessing as mp
import threading

import pytest
import torch

from specray.actors.ipc_channel import IpcChannel, chunks


def test_chunks_cut_a_message_into_slots_in_order():
    assert chunks([], 8) == [] and chunks([0, 0], 8) == []
    assert chunks([3, 0, 5], 8) == [[(0, 0, 0, 3), (2, 0, 3, 5)]]
    assert chunks([20], 8) == [[(0, 0, 0, 8)], [(0, 8, 0, 8)], [(0, 16, 0, 4)]]
    assert chunks([6, 6], 8) == [[(0, 0, 0, 6), (1, 0, 6, 2)], [(1, 2, 0, 4)]]
    # Every byte once, in order, and no chunk over a slot.
    sizes = [13, 0, 64, 1, 30]
    got = [(i, t, n) for c in chunks(sizes, 16) for i, t, _s, n in c]
    assert sum(n for *_, n in got) == sum(sizes)
    assert all(sum(n for *_, n in c) <= 16 for c in chunks(sizes, 16))


def _messages(seed: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in (1, 7, 40, 3):
        out.append([torch.randn(n, 5, generator=g).to(torch.bfloat16),
                    torch.randint(0, 1 << 40, (n, 3), generator=g),
                    torch.zeros(0, dtype=torch.int32),
                    torch.rand(n, generator=g) > 0.5])
    return out


def test_two_ends_exchange_messages_larger_than_the_ring():
    # Slots of 64 bytes, 2 of them: the larger messages wait for the reader.
    a = IpcChannel.create("cpu", slots=2, slot_bytes=64)
    b = IpcChannel(1, a.ring, a.flags, a.slots, a.slot_bytes)
    sent = _messages(0)
    got, errors = [], []

    def drafter():
        try:
            for msg in sent:
                out = [torch.empty_like(t) for t in msg]
                b.recv_raw(out)
                got.append(out)
                b.send_raw([out[1] + 1])
        except BaseException as e:  # noqa: BLE001 - re-raised by the test
            errors.append(e)

    th = threading.Thread(target=drafter)
    th.start()
    replies = []
    for msg in sent:
        a.send_raw(msg)
        reply = torch.empty_like(msg[1])
        a.recv_raw([reply])
        replies.append(reply)
    th.join(timeout=60)
    assert not errors and len(got) == len(sent)
    for msg, out, reply in zip(sent, got, replies):
        for t, u in zip(msg, out):
            assert torch.equal(t, u)
        assert torch.equal(reply, msg[1] + 1)


def test_abort_ends_a_wait_for_a_message_never_sent():
    a = IpcChannel.create("cpu", slots=2, slot_bytes=64)
    out, errors = torch.full((4,), -1), []

    def wait():
        try:
            a.recv_raw([out])  # direction 1: the drafter, who never sends
        except BaseException as e:  # noqa: BLE001 - re-raised by the test
            errors.append(e)

    th = threading.Thread(target=wait)
    th.start()
    th.join(timeout=0.3)
    assert th.is_alive()  # still waiting
    a.abort()
    th.join(timeout=10)
    assert not th.is_alive() and not errors
    # Later sends do not wait for a reader that is gone either.
    for _ in range(5):
        a.send_raw([torch.arange(40)])


# ----------------------------------------------------------------- GPU


def _gpu_end(rank, q_handles, q_out, rounds):
    from specray.actors.ipc_channel import IpcChannel

    torch.cuda.set_device(0)
    if rank == 0:
        ch = IpcChannel.create("cuda", slots=2, slot_bytes=1 << 16)
        q_handles.put(ch.handles())
    else:
        ch = IpcChannel.open(q_handles.get(timeout=60))
    g = torch.Generator(device="cuda").manual_seed(rank)
    # Eager: a message of ~1.3 MB (20 chunks through 2 slots) and a small one back.
    if rank == 0:
        big = torch.randn(160, 4096, dtype=torch.bfloat16, device="cuda", generator=g)
        ch.send_raw([big, torch.arange(37, device="cuda")])
        reply = torch.empty(5, dtype=torch.int64, device="cuda")
        ch.recv_raw([reply])
        torch.cuda.synchronize()
        eager = (big.float().sum().item(), reply.tolist())
    else:
        big, meta = torch.empty(160, 4096, dtype=torch.bfloat16, device="cuda"), torch.empty(37, dtype=torch.int64,
                                                                                         device="cuda")
        ch.recv_raw([big, meta])
        ch.send_raw([meta[:5] * 2])
        torch.cuda.synchronize()
        eager = (big.float().sum().item(), meta.tolist())
    # Captured: rank 0 sends x and receives y = x * 3 + round; the drafter's graph does the opposite.
    x = torch.zeros(1000, dtype=torch.float32, device="cuda")
    y = torch.zeros_like(x)
    r = torch.zeros(1, dtype=torch.float32, device="cuda")

    def step():
        if rank == 0:
            ch.send_raw([x])
            ch.recv_raw([y])
        else:
            ch.recv_raw([x])
            y.copy_(x * 3 + r)
            ch.send_raw([y])

    step()  # warm-up (the kernels compile), then capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    ok = []
    for i in range(rounds):
        if rank == 0:
            x.copy_(torch.randn(1000, device="cuda", generator=g))
        else:
            r.fill_(float(i))
        graph.replay()
        if rank == 0:
            torch.cuda.synchronize()
            ok.append(bool(torch.equal(y, x * 3 + i)))
    torch.cuda.synchronize()
    q_out.put((rank, eager, ok))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_two_processes_exchange_eagerly_and_from_graphs(rounds=25):
    ctx = mp.get_context("spawn")
    q_handles, q_out = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_gpu_end, args=(r, q_handles, q_out, rounds)) for r in (0, 1)]
    for p in procs:
        p.start()
    res = dict((rank, (eager, ok)) for rank, eager, ok in (q_out.get(timeout=240) for _ in procs))
    for p in procs:
        p.join(timeout=60)
    assert res[0][0][1] == [0, 2, 4, 6, 8]
    assert res[1][0][1] == list(range(37))
    assert abs(res[0][0][0] - res[1][0][0]) <= 1e-3 * max(1.0, abs(res[0][0][0]))
    assert res[0][1] == [True] * rounds


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_abort_ends_a_wait_for_a_message_never_sent():
    ch = IpcChannel.create("cuda", slots=2, slot_bytes=1 << 12)
    out = torch.full((10,), -1, dtype=torch.int64, device="cuda")
    ch.recv_raw([out])  # rank 0 waits on direction 1, which nobody writes
    done = torch.cuda.Event()
    done.record()
    assert not done.query()
    ch.abort()
    done.synchronize()
    assert done.query()
