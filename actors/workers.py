"""The Ray actors of one engine, as plain classes (``ray.remote`` wraps them
at placement time, so this module does not import Ray).

* ``TargetRank``: one tensor-parallel rank. Rank 0 (the driver) owns the
  scheduler and steps the engine in a thread; every step it broadcasts the
  TargetBatch to the other ranks (followers), which run it in lockstep.
* ``DrafterActor``: the drafter and its context KV on its own device,
  serving propose / store-context messages from rank 0 over a Channel.

Per step nothing goes through Ray: the plan travels over the TP group
(gloo / NCCL), hidden states and drafts over the drafter channel.
"""

from __future__ import annotations

import functools
import os
import socket
import threading

import torch
import torch.distributed as dist

from specray.actors.drafter import DrafterWorker
from specray.actors.drafter_restart import LocalDrafterRestart, RemoteDrafterRestart
from specray.actors.models.layers import TPContext
from specray.actors.pair_channel import PairChannel
from specray.actors.target import TargetWorker, kv_capacity, resolve_device
from specray.actors.transport import (
    CupyNcclChannel,
    TorchP2PChannel,
    broadcast_message,
    nccl_unique_id,
    receive_broadcast,
)
from specray.config import DrafterSpec, EngineConfig, TargetSpec
from specray.plan import AttentionMetadata, DraftBatch, DraftOutput, TargetBatch
from specray.sampling import SamplingTensors

CMD_STOP, CMD_STEP, CMD_CONTEXT, CMD_PROPOSE, CMD_DRAFTS = 0, 1, 2, 3, 4
_EMPTY = torch.zeros(0)


# --------------------------------------------------------------- packing
# Messages carry few tensors: each one is a transfer of its own (and a host
# copy when it starts on the host), which costs more than its bytes.
def pack_target_batch(b: TargetBatch) -> list[torch.Tensor]:
    """Three tensors: per-token ids / positions / slots ``[3, N]``, the
    integer fields, and the block tables."""
    a = b.attn
    dev = b.input_ids.device  # on rank 0's device once the drafts are in
    per_token = torch.stack([b.input_ids, a.positions.to(dev), a.slot_mapping.to(dev)])
    meta = torch.tensor([a.max_query_len, a.max_seq_len, int(b.want_hidden)], dtype=torch.int64)
    ints = torch.cat([a.query_start_loc.cpu(), a.seq_lens.cpu(), b.logits_indices.cpu(), meta])  # [2S + 1 + M + 3]
    return [per_token, ints, a.block_tables]


def unpack_target_batch(ts: list[torch.Tensor]) -> TargetBatch:
    per_token, ints, tables = ts
    S = tables.shape[0]
    ids, pos, slots = per_token
    qsl, seq_lens, logit_idx = ints[: S + 1], ints[S + 1 : 2 * S + 1], ints[2 * S + 1 : -3]
    max_q, max_s, want_hidden = ints[-3:].tolist()
    return TargetBatch(ids, AttentionMetadata(pos, slots, qsl, seq_lens, tables, max_q, max_s), logit_idx,
                       bool(want_hidden))


def pack_draft_batch(b: DraftBatch) -> list[torch.Tensor]:
    """Four tensors: the draft blocks, the block tables, the integer fields
    (the float64 uniforms ride along as their bit patterns) and the sampling
    floats."""
    st = b.sampling
    W = st.uniforms.shape[-1]
    meta = torch.tensor([b.max_ctx_len, int(st.all_greedy), int(st.any_filter), W], dtype=torch.int64)
    uniform_bits = st.uniforms.cpu().reshape(-1).view(torch.int64)
    ints = torch.cat([b.ctx_lens.cpu(), b.block_lens.cpu(), st.top_k.cpu(), uniform_bits, meta])  # [3S + 3SW + 4]
    floats = torch.stack([st.temperature.cpu(), st.top_p.cpu()])  # [2, S]
    return [b.block_ids, b.block_tables, ints, floats]


def unpack_draft_batch(ts: list[torch.Tensor]) -> DraftBatch:
    block_ids, tables, ints, floats = ts
    S = block_ids.shape[0]
    max_ctx, all_greedy, any_filter, W = ints[-4:].tolist()
    ctx_lens, block_lens, top_k = ints[: 3 * S].view(3, S)
    uniforms = ints[3 * S : 3 * S + 3 * S * W].view(torch.float64).view(3, S, W)
    return DraftBatch(block_ids, ctx_lens, block_lens, tables, max_ctx,
                      SamplingTensors(floats[0], floats[1], top_k, uniforms, bool(all_greedy), bool(any_filter)))


