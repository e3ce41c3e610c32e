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
from specray.actors.remote_drafter import RemoteDrafter, drafter_channel
from specray.actors.target import TargetWorker, kv_capacity, resolve_device
from specray.actors.transport import (
    broadcast_message,
    nccl_unique_id,
    receive_broadcast,
    recv_message,
)
from specray.actors.step_parts import StepSettings
from specray.actors.step_peers import DrafterReplays, StepWord, TPLink
from specray.actors.step_peers import build_follower_graphs, decode_control, encode_control
from specray.actors.messages import (
    CMD_ASYNC,
    CMD_CONTEXT,
    CMD_DRAFTS,
    CMD_MOVE,
    CMD_PROPOSE,
    CMD_STEP,
    CMD_STOP,
    HOST_CMDS,
    pack_draft_output,
    pack_target_batch,
    unpack_draft_batch,
    unpack_target_batch,
)
from specray.config import DrafterSpec, EngineConfig, TargetSpec
from specray.draft_tree import load_universe
from specray.draft_tree import unsupported as tree_unsupported
from specray.engine_loop import freeze_startup_heap
from specray.output_wire import pack
from specray.plan import TargetBatch
from specray.priority import normal_priority

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
    """Join the engine's process group (the TP ranks; a separate drafter
    pairs with rank 0 apart: pair_channel.py) and return the TP subgroup."""
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    if init_method.startswith("file://"):
        # All ranks share this node: gloo's pairs listen on loopback only.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    return dist.new_group(list(range(tp_size)))


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


def load_drafter(actor, config: EngineConfig, max_model_len: int) -> None:
    """A drafter actor's device, specs, DrafterWorker and the settings of
    its halves of step graphs (``actor.device``, ``.target_spec``,
    ``.spec``, ``.worker``, ``.step_settings``)."""
    actor.device = resolve_device("cuda" if config.device != "cpu" else "cpu")
    cpu_threads(actor.device)
    actor.target_spec = TargetSpec.from_dir(config.target)
    actor.spec = DrafterSpec.from_dir(config.drafter)
    actor.worker = DrafterWorker(
        actor.spec, actor.target_spec, device=str(actor.device), dtype=config.resolved_dtype,
        max_model_len=max_model_len, draft_top_k=config.draft_top_k,
    )
    actor.step_settings = StepSettings.make(config, config.draft_block_size(actor.spec.block_size), max_model_len,
                                            actor.spec.mask_token_id)


def drafter_replays(actor, channel) -> DrafterReplays:
    """A drafter actor's (``load_drafter``) halves of step graphs,
    exchanging with one rank 0 over ``channel``."""
    width = len(actor.spec.target_layer_ids) * actor.target_spec.hidden_size
    return DrafterReplays(actor.worker, actor.step_settings, channel, width)


