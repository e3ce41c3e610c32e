"""Small host-to-device copies through pinned memory that is reused.

A copy from pageable host memory waits for the device to drain its queue,
so every host tensor bound for a step goes through pinned memory. Pinning a
fresh tensor each time was slow on the H200's host: in one profile of a
request's first async launch PyTorch's pinned allocator called
``cudaHostAlloc`` (~150 us of it per launch), and a prefill step's
``pin_memory`` checks (``is_pinned``) took ~360 us. Here one pinned ring is
reused: a session stages host tensors into it, the caller enqueues the
copies that read them, and the session's end records an event; a region is
written again only once the event of the copy that read it has passed (a
wrap of the ring waits for nothing in practice: it is ~1 MB of ids and
flags behind).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import torch

_ALIGN = 64


class PinnedRing:
    """``session(device)`` yields ``stage(t)``: a pinned copy of the host
    tensor ``t`` (same shape and dtype, contiguous) that stays unchanged
    until the copies the caller enqueues on ``device``'s current stream
    before the session ends have run."""

    def __init__(self, nbytes: int = 1 << 20):
        self.nbytes = nbytes
        self._buf: torch.Tensor | None = None  # pinned lazily: a CPU-only process never pins
        self._pos = 0
        self._busy: deque[tuple[int, int, torch.cuda.Event]] = deque()  # regions read by queued copies
        self._lock = threading.RLock()

    @contextmanager
    def session(self, device: torch.device) -> Iterator[Callable[[torch.Tensor], torch.Tensor]]:
        regions: list[tuple[int, int]] = []

        def stage(t: torch.Tensor) -> torch.Tensor:
            n = t.numel() * t.element_size()
            if n == 0:
                return t
            start = self._alloc(n, regions) if n <= self.nbytes // 4 else None
            if start is None:  # rare: too big to share the ring, or the session has filled it
                return t.pin_memory()
            view = self._buf[start : start + n].view(t.dtype).view(t.shape)
            view.copy_(t)
            regions.append((start, start + n))
            return view

        with self._lock:
            try:
                yield stage
            finally:
                if regions:
                    done = torch.cuda.Event()
                    done.record(torch.cuda.current_stream(device))
                    self._busy.extend((a, b, done) for a, b in regions)

    def _alloc(self, n: int, session: list[tuple[int, int]]) -> int | None:
        """The start of ``n`` bytes no queued copy still reads, or None where
        they would overlap the ``session``'s own regions (their copies may
        not be enqueued yet, so nothing could be waited for)."""
        if self._buf is None:
            self._buf = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True)
        n = -(-n // _ALIGN) * _ALIGN
        start = 0 if self._pos + n > self.nbytes else self._pos
        end = start + n
        if any(a < end and start < b for a, b in session):
            return None
        busy = self._busy
        while busy and busy[0][2].query():  # copies run in order: drop the finished ones
            busy.popleft()
        for a, b, event in busy:
            if a < end and start < b:
                event.synchronize()
        self._pos = end
        return start


STAGING = PinnedRing()


def int64_tensor(values) -> torch.Tensor:
    """A host int64 tensor of a (nested) list of ints through numpy:
    ``torch.tensor`` converts a list element by element (~55 ns an int on
    the CI's CPU, 3x numpy's), and a prefill or a join passes each prompt
    token through several such lists (ids, positions, slots, history)."""
    return torch.from_numpy(np.array(values, dtype=np.int64))


def host_to_device(t: torch.Tensor, device) -> torch.Tensor:
    """``t`` on ``device``; a host tensor bound for a GPU is staged in
    pinned memory (``STAGING``) as it is now and copied without waiting for
    the device."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    with STAGING.session(device) as stage:
        return stage(t).to(device, non_blocking=True)
