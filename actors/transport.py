"""Channels between the workers of one engine.

A message is a command code plus a list of tensors. It travels as a small
fixed-size int64 header (command, then dtype and shape of every tensor)
followed by the tensors themselves, so the receiver allocates exactly what
arrives and no Python object is ever pickled on the hot path.

Implementations:

* ``InProcessChannel``: a pair of queues (tests, one-process engines);
* ``TorchP2PChannel``: ``torch.distributed`` send/recv between two ranks of a
  process group: gloo between CPU processes;
* ``CupyNcclChannel``: NCCL through CuPy between two GPUs (target rank 0 and
  a drafter on its own GPU). NCCL refuses two ranks on one device: a drafter
  colocated with rank 0 runs inside rank 0's process instead;
* ``SplitChannel``: headers over a host channel (gloo), tensors over NCCL, so
  that a receiver learns a message's shapes without waiting for its GPU.

``broadcast_message`` sends the same message from TP rank 0 to the other
ranks of the TP group (the step plan): the header as a host tensor (gloo,
even in a group whose CUDA tensors go over NCCL), the tensors on the device.

Host tensors bound for a GPU go through the reused pinned ring
(``staging.py``), so a sender never waits for its device's queue. The
``*_raw`` calls move tensors of shapes both ends know (no header): what a
step graph exchanges inside its replay.
"""

from __future__ import annotations

import queue
from typing import Protocol

import torch
import torch.distributed as dist

from specray.staging import host_to_device

HEADER_LEN = 128
_MAX_DIMS = 4
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool, torch.uint8]
_CODE = {d: i for i, d in enumerate(_DTYPES)}


