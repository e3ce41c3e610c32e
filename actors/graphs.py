"""CUDA-graph capture of the decode step.

A decode step's shapes depend only on the number of sequences once every
sequence gets the same number of rows (a verify block of ``q_len``, padded).
``DecodeGraphs`` keeps static input buffers sized for ``max_seqs``, pads a
batch to the next captured size (dummy sequences point at the reserved block
0), and replays the graph captured for that size; each size is captured on
first use. Off CUDA the same padded, static-shaped call runs eagerly, which
is how the CPU tests check the padding logic.

The kernels read lengths, tables and positions from device memory and the
grid depends only on these static sizes, so replaying with new contents is
exact (tests/test_kernels.py captures and replays them).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import torch

from specray.staging import STAGING

_warm = threading.local()


def warming() -> bool:
    """Whether this thread runs a capture's warm-up calls. Exchanges with
    peers (a drafter or TP followers in other processes) skip them: each
    side captures a step kind on its own first use, rank 0's graphs are
    keyed by fewer kinds than a separate drafter's, so warm-up exchanges
    would not pair up, and a later replay would take a warm-up's message."""
    return getattr(_warm, "on", False)


@contextlib.contextmanager
def warming_up():
    """This thread runs warm-up calls (``warming``) while inside."""
    _warm.on = True
    try:
        yield
    finally:
        _warm.on = False


def peer_send(channel, tensors: list[torch.Tensor]) -> None:
    """``channel.send_raw`` inside a step graph (nothing while warming)."""
    if not warming():
        channel.send_raw(tensors)


def peer_recv(channel, out: list[torch.Tensor], placeholder: Callable | None = None) -> None:
    """``channel.recv_raw`` inside a step graph; while warming the buffers
    are zeros, then ``placeholder(out)`` where zeros are not a valid
    message (a draft tree's depths start at 1): the warm-up's kernels must
    index in bounds."""
    if warming():
        for t in out:
            t.zero_()
        if placeholder is not None:
            placeholder(out)
    else:
        channel.recv_raw(out)


_CAPTURE_STREAMS: dict[tuple, torch.cuda.Stream] = {}


