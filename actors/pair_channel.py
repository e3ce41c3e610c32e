"""Rank 0 <-> a drafter on its own CPU process, over a gloo group of their
own (a ``ProcessGroupGloo`` on a store of its own), not the engine's process
group: a drafter restarted in a new process pairs again without the TP
ranks, and every wait of rank 0 on the drafter has a timeout (a drafter that
stops answering is a ``DrafterTimeout``, not a hang; a dead one fails at
once, gloo closing the pair).

The messages are ``transport``'s: a header, then one transfer per tensor.
"""

from __future__ import annotations

import copy
import datetime
import os
import shutil
import tempfile
import uuid

import torch
import torch.distributed as dist

from specray.actors.transport import HEADER_LEN, decode_header, encode_header, start_sends

# The drafter waits on rank 0 between requests for as long as the engine idles.
_IDLE = datetime.timedelta(days=365)


def pair_address(same_node: bool, host: str = "127.0.0.1", port: int | None = None,
                 directory: str | None = None) -> str:
    """Where the two ends meet: a file store on one node (nothing listens;
    in ``directory``, which its owner removes, or a directory of its own),
    else a TCP store on rank 0's ``host``:``port``."""
    if same_node:  # the directory is made where the channel is
        name = f"specray-pair-{uuid.uuid4().hex}"
        if directory is not None:
            return "file://" + os.path.join(directory, name)
        return "file://" + os.path.join(tempfile.gettempdir(), name, "store")
    return f"tcp://{host}:{port}"


def remove_address(address: str) -> None:
    """A pairing's file store (and its directory, when it has its own)."""
    if not address.startswith("file://"):
        return
    path = address[len("file://"):]
    if os.path.basename(path) == "store":
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    else:
        try:
            os.remove(path)
        except OSError:
            pass


class PairChannel:
    """``rank`` 0 is the target's rank 0 (its store's master), 1 the drafter.
    ``timeout_s`` bounds each receive and each wait on a send (None: wait as
    long as it takes, what the drafter's serve loop wants). The interface is
    ``transport.TorchP2PChannel``'s, so a ``SplitChannel`` carries headers
    over a pair (``tagged(1)``) and tensors over NCCL or the pair
    (``tagged(0)``)."""

    def __init__(self, address: str, rank: int, timeout_s: float | None = None):
        if address.startswith("file://"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # both ends on this node: loopback only
            path = address[len("file://"):]
            os.makedirs(os.path.dirname(path), exist_ok=True)
            store = dist.FileStore(path, 2)
        elif address.startswith("tcp://"):
            host, port = address[len("tcp://"):].rsplit(":", 1)
            store = dist.TCPStore(host, int(port), 2, rank == 0, timeout=datetime.timedelta(seconds=120))
        else:
            raise ValueError(f"pair address must be file:// or tcp://, got {address!r}")
        self.rank, self.peer, self.tag = rank, 1 - rank, 0
        self.timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else _IDLE
        self.pg = dist.ProcessGroupGloo(store, rank, 2, _IDLE)
        self.device = torch.device("cpu")
        self._pending: list = []  # sends in flight, and the tensors they read

    def tagged(self, tag: int) -> "PairChannel":
        """A view of the same pair whose messages carry ``tag``."""
        view = copy.copy(self)
        view.tag, view._pending = tag, []
        return view

    @property
    def control(self) -> "PairChannel":
        return self

    def send(self, cmd: int, tensors: list[torch.Tensor]) -> None:
        self.send_header(encode_header(cmd, tensors))
        self.send_raw(tensors)
        self.wait_sends()

    def send_header(self, header: torch.Tensor) -> None:
        self.pg.send([header], self.peer, self.tag).wait(self.timeout)

    def recv(self) -> tuple[int, list[torch.Tensor]]:
        cmd, out = self.recv_header()
        self.recv_raw(out)
        return cmd, out

    def recv_header(self) -> tuple[int, list[torch.Tensor]]:
        header = torch.empty(HEADER_LEN, dtype=torch.int64)
        self.pg.recv([header], self.peer, self.tag).wait(self.timeout)
        cmd, specs = decode_header(header)
        return cmd, [torch.empty(shape, dtype=dtype) for dtype, shape in specs]

    def send_raw(self, tensors: list[torch.Tensor]) -> None:
        """Not waited on (see ``TorchP2PChannel.send_raw``): the tensors of
        sends in flight are kept alive until they complete."""
        self._pending = start_sends(self._pending, [t.to("cpu") for t in tensors],
                                    lambda t: self.pg.send([t], self.peer, self.tag))

    def wait_sends(self) -> None:
        for work, _ in self._pending:
            work.wait(self.timeout)
        self._pending.clear()

    def recv_raw(self, out: list[torch.Tensor]) -> None:
        for t in out:
            if t.numel():
                self.pg.recv([t], self.peer, self.tag).wait(self.timeout)
