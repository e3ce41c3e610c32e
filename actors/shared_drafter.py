"""One drafter serving several target replicas (N:1).

``SharedDrafterActor`` holds one ``DrafterWorker`` whose context pool is
partitioned: replica ``r`` owns blocks ``[r * P, (r + 1) * P)`` of it (``P``
blocks a replica). Each replica's rank 0 runs its own scheduler over a pool
of ``P`` blocks, exactly as with a drafter of its own, and talks to the
actor over a gloo pair of its own; the actor adds the replica's base to the
block tables and slots it receives, so the replicas' context stores never
meet (a replica's reserved block 0 becomes its own block ``r * P``).

Each pair is served by a thread of its own (a Ray call per replica, the
actor being threaded), so a replica that idles never holds up the others.
A propose is queued and the first thread to take the model's lock runs
every proposal queued by then as one batched propose (``merge`` /
``split``): while one batch runs the others' requests gather for the next.
Only proposals that a single batch would compute alike are merged (same
block width, tree or not, the same sampling kind; ``merge_key``), so each
replica's drafts are what a drafter of its own gives it.

Asynchronous steps: each replica's halves of its step graphs
(``step_peers.DrafterReplays``: the mirrored state of that replica's
engine) are the replica's own, replayed under the model's lock with its
draft block tables moved to its partition. Those replays are not merged
across replicas: a step graph exchanges with one rank 0 inside its replay.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from specray.actors.messages import (
    CMD_ASYNC,
    CMD_CONTEXT,
    CMD_DRAFTS,
    CMD_PROPOSE,
    CMD_STOP,
    HOST_CMDS,
    pack_draft_output,
    unpack_draft_batch,
)
from specray.actors.step_peers import DrafterReplays
from specray.actors.target import kv_capacity
from specray.actors.transport import recv_message
from specray.actors.remote_drafter import drafter_channel
from specray.actors.workers import drafter_replays, load_drafter, node_id
from specray.config import EngineConfig
from specray.priority import normal_priority
from specray.draft_tree import DraftTree
from specray.plan import DraftBatch, DraftOutput
from specray.sampling import SamplingTensors

log = logging.getLogger("specray.shared_drafter")

# A replica that proposed within this many seconds is expected to again soon.
ACTIVE_S = 1.0


# ------------------------------------------------------- batches of replicas
def offset_batch(batch: DraftBatch, base_block: int) -> DraftBatch:
    """The replica's block tables in the shared pool (its blocks start at
    ``base_block``)."""
    if base_block == 0:
        return batch
    tables = batch.block_tables + base_block
    return DraftBatch(batch.block_ids, batch.ctx_lens, batch.block_lens, tables, batch.max_ctx_len, batch.sampling,
                      batch.tree, batch.tree_lookup, batch.tree_has_lookup)


def merge_key(batch: DraftBatch) -> tuple:
    """Proposals with equal keys run as one batch with the same results per
    row: every part of a propose is row-wise once these agree (the sampled
    path returns a sparse q even for greedy rows, filtering renormalises)."""
    st = batch.sampling
    lookup = None if batch.tree_lookup is None else batch.tree_lookup.shape[1]
    return (batch.block_ids.shape[1], batch.tree, lookup, st.all_greedy, st.any_filter, st.uniforms.shape[-1])


def _pad_cols(t: torch.Tensor, width: int) -> torch.Tensor:
    return t if t.shape[1] == width else torch.nn.functional.pad(t, (0, width - t.shape[1]))


def merge(batches: list[DraftBatch]) -> DraftBatch:
    """One DraftBatch of the rows of ``batches`` (all of one ``merge_key``),
    in order; block tables padded to the widest (padding is never read:
    each row reads ``ctx_lens`` positions)."""
    if len(batches) == 1:
        return batches[0]
    width = max(b.block_tables.shape[1] for b in batches)
    sts = [b.sampling for b in batches]
    st = SamplingTensors(
        torch.cat([s.temperature for s in sts]), torch.cat([s.top_p for s in sts]), torch.cat([s.top_k for s in sts]),
        torch.cat([s.uniforms for s in sts], 1), sts[0].all_greedy, sts[0].any_filter,
    )
    lookup = has = None
    if batches[0].tree_lookup is not None:
        lookup = torch.cat([b.tree_lookup for b in batches])
        has = torch.cat([b.tree_has_lookup for b in batches])
    return DraftBatch(
        torch.cat([b.block_ids for b in batches]), torch.cat([b.ctx_lens for b in batches]),
        torch.cat([b.block_lens for b in batches]), torch.cat([_pad_cols(b.block_tables, width) for b in batches]),
        max(b.max_ctx_len for b in batches), st, batches[0].tree, lookup, has,
    )


def _rows(t: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    return None if t is None else t[rows]


def split(out: DraftOutput, sizes: list[int]) -> list[DraftOutput]:
    """The rows of a merged propose's output, back per replica."""
    if len(sizes) == 1:
        return [out]
    parts, start = [], 0
    for n in sizes:
        rows = slice(start, start + n)
        tree = None if out.tree is None else DraftTree(out.tree.parent[rows], out.tree.depth[rows],
                                                        out.tree.masks[rows])
        parts.append(DraftOutput(out.tokens[rows], _rows(out.draft_idx, rows), _rows(out.draft_q, rows), tree))
        start += n
    return parts


