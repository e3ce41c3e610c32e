"""Pinned staging (cluster/staging.py) and the async steps' pinned result
buffers: copies queued behind a busy GPU still read and write what they
were given, while the host reuses the same pinned memory."""

import pytest
import torch

from specray.step_buffers import ResultBuffers
from specray.staging import PinnedRing, host_to_device

pytestmark = pytest.mark.gpu

BUSY_CYCLES = 200_000_000  # ~0.1 s: every copy below is queued behind it


def test_gpu_ring_wraps_without_overwriting_queued_copies():
    ring = PinnedRing(nbytes=4096)
    dev = torch.device("cuda")
    torch.cuda._sleep(BUSY_CYCLES)
    outs, wants = [], []
    for i in range(200):  # 200 x 256 B through 4 KB: the ring wraps ~12 times
        want = torch.arange(i * 32, (i + 1) * 32, dtype=torch.int64)
        with ring.session(dev) as stage:
            outs.append(stage(want).to(dev, non_blocking=True))
        want.zero_()  # the staged copy was taken at stage time
        wants.append(torch.arange(i * 32, (i + 1) * 32, dtype=torch.int64))
    torch.cuda.synchronize()
    for out, want in zip(outs, wants):
        assert torch.equal(out.cpu(), want)


def test_gpu_one_session_larger_than_the_ring_keeps_every_tensor():
    """Tensors staged first and copied at the session's end: where the
    session would wrap onto its own regions it pins a fresh buffer instead."""
    ring = PinnedRing(nbytes=4096)
    dev = torch.device("cuda")
    wants = [torch.full((128,), i, dtype=torch.int64) for i in range(8)]  # 8 x 1 KB through 4 KB
    torch.cuda._sleep(BUSY_CYCLES)
    with ring.session(dev) as stage:
        staged = [stage(w) for w in wants]
        outs = [t.to(dev, non_blocking=True) for t in staged]
    torch.cuda.synchronize()
    for out, want in zip(outs, wants):
        assert torch.equal(out.cpu(), want)


def test_gpu_host_to_device_keeps_dtype_shape_and_values():
    torch.cuda._sleep(BUSY_CYCLES)
    g = torch.Generator().manual_seed(0)
    cases = [
        torch.randint(-5, 5, (7, 3), generator=g),
        torch.rand(5, generator=g) > 0.5,
        torch.rand(2, 3, 4, generator=g, dtype=torch.float64),
        torch.randint(0, 9, (6, 8), generator=g, dtype=torch.int32)[:, ::3],  # not contiguous
        torch.zeros(0, dtype=torch.int64),
        torch.ones(300_000, dtype=torch.int64),  # past a quarter of the ring: pinned on its own
    ]
    outs = [host_to_device(t, "cuda") for t in cases]
    torch.cuda.synchronize()
    for out, t in zip(outs, cases):
        assert out.device.type == "cuda" and out.dtype == t.dtype and out.shape == t.shape
        assert torch.equal(out.cpu(), t)


def test_gpu_result_buffers_hold_each_step_until_read():
    bufs = ResultBuffers(count=4)
    src = torch.arange(64, dtype=torch.int64, device="cuda").view(4, 16)
    pending = []
    for step in range(12):
        torch.cuda._sleep(BUSY_CYCLES // 20)
        pending.append((bufs.fetch(src * step + step), step))
        if len(pending) == 2:  # read one step behind, as the engine does
            (results, ready), k = pending.pop(0)
            ready.synchronize()
            assert torch.equal(results, (torch.arange(64).view(4, 16) * k + k))