class DrafterActor:
    def __init__(self, config: EngineConfig, max_model_len: int):
        self.config = config
        load_drafter(self, config, max_model_len)
        self.channel = None
        self.num_steps = 0
        self._replays: DrafterReplays | None = None  # its halves of step graphs, made on first use

    def node_id(self) -> str:
        return node_id()

    def kv_capacity(self) -> int:
        return kv_capacity(self.config, [self.worker])

    def memory_cost(self) -> tuple[int, int]:
        """Its weights' bytes and a KV block's, for a rank 0 that sizes the
        pools of both on one GPU."""
        return self.worker.weight_bytes, self.worker.bytes_per_block(self.config.kv_block_size)

    def init_cache(self, num_blocks: int) -> None:
        block = self.config.draft_block_size(self.worker.spec.block_size)
        self.worker.init_cache(num_blocks, self.config.kv_block_size)
        if self.config.cuda_graphs:
            self.worker.enable_decode_graphs(self.config.max_num_seqs, self.config.kv_block_size, block)
        # Rank 0 decides which steps draft trees (its engine loads the same
        # universe); this side builds them.
        if self.config.draft_tree is not False and tree_unsupported(block, self.target_spec.layer_window) is None:
            self.worker.tree = load_universe(self.spec.path, block - 1).to(self.device)

    def connect(self, kind: str, address: str, unique_id=None) -> None:
        self.channel = drafter_channel(kind, 1, self.device, address, unique_id)

    @exit_on_failure
    def serve(self) -> int:
        """Serve rank 0 until it says stop; returns the steps served."""
        normal_priority()
        freeze_startup_heap()  # else a full collection walks the loaded heap while rank 0's steps wait
        while True:
            cmd, ts = recv_message(self.channel, HOST_CMDS)
            if cmd == CMD_STOP:
                return self.num_steps
            if cmd == CMD_CONTEXT:
                hidden, pos_slots = ts
                self.worker.store_context(hidden, pos_slots[0], pos_slots[1])
            elif cmd == CMD_PROPOSE:
                out = self.worker.propose(unpack_draft_batch(ts))
                self.channel.send(CMD_DRAFTS, pack_draft_output(out))
                self.num_steps += 1
            elif cmd == CMD_ASYNC:
                if self._replays is None:
                    self._replays = drafter_replays(self, self.channel)
                self.num_steps += self._replays.replay_message(ts)


# ------------------------------------------------------------- the target
class TPDriver:
    """Rank 0's view of the whole TP group: runs a batch locally after
    broadcasting it to the followers."""

    def __init__(self, worker: TargetWorker, group):
        self.worker, self.group = worker, group
        self.device = worker.device

    # The followers replay their halves of each step graph (step_peers.py).
    runs_step_graphs = True

    @property
    def followers(self) -> bool:
        return self.group is not None and self.worker.tp.size > 1

    @property
    def tp_link(self) -> TPLink | None:
        """What rank 0's step graph broadcasts the verify block over."""
        return TPLink(self.group) if self.followers else None

    def async_step(self, word: StepWord, inputs: dict) -> None:
        if self.followers:
            tables = {k: v for k, v in inputs.items() if k == "target_tables"}
            broadcast_message(CMD_ASYNC, encode_control(word, tables), self.group, "cpu")

    def execute(self, batch: TargetBatch):
        if self.followers:
            broadcast_message(CMD_STEP, pack_target_batch(batch), self.group, self.device)
        return self.worker.execute(batch)

    def hidden_rows(self, rows):
        return self.worker.hidden_rows(rows)

    def move_kv(self, src_slots, dst_slots) -> None:
        """A draft tree's accepted K/V, moved on every rank's shard."""
        if self.followers:
            broadcast_message(CMD_MOVE, [torch.stack([src_slots, dst_slots.to(src_slots.device)])], self.group,
                              self.device)
        self.worker.move_kv(src_slots, dst_slots)

    @property
    def local_model(self) -> bool:
        return self.worker.local_model

    def stop(self) -> None:
        if self.followers:
            broadcast_message(CMD_STOP, [], self.group, self.device)