@dataclass(eq=False)  # found in the queue by identity
class _Proposal:
    key: tuple
    batch: DraftBatch
    done: threading.Event = field(default_factory=threading.Event)
    out: DraftOutput | None = None
    error: BaseException | None = None


class ProposeBatcher:
    """Proposals from several threads, run in batches by whichever thread
    holds the model's lock next: a batch is what gathered while the last
    one ran. Replicas whose proposals arrive one after the other (two
    replicas in turn, each verifying while the drafter serves the other)
    never gather that way; ``gather_s`` > 0 lets a proposal wait up to
    that long (not holding the model) until the other live replicas' have
    arrived (``expected()`` in all: the replicas proposing lately),
    trading that wait for a shared propose."""

    def __init__(self, propose, model_lock: threading.Lock, gather_s: float = 0.0, expected=lambda: 1):
        self.propose, self.model_lock = propose, model_lock
        self.gather_s, self.expected = gather_s, expected
        self._queue: list[_Proposal] = []
        self._arrived = threading.Condition()
        self.batches = 0  # proposes run
        self.merged = 0  # proposals that shared a propose with another replica's

    def __call__(self, batch: DraftBatch) -> DraftOutput:
        mine = _Proposal(merge_key(batch), batch)
        with self._arrived:
            self._queue.append(mine)
            self._arrived.notify_all()
            # Not holding the model: the others' context stores go on meanwhile.
            end = time.monotonic() + self.gather_s
            while (mine in self._queue and len(self._queue) < self.expected()
                   and (left := end - time.monotonic()) > 0):
                self._arrived.wait(left)
        with self.model_lock:
            if not mine.done.is_set():
                with self._arrived:
                    queued, self._queue = self._queue, []
                    self._arrived.notify_all()
                groups: dict[tuple, list[_Proposal]] = {}
                for p in queued:
                    groups.setdefault(p.key, []).append(p)
                for group in groups.values():
                    self._run(group)
        if mine.error is not None:
            raise mine.error
        return mine.out

    def _run(self, group: list[_Proposal]) -> None:
        try:
            outs = split(self.propose(merge([p.batch for p in group])), [p.batch.block_ids.shape[0] for p in group])
        except BaseException as e:  # every replica of the batch sees the error
            for p in group:
                p.error = e
                p.done.set()
            return
        self.batches += 1
        self.merged += len(group) if len(group) > 1 else 0
        for p, o in zip(group, outs):
            p.out = o
            p.done.set()