def capture_stream(device: torch.device, family) -> torch.cuda.Stream:
    """The stream a family of graphs is warmed up and captured on. cuBLAS
    keeps a workspace per stream and a graph holds the one of the stream it
    was captured on (PyTorch captures every graph on one stream unless told
    otherwise): graphs that may replay at the same time (two lanes' steps)
    must come from different streams, or their GEMMs share a workspace; and
    recent PyTorch frees a stream's workspace when a graph captured on it
    is destroyed (pytorch/pytorch issue 193402), so graphs that are dropped
    (rank 0's step graphs, with a lost drafter) must not share a stream
    with graphs that stay (the target's)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, family)
    if key not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[key] = torch.cuda.Stream(device)
    return _CAPTURE_STREAMS[key]


def capture_sizes(max_seqs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256) if s < max_seqs]
    return sizes + [max_seqs]


def padded_size(n: int, max_seqs: int) -> int:
    """The captured batch size a batch of ``n`` sequences runs at."""
    return next(s for s in capture_sizes(max_seqs) if s >= n)


class DecodeGraphs:
    """Static buffers + one graph per padded batch size.

    ``buffers`` maps a name to a tensor whose first dimension is
    ``max_seqs * rows_per_seq[name]``; ``pad`` gives the value padded rows
    take (a tensor broadcast over the padded rows, a scalar, or None: left
    as they are, for rows whose values ``fn`` never lets count). ``fn(n)``
    runs the model on the first ``n`` sequences of the buffers and returns
    its outputs. ``keep``: tensors besides the buffers that ``fn`` updates
    (state a step hands the next one), which a capture's warm-up calls
    give back as they were, as they do the buffers."""

    def __init__(
        self,
        fn: Callable[[int], tuple],
        buffers: dict[str, torch.Tensor],
        rows_per_seq: dict[str, int],
        pad: dict[str, object],
        max_seqs: int,
        device: torch.device,
        keep: tuple[torch.Tensor, ...] = (),
        family: object = "static",
    ):
        self.fn = fn
        self.family = family  # capture_stream's: which graphs may share a stream
        self.buffers = buffers
        self.keep = keep
        self.rows = rows_per_seq
        self.pad = pad
        self.max_seqs = max_seqs
        self.sizes = capture_sizes(max_seqs)
        self.use_graphs = device.type == "cuda"
        self.device = device
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple] = {}
        self.pool = None

    def padded(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)

    def run(self, n: int, inputs: dict[str, torch.Tensor]) -> tuple:
        """Copy the inputs of ``n`` sequences in (host tensors through pinned
        staging), pad, run; outputs cover the padded size (callers read
        their first rows). An input may hold fewer than ``n * rows_per_seq``
        rows: the rest are padded."""
        size = self.padded(n)
        with STAGING.session(self.device) as stage:
            for name, src in inputs.items():
                if self.use_graphs and src.device.type == "cpu":
                    src = stage(src)  # pinned: the copy does not wait for the device
                buf, r = self.buffers[name], self.rows[name]
                dst = buf[: n * r]
                if src.shape[0] < dst.shape[0]:  # the last sequence's missing rows are padding
                    self._fill(name, buf[src.shape[0] : n * r])
                    dst = dst[: src.shape[0]]
                if dst.dim() == 2 and src.shape[1] < dst.shape[1]:
                    dst[:, : src.shape[1]].copy_(src, non_blocking=True)
                    dst[:, src.shape[1] :].zero_()
                else:
                    dst.copy_(src, non_blocking=True)
                if size > n:
                    self._fill(name, buf[n * r : size * r])
        if not self.use_graphs:
            return self.fn(size)
        if size not in self.graphs:
            self._capture(size)
        self.graphs[size].replay()
        return self.outputs[size]

    def capture_all(self) -> None:
        """Capture every padded size not captured yet (off CUDA: nothing)."""
        if self.use_graphs:
            for size in self.sizes:
                if size not in self.graphs:
                    self._capture(size)

    def _fill(self, name: str, tail: torch.Tensor) -> None:
        pad = self.pad[name]
        if pad is None:
            return
        if isinstance(pad, torch.Tensor):
            tail.copy_(pad[: tail.shape[0]])
        else:
            tail.fill_(pad)

    def warm_up(self, size: int) -> None:
        """``fn``'s two warm-up calls before a capture (Triton compiles, the
        allocator settles), exchanging nothing with peers (``warming``).
        A function that updates its own buffers (the step graph's next
        inputs) or ``keep`` gets them back as they were.

        The calls run on padding rows only (block 0): they execute, and a
        capture may come before its first inputs (``capture_all``), when
        the buffers still hold the last chain's rows, whose blocks other
        requests' prompts may hold by now (they wrote the target's and the
        drafter's K/V there: on the H100 a sampled generate after a greedy
        one drew other samples than a fresh engine). Buffers padded with
        None are neither filled nor saved: their rows count only where a
        live row points (the token history, shared by lanes that may be
        running meanwhile; a store's hidden rows), and padding rows point
        at none of them."""
        padded = [buf for name, buf in self.buffers.items() if self.pad[name] is not None]
        saved = [t.clone() for t in (*padded, *self.keep)]
        for name, buf in self.buffers.items():
            self._fill(name, buf)
        with warming_up():
            for _ in range(2):
                self.fn(size)
        for t, was in zip((*padded, *self.keep), saved):
            t.copy_(was)

    def _capture(self, size: int) -> None:
        # Warm up on the family's stream, then capture there; all sizes share one memory pool.
        stream = capture_stream(self.device, self.family)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self.warm_up(size)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=stream):
            self.outputs[size] = self.fn(size)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[size] = graph