def pack_draft_output(o: DraftOutput) -> list[torch.Tensor]:
    return [o.tokens, o.draft_idx if o.draft_idx is not None else _EMPTY,
            o.draft_q if o.draft_q is not None else _EMPTY]


def unpack_draft_output(ts: list[torch.Tensor]) -> DraftOutput:
    tokens, idx, q = ts
    return DraftOutput(tokens, idx if idx.numel() else None, q if q.numel() else None)


# ------------------------------------------------------- distributed set-up
def free_address() -> tuple[str, int]:
    """This node's address and a free TCP port for the rendezvous."""
    ip = os.environ.get("SPECRAY_NODE_IP")
    if ip is None:
        try:
            import ray

            ip = ray.util.get_node_ip_address()
        except Exception:
            ip = "127.0.0.1"
    with socket.socket() as s:
        s.bind((ip, 0))
        return ip, s.getsockname()[1]


def node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def init_distributed(init_method: str, rank: int, world_size: int, tp_size: int, device: torch.device):
    """Join the engine's process group (TP ranks 0..tp-1, then the drafter
    if it runs apart) and return the TP subgroup (None for the drafter)."""
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    if init_method.startswith("file://"):
        # All ranks share this node: gloo's pairs listen on loopback only.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    # new_group is collective over the whole world, drafter included.
    tp_group = dist.new_group(list(range(tp_size)))
    return tp_group if rank < tp_size else None


def cpu_threads(device: torch.device) -> None:
    """Ray caps an actor of num_cpus=1 at one OpenMP thread; a CPU worker's
    matmuls want the node's cores (the engine's processes take turns)."""
    if device.type == "cpu":
        torch.set_num_threads(int(os.environ.get("SPECRAY_CPU_THREADS", 0)) or os.cpu_count() or 1)


def exit_on_failure(serve):
    """A serve loop that raises ends its process: rank 0's pending broadcast /
    all-reduce / recv with it then fail at once (the connection closes)
    rather than after the group's timeout of 30 minutes, so rank 0 fails its
    requests. destroy_process_group() is not enough: the connections live as
    long as any reference to the group (the model's TP context holds one).
    The exit waits a moment, for Ray to return the loop's error and its
    traceback to whoever waits on the loop."""

    @functools.wraps(serve)
    def run(self):
        try:
            return serve(self)
        except BaseException:
            threading.Timer(2.0, os._exit, (1,)).start()
            raise

    return run


class _Channels:
    """How rank 0 and a separate drafter talk: NCCL via CuPy between GPUs,
    torch.distributed gloo between CPU processes."""

    @staticmethod
    def make(kind: str, rank_in_pair: int, device: torch.device, unique_id=None, peer: int | None = None,
             timeout_s: float | None = None):
        if kind == "nccl":
            return CupyNcclChannel(unique_id, rank_in_pair, device)
        if isinstance(unique_id, str):  # a rendezvous address: a gloo pair of their own (pair_channel.py)
            return PairChannel(unique_id, rank_in_pair, timeout_s)
        return TorchP2PChannel(peer, "cpu")


# ------------------------------------------------------------ the drafter
class RemoteDrafter:
    """Rank 0's stand-in for a drafter that lives in another process."""

    # Sent only the accepted context rows: the channel carries no padding.
    stores_whole_blocks = False
    # The DraftBatch travels as host tensors (packed before sending).
    packs_host_batch = True

    def __init__(self, channel, device):
        self.channel, self.device = channel, device

    def propose(self, batch: DraftBatch) -> DraftOutput:
        self.channel.send(CMD_PROPOSE, pack_draft_batch(batch))
        cmd, ts = self.channel.recv()
        assert cmd == CMD_DRAFTS, cmd
        return unpack_draft_output(ts)

    def store_context(self, hidden, positions, slot_mapping) -> None:
        # positions and slots travel as one [2, n] tensor (one transfer fewer)
        self.channel.send(CMD_CONTEXT, [hidden, torch.stack([positions, slot_mapping.to(positions.device)])])

    def stop(self) -> None:
        self.channel.send(CMD_STOP, [])