def encode_header(cmd: int, tensors: list[torch.Tensor]) -> torch.Tensor:
    if 2 + (2 + _MAX_DIMS) * len(tensors) > HEADER_LEN:
        raise ValueError(f"too many tensors in one message ({len(tensors)})")
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[0], header[1] = cmd, len(tensors)
    i = 2
    for t in tensors:
        if t.dim() > _MAX_DIMS:
            raise ValueError(f"tensors of more than {_MAX_DIMS} dims do not travel ({tuple(t.shape)})")
        if t.dtype not in _CODE:
            raise ValueError(f"tensors of dtype {t.dtype} do not travel (one of {_DTYPES})")
        header[i], header[i + 1] = _CODE[t.dtype], t.dim()
        header[i + 2 : i + 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
        i += 2 + _MAX_DIMS
    return header


def decode_header(header: torch.Tensor) -> tuple[int, list[tuple[torch.dtype, tuple[int, ...]]]]:
    h = header.tolist()
    cmd, n = h[0], h[1]
    specs, i = [], 2
    for _ in range(n):
        dtype, ndim = _DTYPES[h[i]], h[i + 1]
        specs.append((dtype, tuple(h[i + 2 : i + 2 + ndim])))
        i += 2 + _MAX_DIMS
    return cmd, specs


class Channel(Protocol):
    def send(self, cmd: int, tensors: list[torch.Tensor]) -> None: ...

    def recv(self) -> tuple[int, list[torch.Tensor]]: ...


class InProcessChannel:
    """One end of an in-process pair; ``pair()`` makes both ends."""

    def __init__(self, inbox: queue.Queue, outbox: queue.Queue):
        self._in, self._out = inbox, outbox

    @staticmethod
    def pair() -> tuple["InProcessChannel", "InProcessChannel"]:
        a, b = queue.Queue(), queue.Queue()
        return InProcessChannel(a, b), InProcessChannel(b, a)

    def send(self, cmd: int, tensors: list[torch.Tensor]) -> None:
        self._out.put((cmd, [t.clone() for t in tensors]))

    def recv(self) -> tuple[int, list[torch.Tensor]]:
        return self._in.get()


def _staged(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    t = host_to_device(t, device) if t.device != device else t
    return t.contiguous()


def start_sends(pending: list, tensors: list[torch.Tensor], isend) -> list:
    """Start a send of a copy of each tensor, not waited on; the sends still
    in flight (work, the copy it reads) of ``pending`` and these."""
    pending = [(w, t) for w, t in pending if not w.is_completed()]
    for t in tensors:
        if t.numel():
            t = t.detach().clone(memory_format=torch.contiguous_format)
            pending.append((isend(t), t))
    return pending


class TorchP2PChannel:
    """send/recv with ``peer`` over a torch.distributed group: gloo between
    CPU processes (``device`` cpu), or the host half of a SplitChannel."""

    def __init__(self, peer: int, device: torch.device | str = "cpu", group=None, tag: int = 0):
        self.peer, self.device, self.group, self.tag = peer, torch.device(device), group, tag
        self._pending: list = []  # raw sends in flight, and the tensors they read

    @property
    def control(self) -> "TorchP2PChannel":
        """Where messages of host tensors only travel (control messages)."""
        return self

    def send(self, cmd: int, tensors: list[torch.Tensor]) -> None:
        self.send_header(encode_header(cmd, tensors))
        self.send_raw(tensors)

    def send_header(self, header: torch.Tensor) -> None:
        dist.send(header, self.peer, group=self.group, tag=self.tag)

    def recv(self) -> tuple[int, list[torch.Tensor]]:
        cmd, out = self.recv_header()
        self.recv_raw(out)
        return cmd, out

    def recv_header(self) -> tuple[int, list[torch.Tensor]]:
        """The command and empty tensors of the shapes that follow."""
        header = torch.empty(HEADER_LEN, dtype=torch.int64)
        dist.recv(header, self.peer, group=self.group, tag=self.tag)
        cmd, specs = decode_header(header)
        return cmd, [torch.empty(shape, dtype=dtype, device=self.device) for dtype, shape in specs]

    def send_raw(self, tensors: list[torch.Tensor]) -> None:
        """Asynchronous: two replays of step graphs may each send before the
        peer receives (micro-batches), and a gloo send completes only once
        the peer receives it, so a blocking send could wait on a receive
        queued behind it. The tensors of sends in flight are kept alive."""
        self._pending = start_sends(self._pending, [_staged(t, self.device) for t in tensors],
                                    lambda t: dist.isend(t, self.peer, group=self.group, tag=self.tag))

    def wait_sends(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()

    def recv_raw(self, out: list[torch.Tensor]) -> None:
        for t in out:
            if t.numel():
                dist.recv(t, self.peer, group=self.group, tag=self.tag)


class CupyNcclChannel:
    """Point-to-point NCCL between two GPUs through CuPy. Both ends build it
    with the same ``unique_id`` (from ``nccl_unique_id()`` on one side,
    passed through Ray at set-up); rank 0 is the target, rank 1 the drafter.
    Send/recv are issued on the current torch stream, so they order with the
    kernels around them without host syncs."""

    _NCCL_DTYPE = {
        torch.float32: "NCCL_FLOAT32",
        torch.bfloat16: "NCCL_BFLOAT16",
        torch.float16: "NCCL_FLOAT16",
        torch.int64: "NCCL_INT64",
        torch.int32: "NCCL_INT32",
        torch.uint8: "NCCL_UINT8",
        torch.bool: "NCCL_UINT8",
    }

    def __init__(self, unique_id, rank: int, device: torch.device):
        from cupy.cuda import nccl

        self._nccl = nccl
        self.device = torch.device(device)
        self.peer = 1 - rank
        with torch.cuda.device(self.device):
            self.comm = nccl.NcclCommunicator(2, unique_id, rank)

    def _stream(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream

    def _dtype(self, dtype):
        return getattr(self._nccl, self._NCCL_DTYPE[dtype])

    def send(self, cmd: int, tensors: list[torch.Tensor]) -> None:
        self.send_raw([encode_header(cmd, tensors)] + tensors)

    def recv(self) -> tuple[int, list[torch.Tensor]]:
        header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
        self.recv_raw([header])
        cmd, specs = decode_header(header.cpu())  # a sync: shapes decide allocation (SplitChannel avoids it)
        out = [torch.empty(shape, dtype=dtype, device=self.device) for dtype, shape in specs]
        self.recv_raw(out)
        return cmd, out

    def send_raw(self, tensors: list[torch.Tensor]) -> None:
        msgs = [_staged(t, self.device) for t in tensors if t.numel()]
        self._nccl.groupStart()
        for t in msgs:
            self.comm.send(t.data_ptr(), t.numel(), self._dtype(t.dtype), self.peer, self._stream())
        self._nccl.groupEnd()
        self._keepalive = msgs  # the buffers must outlive the queued sends

    def recv_raw(self, out: list[torch.Tensor]) -> None:
        self._nccl.groupStart()
        for t in out:
            if t.numel():
                self.comm.recv(t.data_ptr(), t.numel(), self._dtype(t.dtype), self.peer, self._stream())
        self._nccl.groupEnd()

    def wait_sends(self) -> None:
        pass  # NCCL sends are ordered on the stream

    def abort(self) -> None:
        """End the communicator with its operations in flight: queued sends
        and receives return (received buffers hold whatever was there), so
        a stream waiting on a peer that is gone moves on. NCCL's waits have
        no timeout; rank 0 calls this past its own (step_wait.py). The
        channel is unusable afterwards."""
        if self.comm is not None:
            comm, self.comm = self.comm, None
            comm.abort()


class SplitChannel:
    """A message's header over ``host`` (a TorchP2PChannel of CPU tensors),
    its tensors over ``device`` (NCCL; between CPU processes, gloo under
    another tag): the receiver allocates without a device sync, nothing on
    either side waits for the GPU, and control messages (host tensors only,
    over ``host``) never queue behind the tensors step graphs exchange."""

    def __init__(self, host: TorchP2PChannel, device: "CupyNcclChannel | TorchP2PChannel"):
        self.host, self.data = host, device
        self.device = device.device

    @property
    def control(self) -> TorchP2PChannel:
        return self.host

    @property
    def data_abort(self):
        """Where the tensors travel over NCCL, which has no timeout: what
        ends its operations in flight; None over gloo (its waits time out)."""
        return getattr(self.data, "abort", None)

    def recv_header(self) -> tuple[int, list[torch.Tensor]]:
        return self.host.recv_header()

    def send(self, cmd: int, tensors: list[torch.Tensor]) -> None:
        self.host.send_header(encode_header(cmd, tensors))
        self.data.send_raw(tensors)

    def recv(self) -> tuple[int, list[torch.Tensor]]:
        return recv_message(self, ())

    def send_raw(self, tensors: list[torch.Tensor]) -> None:
        self.data.send_raw(tensors)

    def recv_raw(self, out: list[torch.Tensor]) -> None:
        self.data.recv_raw(out)

    def wait_sends(self) -> None:
        self.data.wait_sends()


def recv_message(channel, host_cmds) -> tuple[int, list[torch.Tensor]]:
    """The next message on ``channel`` (a TorchP2PChannel or SplitChannel),
    whose header arrives over the host: a command in ``host_cmds`` was sent
    over ``channel.control`` (host tensors), any other over ``channel``."""
    cmd, out = channel.control.recv_header()
    if cmd in host_cmds:
        channel.control.recv_raw(out)
    else:
        out = [torch.empty(t.shape, dtype=t.dtype, device=channel.device) for t in out]
        channel.recv_raw(out)
    return cmd, out


def nccl_unique_id():
    from cupy.cuda import nccl

    return nccl.get_unique_id()


def broadcast_message(cmd: int, tensors: list[torch.Tensor], group, device, src: int = 0) -> None:
    """Rank ``src`` of ``group`` sends a message to every other rank. The
    header is a host tensor: in a group of backend "cpu:gloo,cuda:nccl" it
    goes over gloo, and the receivers read it without a device sync."""
    device = torch.device(device)
    dist.broadcast(encode_header(cmd, tensors), src=src, group=group)
    for t in tensors:
        if t.numel():
            dist.broadcast(_staged(t, device), src=src, group=group)


def receive_broadcast(group, device, src: int = 0, host_cmds=()) -> tuple[int, list[torch.Tensor]]:
    """A broadcast message; one whose command is in ``host_cmds`` was sent
    as host tensors (``broadcast_message(..., device="cpu")``)."""
    header = torch.empty(HEADER_LEN, dtype=torch.int64)
    dist.broadcast(header, src=src, group=group)
    cmd, specs = decode_header(header)
    if cmd in host_cmds:
        device = "cpu"
    out = []
    for dtype, shape in specs:
        t = torch.empty(shape, dtype=dtype, device=device)
        if t.numel():
            dist.broadcast(t, src=src, group=group)
        out.append(t)
    return cmd, out