class TargetRank:
    def __init__(self, config: EngineConfig, rank: int, tp_size: int, max_model_len: int):
        self.config = config
        self.rank, self.tp_size = rank, tp_size
        self.max_model_len = max_model_len
        self.device = resolve_device("cuda" if config.device != "cpu" else "cpu")
        cpu_threads(self.device)
        normal_priority()
        self.spec = TargetSpec.from_dir(config.target)
        self.drafter_spec = DrafterSpec.from_dir(config.drafter) if config.drafter else None
        self.tp_group = None
        self.worker: TargetWorker | None = None
        self.loop = None
        self.channel = None  # engine_channel.ChannelServer, opened by the first replica that asks
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

    def kv_capacity(self, with_local_drafter: bool = False, beside: tuple[int, int] | None = None) -> int:
        return kv_capacity(self.config, [self.worker] + ([self._local_drafter()] if with_local_drafter else []),
                           beside)

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
        graphs, shared = {}, {}
        block = self.config.draft_block_size(self.drafter_spec.block_size) if self.drafter_spec else 1
        settings = StepSettings.make(self.config, block, self.max_model_len, None)
        normal_priority()  # this loop's thread, started after __init__
        freeze_startup_heap()
        while True:
            cmd, ts = receive_broadcast(self.tp_group, self.device, host_cmds=HOST_CMDS)
            if cmd == CMD_STOP:
                return steps
            if cmd == CMD_MOVE:
                self.worker.move_kv(*ts[0])
                continue
            if cmd == CMD_ASYNC:
                w, inputs = decode_control(ts)
                key = (w.tree, w.spec, w.block, w.lane)
                if key not in graphs:
                    rows = (w.block or None) if w.spec else 1
                    graphs[key] = build_follower_graphs(self.worker, settings, w.tree, TPLink(self.tp_group),
                                                        shared.setdefault(w.lane, {}), rows=rows)
                with torch.inference_mode():
                    graphs[key].run(w.n, inputs)
            else:
                self.worker.execute(unpack_target_batch(ts))
            steps += 1

    # rank 0
    def start_engine(self, num_target_blocks: int, num_draft_blocks: int | None, drafter_mode: str,
                     channel_kind: str | None = None, unique_id=None, address: str | None = None,
                     drafter_handle=None, placement_group=None, drafter_bundle: int | None = None,
                     drafter_gpus: float = 1, shared: bool = False) -> None:
        """``drafter_handle`` (with the ``placement_group``, its bundle index
        and its share of a GPU): the separate drafter's actor, replaced when
        it is lost.
        ``shared``: the separate drafter serves other replicas too
        (shared_drafter.py); this one steps on without it once it is lost."""
        from specray.detokenizer import load_tokenizer
        from specray.engine import EngineCore
        from specray.engine_loop import EngineLoop

        normal_priority()  # the step thread starts from this one

        target = TPDriver(self.worker, self.tp_group)
        drafter = restart = None
        if drafter_mode == "colocated":
            drafter = self._local_drafter()
            drafter.init_cache(num_draft_blocks, self.config.kv_block_size)
            restart = LocalDrafterRestart(functools.partial(self._new_local_drafter, num_draft_blocks))
        elif drafter_mode == "separate":
            channel = drafter_channel(channel_kind, 0, self.device, address, unique_id,
                                      timeout_s=self.config.drafter_timeout_s)
            drafter = RemoteDrafter(channel, self.device)
            if drafter_handle is not None and not shared:
                restart = RemoteDrafterRestart(drafter_handle, self.config, self.max_model_len, num_draft_blocks,
                                               channel_kind, placement_group, drafter_bundle, self.device,
                                               address, drafter_gpus)
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

    def get_outputs(self, cursor: int = -1, timeout: float = 1.0, min_batch_s: float = 0.005) -> tuple[int, bytes]:
        """``EngineLoop.get_outputs``, packed (``output_wire``)."""
        self.calls["get_outputs"] += 1
        cursor, outs = self.loop.get_outputs(cursor, timeout, min_batch_s)
        return cursor, pack(outs)

    def open_channel(self, caller_node: str):
        """``(address, secret)`` of a socket to this loop (``engine_channel``)
        for a caller on this node; None for one elsewhere (it keeps to Ray
        calls)."""
        if caller_node != node_id() or self.loop is None:
            return None
        if self.channel is None:
            from specray.engine_channel import ChannelServer

            self.channel = ChannelServer(self.loop)
        return self.channel.address, self.channel.secret

    def stats(self) -> dict:
        return {**self.loop.stats(), "calls": dict(self.calls),
                "channel": dict(self.channel.counts) if self.channel is not None else None}

    def shutdown(self) -> None:
        if self.loop is not None:
            self.loop.stop()
            self.loop = None
        if self.channel is not None:
            self.channel.close()
            self.channel = None