class DrafterActor:
    def __init__(self, config: EngineConfig, max_model_len: int):
        self.config = config
        self.device = resolve_device("cuda" if config.device != "cpu" else "cpu")
        cpu_threads(self.device)
        self.target_spec = TargetSpec.from_dir(config.target)
        self.spec = DrafterSpec.from_dir(config.drafter)
        self.worker = DrafterWorker(
            self.spec, self.target_spec, device=str(self.device), dtype=config.resolved_dtype,
            max_model_len=max_model_len, draft_top_k=config.draft_top_k,
        )
        self.channel = None
        self.num_steps = 0

    def init_distributed(self, init_method: str, rank: int, world_size: int, tp_size: int) -> None:
        init_distributed(init_method, rank, world_size, tp_size, self.device)

    def node_id(self) -> str:
        return node_id()

    def kv_capacity(self) -> int:
        return kv_capacity(self.config, [self.worker])

    def init_cache(self, num_blocks: int) -> None:
        self.worker.init_cache(num_blocks, self.config.kv_block_size)
        if self.config.cuda_graphs:
            self.worker.enable_decode_graphs(self.config.max_num_seqs, self.config.kv_block_size,
                                             self.config.draft_block_size(self.worker.spec.block_size))

    def connect(self, kind: str, unique_id=None, peer: int | None = None) -> None:
        self.channel = _Channels.make(kind, 1, self.device, unique_id, peer)

    @exit_on_failure
    def serve(self) -> int:
        """Serve rank 0 until it says stop; returns the steps served."""
        while True:
            cmd, ts = self.channel.recv()
            if cmd == CMD_STOP:
                return self.num_steps
            if cmd == CMD_CONTEXT:
                hidden, pos_slots = ts
                self.worker.store_context(hidden, pos_slots[0], pos_slots[1])
            elif cmd == CMD_PROPOSE:
                out = self.worker.propose(unpack_draft_batch(ts))
                self.channel.send(CMD_DRAFTS, pack_draft_output(out))
                self.num_steps += 1


# ------------------------------------------------------------- the target
class TPDriver:
    """Rank 0's view of the whole TP group: runs a batch locally after
    broadcasting it to the followers."""

    def __init__(self, worker: TargetWorker, group):
        self.worker, self.group = worker, group
        self.device = worker.device

    def execute(self, batch: TargetBatch):
        if self.group is not None and self.worker.tp.size > 1:
            broadcast_message(CMD_STEP, pack_target_batch(batch), self.group, self.device)
        return self.worker.execute(batch)

    def hidden_rows(self, rows):
        return self.worker.hidden_rows(rows)

    def move_kv(self, src_slots, dst_slots) -> None:
        # Draft trees run only where the model is local (TP 1): one worker holds the cache.
        self.worker.move_kv(src_slots, dst_slots)

    @property
    def local_model(self) -> bool:
        return self.worker.local_model

    def stop(self) -> None:
        if self.group is not None and self.worker.tp.size > 1:
            broadcast_message(CMD_STOP, [], self.group, self.device)


