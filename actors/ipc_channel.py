"""Rank 0 <-> a drafter in another process on the same GPU, where NCCL
refuses to pair two ranks: the tensors go through a ring of slots in device
memory that rank 0 allocates and the drafter opens through CUDA IPC.

Each direction has ``SLOTS`` slots of ``slot_bytes`` and two counters in
device memory: ``posted`` (chunks written; only the sender adds to it) and
``acked`` (chunks read; only the receiver). A message's bytes (its tensors
in order, shapes known to both ends) are cut into slot-sized chunks the
same way on both sides. The sender's copy kernel waits on the GPU until a
slot is free (``posted - acked < SLOTS``), copies, and a one-thread kernel
adds 1 to ``posted``; the receiver's waits until ``posted > acked``, copies
out and adds 1 to ``acked``. Every wait and count is on the stream, not the
host, so a step graph captures the exchange as it captures NCCL's, and the
counters carry over from replay to replay.

Without MPS the two processes' kernels take turns on the GPU (time slices),
so this pairing is for correctness and fault isolation on one GPU, not for
overlap. ``copy_reference`` is the kernels' PyTorch reference.
"""

from __future__ import annotations

import pickle
import time

import torch

from specray.actors.transport import _staged

SLOTS = 4
SLOT_BYTES = 4 << 20
_FIELD = 16  # int64s between counters: each on a 128-byte line of its own
_AHEAD = 1 << 60  # what ``abort`` sets a peer's counters to: no wait is ever long again


def counter_index(direction: int, acked: bool) -> int:
    """Where a direction's ``posted`` / ``acked`` counter sits in ``flags``."""
    return _FIELD * (2 * direction + int(acked))


def chunks(nbytes: list[int], slot_bytes: int) -> list[list[tuple[int, int, int, int]]]:
    """A message of tensors of ``nbytes`` each, cut into slots: per chunk,
    its segments ``(tensor, tensor_offset, slot_offset, length)``. Empty
    tensors take no segment; a message of no bytes takes no chunk."""
    out, cur, used = [], [], 0
    for i, n in enumerate(nbytes):
        done = 0
        while done < n:
            take = min(n - done, slot_bytes - used)
            cur.append((i, done, used, take))
            done, used = done + take, used + take
            if used == slot_bytes:
                out.append(cur)
                cur, used = [], 0
    if cur:
        out.append(cur)
    return out