# ------------------------------------------------------------------ the actor
class SharedDrafterActor:
    def __init__(self, config: EngineConfig, max_model_len: int, num_replicas: int, gather_s: float = 0.0):
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        self.config, self.num_replicas = config, num_replicas
        load_drafter(self, config, max_model_len)
        self.blocks_per_replica = 0
        self.channels: list = [None] * num_replicas
        self.last_propose = [float("-inf")] * num_replicas  # monotonic time of each replica's last proposal
        self.steps = [0] * num_replicas
        self.model_lock = threading.Lock()
        self.batcher = ProposeBatcher(self.worker.propose, self.model_lock, gather_s,
                                      self._active)
        self.replays: list[DrafterReplays | None] = [None] * num_replicas

    def _active(self) -> int:
        """Replicas worth waiting for: connected, and proposing lately (an
        idle replica must not cost the others ``gather_s`` a step)."""
        now = time.monotonic()
        return max(1, sum(c is not None and now - t < ACTIVE_S for c, t in zip(self.channels, self.last_propose)))

    def node_id(self) -> str:
        return node_id()

    def kv_capacity(self) -> int:
        """Blocks the whole pool may hold (split among the replicas)."""
        return kv_capacity(self.config, [self.worker])

    def init_cache(self, blocks_per_replica: int) -> None:
        from specray.draft_tree import load_universe
        from specray.draft_tree import unsupported as tree_unsupported

        self.blocks_per_replica = blocks_per_replica
        block = self.config.draft_block_size(self.spec.block_size)
        self.worker.init_cache(blocks_per_replica * self.num_replicas, self.config.kv_block_size)
        if self.config.cuda_graphs:
            # One batched propose may hold every replica's rows.
            self.worker.enable_decode_graphs(self.config.max_num_seqs * self.num_replicas, self.config.kv_block_size,
                                             block)
        if self.config.draft_tree is not False and tree_unsupported(block, self.target_spec.layer_window) is None:
            self.worker.tree = load_universe(self.spec.path, block - 1).to(self.device)

    def connect(self, replica: int, kind: str, address: str, unique_id=None) -> None:
        """Pair with ``replica``'s rank 0 (again, after its group was
        rebuilt: the old pair is dropped)."""
        if not 0 <= replica < self.num_replicas:
            raise ValueError(f"replica {replica} of a drafter serving {self.num_replicas}")
        self.channels[replica] = drafter_channel(kind, 1, self.device, address, unique_id)
        self.replays[replica] = None  # a rebuilt group's engine starts its step graphs afresh

    def serve_replica(self, replica: int) -> int:
        """Serve ``replica``'s rank 0 until it says stop; returns the
        proposals served. An error ends this replica's loop only (its rank 0
        finds the pair closed or times out, and steps without a drafter):
        the other replicas keep their drafter."""
        normal_priority()
        channel = self.channels[replica]
        base = replica * self.blocks_per_replica
        base_slot = base * self.config.kv_block_size
        try:
            while True:
                cmd, ts = recv_message(channel, HOST_CMDS)
                if cmd == CMD_STOP:
                    return self.steps[replica]
                if cmd == CMD_CONTEXT:
                    hidden, pos_slots = ts
                    with self.model_lock, torch.inference_mode():
                        self.worker.store_context(hidden, pos_slots[0], pos_slots[1] + base_slot)
                elif cmd == CMD_PROPOSE:
                    self.last_propose[replica] = time.monotonic()
                    out = self.batcher(offset_batch(unpack_draft_batch(ts), base))
                    channel.send(CMD_DRAFTS, pack_draft_output(out))
                    self.steps[replica] += 1
                elif cmd == CMD_ASYNC:
                    self._replay(replica, channel, base, ts)
                else:
                    raise RuntimeError(f"command {cmd} is not a drafter's")
        except BaseException:
            log.exception("the drafter's loop of replica %d failed", replica)
            raise
        finally:
            if self.channels[replica] is channel:
                self.channels[replica] = None  # its pair closes with the last reference

    def _replay(self, replica: int, channel, base: int, ts) -> None:
        """A replay of ``replica``'s step graphs, its draft block tables
        moved into its partition (the graphs derive every slot from them)."""
        if self.replays[replica] is None:
            self.replays[replica] = drafter_replays(self, channel)
        with self.model_lock:
            self.steps[replica] += self.replays[replica].replay_message(ts, draft_block_base=base)

    def stats(self) -> dict:
        return {"replicas": self.num_replicas, "blocks_per_replica": self.blocks_per_replica,
                "steps": list(self.steps), "proposes": self.batcher.batches, "merged": self.batcher.merged}
