"""Host-side bookkeeping of the step graphs' device buffers: which row of
the token history holds which request (``HistorySlots``), and the pinned
host copies that steps' results are read from (``ResultBuffers``)."""

from __future__ import annotations

import torch

from specray.request import Request
from specray.staging import int64_tensor


class HistorySlots:
    """Which row of the step graphs' token history (``[num_slots + 1, W]``
    on the device) holds which request, and the tokens each row lacks.

    A row keeps its request's tokens across chains: the graph writes every
    token it accepts there, and before a chain starts the host uploads only
    what was added since the previous chain's start (prefill, synchronous
    steps; the host's tokens are the truth, so re-sending a few the device
    already has is harmless). Rows of requests no longer running are
    reclaimed at each chain start, so ``num_slots = max_num_seqs`` suffice.
    A request whose rows never look up (a sampled one: step graphs draft
    lookups for greedy rows only) holds no row: it is given the padding row
    ``num_slots``, where its steps write what nothing reads, and its tokens
    are not uploaded (a chain at T=1 uploaded every joining prompt for
    nothing).
    """

    def __init__(self, num_slots: int):
        self.owners: list[Request | None] = [None] * num_slots
        self.padding = num_slots

    def prepare(self, requests: list[Request], running: list[Request]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each request's row ``[S]``, and the uploads ``[3, N]`` (row,
        position, token) that bring the rows up to the host's tokens."""
        alive = {id(r) for r in running}
        for i, owner in enumerate(self.owners):
            if owner is not None and id(owner) not in alive:
                owner.history_slot, owner.history_on_device = None, 0
                self.owners[i] = None
        slots, rows, cols, values = [], [], [], []
        for r in requests:
            if not r.params.greedy:
                slots.append(self.padding)
                continue
            if r.history_slot is None:
                r.history_slot = self.owners.index(None)
                self.owners[r.history_slot] = r
            tokens = r.all_token_ids
            k = r.history_on_device
            rows += [r.history_slot] * (len(tokens) - k)
            cols += range(k, len(tokens))
            values += tokens[k:]
            r.history_on_device = len(tokens)
            slots.append(r.history_slot)
        return int64_tensor(slots), int64_tensor([rows, cols, values])

    def clear(self) -> None:
        """The history buffer went with its graphs: no row holds anything."""
        for r in self.owners:
            if r is not None:
                r.history_slot, r.history_on_device = None, 0
        self.owners = [None] * len(self.owners)


class ResultBuffers:
    """Pinned host buffers that steps' results are copied into, taken in
    turn. A step's results are read before two more steps are launched (one
    step is in flight while the previous one is applied, one a lane; a
    synchronous step's are read as soon as a chain it starts is launched), so
    eight buffers are never overwritten while the host may still read them
    (two lanes); taking one also waits for the copy into it from eight steps
    before (long done: the
    copy of a step that was dropped unread may still be queued). A fresh
    pinned buffer a step went through PyTorch's pinned allocator
    (staging.py says what that cost)."""

    def __init__(self, count: int = 8):
        self._slots: list[tuple[torch.Tensor | None, torch.cuda.Event | None]] = [(None, None)] * count
        self._next = 0

    def fetch(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        """A pinned copy of the device tensor ``out`` (enqueued), and the
        event recorded after it."""
        i = self._next
        self._next = (i + 1) % len(self._slots)
        buf, previous = self._slots[i]
        if previous is not None:
            previous.synchronize()
        if buf is None or buf.dtype != out.dtype or buf.numel() < out.numel():
            buf = torch.empty(out.numel(), dtype=out.dtype, pin_memory=True)
        results = buf[: out.numel()].view(out.shape)
        results.copy_(out, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(out.device))  # the copy's stream, whichever device is current
        self._slots[i] = (buf, ready)
        return results, ready
