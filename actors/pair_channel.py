"""Rank 0 <-> a drafter on its own CPU process, over a gloo group of their
own (a ``ProcessGroupGloo`` on a store of its own), not the engine's process
group: a drafter restarted in a new process pairs again without the TP
ranks, and every wait of rank 0 on the drafter has a timeout (a drafter that
stops answering is a ``DrafterTimeout``, not a hang; a dead one fails at
once, gloo closing the pair).

The messages are ``transport``'s: a header, then one transfer per tensor.
"""

from __future__ import annotations

import datetime
import os
import shutil
import tempfile
import uuid

import torch
import torch.distributed as dist

from specray.actors.transport import HEADER_LEN, decode_header, encode_header

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
    ``timeout_s`` bounds each send and receive (None: wait as long as it
    takes, what the drafter's serve loop wants)."""

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
        self.rank, self.peer = rank, 1 - rank
        self.timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else _IDLE
        self.pg = dist.ProcessGroupGloo(store, rank, 2, _IDLE)
        self.device = torch.device("cpu")

    def _send(self, t: torch.Tensor) -> None:
        self.pg.send([t], self.peer, 0).wait(self.timeout)

    def _recv(self, t: torch.Tensor) -> None:
        self.pg.recv([t], self.peer, 0).wait(self.timeout)

    def send(self, cmd: int, tensors: list[torch.Tensor]) -> None:
        self._send(encode_header(cmd, tensors))
        for t in tensors:
            if t.numel():
                self._send(t.detach().to("cpu").contiguous())

    def recv(self) -> tuple[int, list[torch.Tensor]]:
        header = torch.empty(HEADER_LEN, dtype=torch.int64)
        self._recv(header)
        cmd, specs = decode_header(header)
        out = []
        for dtype, shape in specs:
            t = torch.empty(shape, dtype=dtype)
            if t.numel():
                self._recv(t)
            out.append(t)
        return cmd, out

    def close(self) -> None:
        """Drop the pair's connections (a peer still waiting fails at once)."""
        self.pg = None