def byte_view(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def copy_reference(src: torch.Tensor, dst: torch.Tensor, flags: torch.Tensor, slot_offset: int, to_ring: bool,
                   direction: int, slots: int, slot_bytes: int, timeout_s: float = 30.0) -> None:
    """What the copy kernel does, run by the host: the two ends are threads
    of one process (tests), the wait a poll that gives up after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        posted = int(flags[counter_index(direction, False)])
        acked = int(flags[counter_index(direction, True)])
        if not ((posted - acked >= slots) if to_ring else (posted <= acked)):
            break
        if time.monotonic() > deadline:
            raise TimeoutError("the ring stayed full" if to_ring else "nothing was posted")
        time.sleep(1e-4)
    ring, data = (dst, src) if to_ring else (src, dst)
    at = ((posted if to_ring else acked) % slots) * slot_bytes + slot_offset
    if to_ring:
        ring[at: at + data.numel()].copy_(data)
    else:
        data.copy_(ring[at: at + data.numel()])


def _kernels():
    import triton
    import triton.language as tl

    # Nothing but the constants is specialized on (sizes, offsets, the
    # tensors' alignment): the variants a channel runs are the two it loads
    # when it is made (IpcChannel._preload).
    @triton.jit(do_not_specialize=["src_ptr", "dst_ptr", "nbytes", "slot_offset"],
                do_not_specialize_on_alignment=["src_ptr", "dst_ptr"])
    def copy_kernel(src_ptr, dst_ptr, flags_ptr, nbytes, slot_offset, TO_RING: tl.constexpr,
                    POSTED: tl.constexpr, ACKED: tl.constexpr, SLOTS_: tl.constexpr, SLOT_BYTES_: tl.constexpr,
                    BLOCK: tl.constexpr):
        # Every program waits for itself: the counter it waits on moves only
        # in a later kernel of the other process.
        posted = tl.atomic_add(flags_ptr + POSTED, 0, sem="acquire", scope="sys")
        acked = tl.atomic_add(flags_ptr + ACKED, 0, sem="acquire", scope="sys")
        if TO_RING:
            while posted - acked >= SLOTS_:
                acked = tl.atomic_add(flags_ptr + ACKED, 0, sem="acquire", scope="sys")
            base = (posted % SLOTS_) * SLOT_BYTES_ + slot_offset
        else:
            while posted <= acked:
                posted = tl.atomic_add(flags_ptr + POSTED, 0, sem="acquire", scope="sys")
            base = (acked % SLOTS_) * SLOT_BYTES_ + slot_offset
        for start in range(tl.program_id(0) * BLOCK, nbytes, tl.num_programs(0) * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < nbytes
            if TO_RING:
                tl.store(dst_ptr + base + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)
            else:
                tl.store(dst_ptr + offs, tl.load(src_ptr + base + offs, mask=mask), mask=mask)

    @triton.jit
    def count_kernel(flags_ptr, FIELD: tl.constexpr):
        tl.atomic_add(flags_ptr + FIELD, 1, sem="release", scope="sys")

    # The counters are arguments, not constants, and not specialized on:
    # the kernel loaded when the channel is made is the one ``abort`` runs
    # (loading another while a dead peer's wait holds the device hung the
    # H100's abort test).
    @triton.jit(do_not_specialize=["a", "b"])
    def ahead_kernel(flags_ptr, a, b, VALUE: tl.constexpr):
        tl.atomic_xchg(flags_ptr + a, VALUE, sem="release", scope="sys")
        tl.atomic_xchg(flags_ptr + b, VALUE, sem="release", scope="sys")

    return copy_kernel, count_kernel, ahead_kernel


_KERNELS = None
_BLOCK = 8192


def _loaded():
    """(copy, count, ahead): compiled on first use."""
    global _KERNELS
    if _KERNELS is None:
        _KERNELS = _kernels()
    return _KERNELS


def _copy(src: torch.Tensor, dst: torch.Tensor, flags: torch.Tensor, slot_offset: int, to_ring: bool,
          direction: int, slots: int, slot_bytes: int) -> None:
    if flags.device.type != "cuda":
        return copy_reference(src, dst, flags, slot_offset, to_ring, direction, slots, slot_bytes)
    n = src.numel() if to_ring else dst.numel()
    # A small grid: the waiting programs stay resident beside whatever else runs.
    grid = (max(1, min(-(-n // _BLOCK), 64)),)
    _loaded()[0][grid](src, dst, flags, n, slot_offset, TO_RING=to_ring,
                      POSTED=counter_index(direction, False), ACKED=counter_index(direction, True),
                      SLOTS_=slots, SLOT_BYTES_=slot_bytes, BLOCK=_BLOCK)


def _ahead(flags: torch.Tensor, a: int, b: int, stream) -> None:
    """Counters ``a`` and ``b`` of ``flags`` jump ahead, written on
    ``stream`` (waited for)."""
    with torch.cuda.stream(stream):
        _loaded()[2][(1,)](flags, a, b, VALUE=_AHEAD)
    stream.synchronize()


def _count(flags: torch.Tensor, field: int) -> None:
    if flags.device.type != "cuda":
        flags[field] += 1
        return
    _loaded()[1][(1,)](flags, FIELD=field)


class IpcChannel:
    """One end of the pairing: ``rank`` 0 (the target's rank 0: it
    allocates) sends in direction 0, 1 (the drafter) in direction 1. The
    interface is ``CupyNcclChannel``'s data half: ``send_raw`` /
    ``recv_raw`` of tensors whose shapes both ends know, issued on the
    current stream."""

    def __init__(self, rank: int, ring: torch.Tensor, flags: torch.Tensor, slots: int = SLOTS,
                 slot_bytes: int = SLOT_BYTES):
        self.rank, self.ring, self.flags = rank, ring, flags  # ring [2, slots * slot_bytes] uint8
        self.slots, self.slot_bytes = slots, slot_bytes
        self.device = ring.device
        self._keepalive: list[torch.Tensor] = []
        self._abort_stream = None
        if self.device.type == "cuda":
            self._abort_stream = torch.cuda.Stream(self.device)
            self._preload()

    def _preload(self) -> None:
        """Every kernel this end will launch, run once on scratch counters
        that let it through: a kernel's first launch loads its module, and
        a load waits for this process's queued kernels, so one behind a
        wait that only the peer (or ``abort``) ends never came (on the
        H100 the first receive's count kernel hung the abort test)."""
        scratch = torch.zeros(4 * _FIELD, dtype=torch.int64, device=self.device)
        scratch[counter_index(1 - self.rank, False)] = 1  # a posted message: the receive does not wait
        nothing = torch.zeros(1, dtype=torch.uint8, device=self.device)
        for to_ring, direction in ((True, self.rank), (False, 1 - self.rank)):
            src, dst = (nothing[:0], nothing) if to_ring else (nothing, nothing[:0])  # no bytes
            _copy(src, dst, scratch, 0, to_ring, direction, self.slots, self.slot_bytes)
            _count(scratch, counter_index(direction, acked=not to_ring))
        _ahead(scratch, *self._abort_fields(), self._abort_stream)
        torch.cuda.synchronize(self.device)

    @classmethod
    def create(cls, device, slots: int = SLOTS, slot_bytes: int = SLOT_BYTES) -> "IpcChannel":
        ring = torch.empty(2, slots * slot_bytes, dtype=torch.uint8, device=device)
        flags = torch.zeros(4 * _FIELD, dtype=torch.int64, device=device)
        return cls(0, ring, flags, slots, slot_bytes)

    def handles(self) -> bytes:
        """What the other process opens the ring and counters with."""
        from torch.multiprocessing.reductions import reduce_tensor

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the counters' zeros are written before the peer reads them
        return pickle.dumps(((reduce_tensor(self.ring)[1], reduce_tensor(self.flags)[1]),
                             self.slots, self.slot_bytes))

    @classmethod
    def open(cls, handles: bytes) -> "IpcChannel":
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        (ring_args, flags_args), slots, slot_bytes = pickle.loads(handles)
        return cls(1, rebuild_cuda_tensor(*ring_args), rebuild_cuda_tensor(*flags_args), slots, slot_bytes)

    def send_raw(self, tensors: list[torch.Tensor]) -> None:
        views = [byte_view(_staged(t, self.device)) for t in tensors]  # host tensors through the pinned ring
        self._move(views, to_ring=True, direction=self.rank)
        self._keepalive = views  # read by kernels still queued

    def recv_raw(self, out: list[torch.Tensor]) -> None:
        if not all(t.is_contiguous() for t in out):  # a reshape would copy: the bytes would land elsewhere
            raise ValueError("recv_raw needs contiguous tensors")
        views = [byte_view(t) for t in out]
        self._move(views, to_ring=False, direction=1 - self.rank)

    def _move(self, views: list[torch.Tensor], to_ring: bool, direction: int) -> None:
        ring = self.ring[direction]
        done = counter_index(direction, acked=not to_ring)
        for chunk in chunks([v.numel() for v in views], self.slot_bytes):
            for i, t_off, s_off, n in chunk:
                part = views[i][t_off: t_off + n]
                src, dst = (part, ring) if to_ring else (ring, part)
                _copy(src, dst, self.flags, s_off, to_ring, direction, self.slots, self.slot_bytes)
            _count(self.flags, done)

    def wait_sends(self) -> None:
        pass  # ordered on the stream, as NCCL's

    def abort(self) -> None:
        """The peer is gone: its counters jump ahead, so the waits queued on
        this side's stream end (what they receive is whatever the ring
        holds) and later ones do not start. A one-program kernel on a
        stream of its own writes them, beside the waiting kernels (their
        grids are small: they leave room on the SMs)."""
        fields = self._abort_fields()
        if self._abort_stream is None:
            for field in fields:
                self.flags[field] = _AHEAD
            return
        _ahead(self.flags, *fields, self._abort_stream)

    def _abort_fields(self) -> tuple[int, int]:
        """What ``abort`` pushes ahead: the peer's posted count (this side's
        receives end) and its acked count of this side's sends."""
        return counter_index(1 - self.rank, False), counter_index(self.rank, True)


def pair_ipc(pair, rank: int, device) -> IpcChannel:
    """Over a paired host channel (``PairChannel``): rank 0 allocates the
    ring and sends its handles, rank 1 opens them."""
    if rank == 0:
        channel = IpcChannel.create(device)
        blob = torch.frombuffer(bytearray(channel.handles()), dtype=torch.uint8)
        pair.send(0, [blob])
        return channel
    _cmd, (blob,) = pair.recv()
    return IpcChannel.open(bytes(blob.numpy()))