class TargetRank:
    def __init__(self, config: EngineConfig, rank: int, tp_size: int, max_model_len: int):
        self.config = config
        self.rank, self.tp_size = rank, tp_size
        self.max_model_len = max_model_len
        self.device = resolve_device("cuda" if config.device != "cpu" else "cpu")
        cpu_threads(self.device)
        self.spec = TargetSpec.from_dir(config.target)
        self.drafter_spec = DrafterSpec.from_dir(config.drafter) if config.drafter else None
        self.tp_group = None
        self.worker: TargetWorker | None = None
        self.loop = None
        self.calls = {"submit": 0, "abort": 0, "get_outputs": 0}

    def address(self) -> tuple[str, int]:
        return free_address()

    def node_id(self) -> str:
        return node_id()

    def init_distributed(self, init_method: str | None, world_size: int) -> None:
        if init_method is not None:
            self.tp_group = init_distributed(init_method, self.rank, world_size, self.tp_size, self.device)
        taps = self.drafter_spec.target_layer_ids if self.drafter_spec else ()
        self.worker = TargetWorker(
            self.spec, device=str(self.device), dtype=self.config.resolved_dtype,
            max_model_len=self.max_model_len, tap_layer_ids=taps,
            tp=TPContext(self.rank, self.tp_size, self.tp_group),
            block_size=self.drafter_spec.block_size if self.drafter_spec else 1,
        )

    def kv_capacity(self, with_local_drafter: bool = False) -> int:
        return kv_capacity(self.config, [self.worker] + ([self._local_drafter()] if with_local_drafter else []))

    def init_cache(self, num_blocks: int) -> None:
        self.worker.init_cache(num_blocks, self.config.kv_block_size)

    def _local_drafter(self) -> DrafterWorker:
        if getattr(self, "_drafter", None) is None:
            self._drafter = DrafterWorker(
                self.drafter_spec, self.spec, device=str(self.device), dtype=self.config.resolved_dtype,
                max_model_len=self.max_model_len, draft_top_k=self.config.draft_top_k,
            )
        return self._drafter

    def nccl_unique_id(self):
        return nccl_unique_id()

    # follower ranks
    @exit_on_failure
    def serve_follower(self) -> int:
        steps = 0
        while True:
            cmd, ts = receive_broadcast(self.tp_group, self.device)
            if cmd == CMD_STOP:
                return steps
            self.worker.execute(unpack_target_batch(ts))
            steps += 1

    # rank 0
    def start_engine(self, num_target_blocks: int, num_draft_blocks: int | None, drafter_mode: str,
                     channel_kind: str | None = None, unique_id=None, drafter_rank: int | None = None,
                     drafter_handle=None, placement_group=None, drafter_bundle: int | None = None) -> None:
        """``drafter_handle`` (with the ``placement_group`` and its bundle
        index): the separate drafter's actor, replaced when it is lost."""
        from specray.detokenizer import load_tokenizer
        from specray.engine import EngineCore
        from specray.engine_loop import EngineLoop

        target = TPDriver(self.worker, self.tp_group)
        drafter = restart = None
        if drafter_mode == "colocated":
            drafter = self._local_drafter()
            drafter.init_cache(num_draft_blocks, self.config.kv_block_size)
            restart = LocalDrafterRestart(functools.partial(self._new_local_drafter, num_draft_blocks))
        elif drafter_mode == "separate":
            channel = _Channels.make(channel_kind, 0, self.device, unique_id, drafter_rank,
                                     timeout_s=self.config.drafter_timeout_s)
            drafter = RemoteDrafter(channel, self.device)
            if drafter_handle is not None:
                restart = RemoteDrafterRestart(drafter_handle, self.config, self.max_model_len, num_draft_blocks,
                                               channel_kind, placement_group, drafter_bundle, self.device,
                                               unique_id if isinstance(unique_id, str) else None)
        core = EngineCore(
            self.config, self.spec, self.drafter_spec, target, drafter, load_tokenizer(self.config.target),
            self.max_model_len, num_target_blocks, num_draft_blocks,
        )
        if self.config.cuda_graphs and self.tp_size == 1:
            from specray.llm import enable_decode_graphs

            enable_decode_graphs(self.config, core.block_size, self.worker,
                                 drafter if drafter_mode == "colocated" else None,
                                 want_hidden=drafter is not None, tree=core.tree is not None)

        def on_stop():
            try:
                current = getattr(core.drafter, "inner", None)  # a lost one may have been replaced
                if isinstance(current, RemoteDrafter):
                    current.stop()
            finally:
                if restart is not None:
                    restart.close()
                target.stop()

        self.loop = EngineLoop(core, on_stop=on_stop, restart_drafter=restart,
                               restart_inline=drafter_mode == "colocated")

    def _new_local_drafter(self, num_draft_blocks: int) -> DrafterWorker:
        self._drafter = None  # the lost one's memory goes first
        drafter = self._local_drafter()
        drafter.init_cache(num_draft_blocks, self.config.kv_block_size)
        if self.config.cuda_graphs and self.tp_size == 1:
            drafter.enable_decode_graphs(self.config.max_num_seqs, self.config.kv_block_size,
                                         self.config.draft_block_size(drafter.spec.block_size))
        return drafter

    def submit(self, items):
        self.calls["submit"] += 1
        return self.loop.submit(items)

    def abort(self, request_ids):
        self.calls["abort"] += 1
        self.loop.abort(request_ids)

    def get_outputs(self, cursor: int = -1, timeout: float = 1.0, min_batch_s: float = 0.005):
        self.calls["get_outputs"] += 1
        return self.loop.get_outputs(cursor, timeout, min_batch_s)

    def stats(self) -> dict:
        return {**self.loop.stats(), "calls": dict(self.calls)}

    def shutdown(self) -> None:
        if self.loop is not None:
            self.loop.stop()
            self.loop = None
