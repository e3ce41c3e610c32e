"""Rank 0's side of a drafter in another process (its own actor, or the
N:1 shared drafter): the channel the two talk over and the stand-in that
the engine calls as it would a local DrafterWorker."""

from __future__ import annotations

import dataclasses

import torch

from specray.actors.ipc_channel import IpcChannel, pair_ipc
from specray.actors.messages import CMD_ASYNC, CMD_CONTEXT, CMD_DRAFTS, CMD_PROPOSE, CMD_STOP, pack_draft_batch, unpack_draft_output
from specray.actors.pair_channel import PairChannel
from specray.actors.step_peers import CHAINED, FLUSH, JOINED, StepWord, encode_control
from specray.actors.transport import CupyNcclChannel, SplitChannel
from specray.plan import DraftBatch, DraftOutput


def drafter_channel(kind: str, rank_in_pair: int, device: torch.device, address: str, unique_id=None,
                    timeout_s: float | None = None) -> SplitChannel:
    """How rank 0 and a separate drafter talk: message headers (and on CPUs
    the tensors too, under another tag) over a gloo pair of their own
    (pair_channel.py: not the engine's process group, so a new drafter can
    pair again, and rank 0's waits have a timeout); between GPUs the
    tensors over NCCL via CuPy (``unique_id``), on one GPU through a CUDA
    IPC ring (ipc_channel.py)."""
    pair = PairChannel(address, rank_in_pair, timeout_s)
    if kind == "nccl":
        data = CupyNcclChannel(unique_id, rank_in_pair, device)
    elif kind == "ipc":  # one GPU: rank 0 hands its ring over the pair
        data = pair_ipc(pair.tagged(2), rank_in_pair, device)
    else:
        data = pair.tagged(0)
    return SplitChannel(pair.tagged(1), data)


class RemoteDrafter:
    """Rank 0's stand-in for a drafter that lives in another process."""

    # Sent only the accepted context rows: the channel carries no padding.
    stores_whole_blocks = False
    # The DraftBatch travels as host tensors (packed before sending).
    packs_host_batch = True

    # It replays its half of each step graph (step_peers.py) on rank 0's word.
    runs_step_graphs = True

    def __init__(self, channel, device):
        self.channel, self.device = channel, device
        self.tree = None  # the drafter's process loads its own universe
        # On rank 0's GPU, paired through the CUDA IPC ring (else NCCL, or gloo on CPUs).
        self.on_rank0_gpu = isinstance(getattr(channel, "data", None), IpcChannel)
        self._pending: dict[int, StepWord] = {}  # by lane: the last step replayed there, results not yet taken

    @property
    def step_link(self):
        """What rank 0's step graph exchanges the proposal and the results over."""
        return self.channel

    @property
    def data_abort(self):
        """Set where the tensors travel over NCCL (no timeout): rank 0 then
        bounds its waits for step results (step_wait.py)."""
        return getattr(self.channel, "data_abort", None)

    def async_step(self, word: StepWord, inputs: dict) -> None:
        """Before rank 0 replays a step graph: the drafter replays its half
        (which first takes the lane's previous step's results, if chained:
        unless the joining prompts' context store took them, JOINED)."""
        first = inputs.pop("join_first", None)
        if word.kind == CHAINED and first is not None and word.lane not in self._pending:
            word = dataclasses.replace(word, kind=JOINED)
        elif "after_prefill" in inputs:  # the last tokens are the prefill's, on the device: raw, no host copy
            first = inputs["last"].to(torch.int64)
            inputs = {k: v for k, v in inputs.items() if k != "last"}
        self.channel.control.send(CMD_ASYNC, encode_control(word, inputs))
        if first is not None:
            self.channel.send_raw([first])
        self._pending[word.lane] = word

    def begin_chain(self) -> None:
        """Before a chain's first steps: the drafter takes the last steps'
        results of every lane, in the order rank 0 sent them."""
        self._flush()

    def _flush(self) -> None:
        for lane in sorted(self._pending):
            w = self._pending[lane]
            self.channel.control.send(CMD_ASYNC, encode_control(StepWord(w.n, w.mode, w.tree, FLUSH, w.spec, lane),
                                                                {}))
        self._pending.clear()

    def propose(self, batch: DraftBatch) -> DraftOutput:
        self._flush()
        self.channel.send(CMD_PROPOSE, pack_draft_batch(batch))
        cmd, ts = self.channel.recv()
        assert cmd == CMD_DRAFTS, cmd
        return unpack_draft_output(ts)

    def store_context(self, hidden, positions, slot_mapping) -> None:
        self._flush()
        # positions and slots travel as one [2, n] tensor (one transfer fewer)
        self.channel.send(CMD_CONTEXT, [hidden, torch.stack([positions, slot_mapping.to(positions.device)])])

    def stop(self) -> None:
        self._flush()
        self.channel.control.send(CMD_STOP, [])
