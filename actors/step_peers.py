"""The other processes' halves of a whole-step graph (step_graph.py), and
the one host message per step that tells them to replay it.

* A **TP follower** replays its verify shard: the block's rows arrive by a
  broadcast inside rank 0's replay (ids, positions, slots, tree masks,
  sequence lengths), the all-reduces run inside the forward, and a draft
  tree's K/V moves arrive by a second broadcast.
* A **drafter in its own process** mirrors the chain's state (starts, last
  tokens, budgets, token history): a replay receives the previous step's
  acceptance and tapped rows, stores their context, advances the state as
  rank 0's replay did, proposes the next block and sends it (a shorter
  chain's at its length; an autoregressive step proposes nothing). A
  chain's last step is received by a flush replay.

Rank 0's host sends, before each replay, ``CMD_ASYNC`` with the batch size,
the sampling kind and the uploads a first step needs (``AsyncControl``),
or ``CMD_FLUSH``; the rest of the step never leaves the devices.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from specray.actors.graphs import DecodeGraphs, peer_recv, peer_send, warming
from specray.actors.step_parts import (
    MODES,
    StepSettings,
    pack_drafted,
    padding,
    propose,
    sampling_tensors,
    state_buffers,
)
from specray.chain_rows import HISTORY_UPLOADS, write_history
from specray.kernels.ops import accept_advance, block_inputs, move_kv
from specray.plan import AttentionMetadata

# The inputs a first step uploads, in the order a control message carries
# them; then the state of rows that join a running chain (JOINED).
UPLOADS = ("start", "last", "real", "budget", "target_tables", "draft_tables", "temperature", "top_p", "top_k",
           "keys", "slot") + HISTORY_UPLOADS + \
    tuple("join_" + k for k in ("rows", "start", "budget", "temperature", "top_p", "top_k", "keys", "slot", "riding")) + \
    ("after_prefill",)
# JOINED: the lane's previous results were taken already (the joining
# prompts' context store flushed it); rows join with their state, their
# first tokens over the data channel, and the step proposes as a first one.
# A FIRST word with ``after_prefill``: the chain starts at the prefill
# (chain_admit.chain_from_prefill), its rows' last tokens (the prefill's
# first tokens, on rank 0's device) follow over the data channel.
FIRST, CHAINED, FLUSH, JOINED = 0, 1, 2, 3


@dataclass
class StepWord:
    """What a peer needs to replay its half of one step graph."""

    n: int  # rows
    mode: str  # sampling kind
    tree: bool  # the block holds draft trees
    kind: int  # FIRST, CHAINED or FLUSH
    spec: bool = True  # a speculative step (else autoregressive: one row a request)
    lane: int = 0  # the micro-batch: its own graphs and state on every side
    block: int = 0  # a shorter chain's rows a request (0: the whole block)


def encode_control(w: StepWord, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    present = [name for name in UPLOADS if name in inputs]
    meta = torch.tensor([w.n, MODES.index(w.mode), int(w.tree), w.kind, int(w.spec), w.lane, w.block] +
                        [UPLOADS.index(k) for k in present])
    return [meta] + [inputs[k].cpu() for k in present]


def decode_control(ts: list[torch.Tensor]) -> tuple[StepWord, dict[str, torch.Tensor]]:
    meta = ts[0].tolist()
    n, mode, tree, kind, spec, lane, block = meta[:7]
    word = StepWord(n, MODES[mode], bool(tree), kind, bool(spec), lane, block)
    return word, {UPLOADS[i]: t for i, t in zip(meta[7:], ts[1:])}


class TPLink:
    """Rank 0's broadcasts to its TP followers inside a step replay."""

    def __init__(self, group):
        self.group = group

    def send_verify(self, input_ids, positions, slots, tree_mask, seq_lens) -> None:
        if warming():  # graphs.warming: the followers' warm-ups take zeros
            return
        mask = tree_mask if tree_mask is not None else torch.full_like(slots.reshape(-1), -1)
        rows = torch.cat([input_ids.reshape(-1), positions.reshape(-1), slots.reshape(-1), mask.long(), seq_lens])
        dist.broadcast(rows, src=0, group=self.group)

    def send_moves(self, src, dst) -> None:
        if warming():
            return
        dist.broadcast(torch.stack([src, dst]), src=0, group=self.group)

    def recv(self, t: torch.Tensor) -> torch.Tensor:
        if warming():
            return t.zero_()
        dist.broadcast(t, src=0, group=self.group)
        return t


def build_follower_graphs(target, cfg: StepSettings, tree: bool, link: TPLink, shared: dict,
                          rows: int | None = None) -> DecodeGraphs:
    """A TP follower's replay of rank 0's step: its shard of the verify
    forward (and a draft tree's K/V moves), ``rows`` a request (the block,
    a shorter chain's, or 1 for an autoregressive step). Its one input is
    the block tables, uploaded when they change."""
    dev, B = target.device, rows or cfg.block_size
    bufs = {"target_tables": shared.setdefault(
        "target_tables", torch.zeros(cfg.max_seqs, cfg.width, dtype=torch.int32, device=dev))}
    query_start_loc = torch.arange(0, cfg.max_seqs * B + 1, B, dtype=torch.int64, device=dev)

    def step(n: int):
        N = n * B
        rows = link.recv(torch.empty(4 * N + n, dtype=torch.int64, device=dev))
        ids, positions, slots, mask, seq_lens = rows[:N], rows[N : 2 * N], rows[2 * N : 3 * N], \
            rows[3 * N : 4 * N], rows[4 * N :]
        attn = AttentionMetadata(positions, slots, query_start_loc[: n + 1], seq_lens, bufs["target_tables"][:n], B,
                                 target.max_model_len + 2 * B, mask.int() if tree else None)
        target.model.forward(ids, attn, target.kv_cache, logits_indices=None, tap_layer_ids=())
        if tree:
            src, dst = link.recv(torch.empty(2, n * (B - 1), dtype=torch.int64, device=dev))
            move_kv(target.kv_cache, src, dst)
        return ()

    return DecodeGraphs(step, bufs, {"target_tables": 1}, {"target_tables": 0}, cfg.max_seqs, dev)


def build_drafter_graphs(drafter, cfg: StepSettings, mode: str, tree, kind: int, channel, hidden_width: int,
                         shared: dict, prev_block: int | None = None, block: int | None = None) -> DecodeGraphs:
    """A separate drafter's replay of its half of a step. ``kind``: FIRST
    (propose from uploaded starts), CHAINED (take the previous step's
    acceptance and tapped rows first) or FLUSH (only that).
    ``prev_block``: the rows a request of the lane's previous step, whose
    results a CHAINED or FLUSH replay takes; ``block``: this step's (None:
    the whole block; fewer: a shorter chain, a chain; 1: an autoregressive
    step, which proposes nothing, its row's context stored when its result
    comes, as rank 0's would be in its own replay)."""
    dev, full = drafter.device, cfg.block_size
    Bp, B = prev_block or full, block or full
    cfg = dataclasses.replace(cfg, block_size=B)
    bufs = state_buffers(cfg, dev, mode, draft_tables=True, history=cfg.lookup is not None, shared=shared)
    del bufs["target_tables"]
    # What the last proposal placed where: its rows' positions and context slots.
    prev = {name: shared.setdefault(name, torch.zeros(cfg.max_seqs, full, dtype=torch.int64, device=dev))
            for name in ("prev_positions", "prev_slots")}
    use_tree = tree if B == full else None

    def advance(n: int) -> None:
        """The previous step's results, as rank 0's replay applied them."""
        res = torch.empty(n, 2 * Bp + 2, dtype=torch.int64, device=dev)
        hidden = torch.empty(n * Bp, hidden_width, dtype=drafter.dtype, device=dev)
        peer_recv(channel, [res, hidden])
        out, kept = res[:, : Bp + 2], res[:, Bp + 2 :].bool()
        slots = torch.where(kept, prev["prev_slots"][:n, :Bp], 0)
        drafter.model.store_context(hidden, prev["prev_positions"][:n, :Bp].reshape(-1), slots.reshape(-1),
                                    drafter.kv_cache)
        budget = bufs["budget"][:n]
        history, rows = (bufs["history"], bufs["slot"][:n]) if "history" in bufs else (None, None)
        accept_advance(None, out[:, 0], out[:, 1], out[:, 3:], (budget + 1).clamp(1, Bp), out[:, 2].bool(), None,
                       bufs["start"][:n], bufs["last"][:n], budget, bufs["real"][:n], history, rows)

    def step(n: int):
        if kind != FIRST:
            advance(n)
        if kind == FLUSH:
            return ()
        start, last, budget = bufs["start"][:n], bufs["last"][:n], bufs["budget"][:n]
        d_tables = bufs["draft_tables"][:n]
        blk = block_inputs(start, last, budget, d_tables, d_tables, B, cfg.kv_block_size, cfg.mask_token_id)
        if B == 1:  # autoregressive: the verified row is the last token, at its start
            prev["prev_positions"][:n, :1].copy_(blk.positions)
            prev["prev_slots"][:n, :1].copy_(blk.draft_slots)
            return ()
        st = sampling_tensors(bufs, mode, n, start, B)
        drafted = propose(drafter, cfg, bufs, blk, st, n, mode, use_tree)
        offsets = drafted.row_offsets()
        if offsets is None:
            prev["prev_positions"][:n, :B].copy_(blk.positions)
            prev["prev_slots"][:n, :B].copy_(blk.draft_slots)
        else:  # a tree's rows sit at their depths
            prev["prev_positions"][:n].copy_(start[:, None] + offsets)
            prev["prev_slots"][:n].copy_(blk.draft_slots.gather(1, offsets))
        peer_send(channel, pack_drafted(drafted))
        return ()

    # ``prev`` is the step's hand-over to the next (shared by the lane's
    # graphs of every kind): a capture's warm-ups must leave it as the last
    # real step left it, or the next replay stores its context at the
    # warm-up's positions and slots.
    return DecodeGraphs(step, bufs, dict.fromkeys(bufs, 1), padding(bufs, mode, cfg.max_seqs), cfg.max_seqs, dev,
                        keep=tuple(prev.values()))


def apply_join(bufs: dict, inputs: dict, first: torch.Tensor, max_seqs: int) -> None:
    """A JOINED word's rows written into a lane's state ``bufs``, the other
    rows' kept: their ``join_*`` inputs and first tokens ``first`` (from the
    data channel); finished rows riding along write their history to the
    padding row, as rank 0's join has them do (``chain_rows.join_rows``)."""
    dev = first.device
    idx = inputs["join_rows"].to(dev)
    bufs["start"].index_copy_(0, idx, inputs["join_start"].to(dev))
    bufs["last"].index_copy_(0, idx, first.to(bufs["last"].dtype))
    bufs["budget"].index_copy_(0, idx, inputs["join_budget"].to(dev))
    bufs["real"].index_fill_(0, idx, True)
    for name in ("temperature", "top_p", "top_k", "keys", "slot"):
        if "join_" + name in inputs and name in bufs:
            bufs[name].index_copy_(0, idx, inputs["join_" + name].to(dev, bufs[name].dtype))
    if "history" in bufs:
        if "join_riding" in inputs:
            bufs["slot"].index_fill_(0, inputs["join_riding"].to(dev), max_seqs)
        bufs["history"].index_put_((bufs["slot"][idx], bufs["start"][idx]), first.to(torch.int64))


class DrafterReplays:
    """A separate drafter's halves of step graphs, by the kind of step and
    the kind its lane replayed before (whose results a chained or flushing
    replay takes first: the policy changes kinds mid-chain), and each
    lane's mirrored state."""

    def __init__(self, worker, settings: StepSettings, channel, hidden_width: int):
        self.worker, self.settings, self.channel, self.hidden_width = worker, settings, channel, hidden_width
        self.graphs: dict[tuple, DecodeGraphs] = {}
        self.buffers: dict[int, dict] = {}  # by lane
        self.last_block: dict[int, int] = {}  # by lane: the rows a request of the last step replayed there

    def replay_message(self, ts: list[torch.Tensor], draft_block_base: int = 0) -> bool:
        """Replay the step a ``CMD_ASYNC`` message names; whether it was a
        step (not a flush). ``draft_block_base``: where the engine's blocks
        start in a drafter's pool shared by several (its tables move there;
        the graphs derive every slot from them)."""
        w, inputs = decode_control(ts)
        if draft_block_base and "draft_tables" in inputs:
            inputs["draft_tables"] = inputs["draft_tables"] + draft_block_base
        with torch.inference_mode():
            self.replay(w, inputs)
        return w.kind != FLUSH

    def replay(self, w: StepWord, inputs: dict) -> None:
        # A JOINED word's replay is a first step's, on the lane's state with the joined rows written.
        full, kind = self.settings.block_size, FIRST if w.kind == JOINED else w.kind
        block = 0 if kind == FLUSH else (w.block or full) if w.spec else 1
        prev = 0 if kind == FIRST else self.last_block.get(w.lane, full)
        if kind != FLUSH:
            self.last_block[w.lane] = block
        key = (w.mode, w.tree, kind, w.lane, prev, block)
        if key not in self.graphs:
            shared = self.buffers.setdefault(w.lane, {})
            if w.lane and "history" in self.buffers.get(0, {}):  # one token history for every lane
                shared.setdefault("history", self.buffers[0]["history"])
            self.graphs[key] = build_drafter_graphs(
                self.worker, self.settings, w.mode, self.worker.tree if w.tree else None, kind, self.channel,
                self.hidden_width, shared, prev_block=prev or None, block=block or None)
        graphs, dev = self.graphs[key], self.worker.device
        after_prefill = inputs.pop("after_prefill", None) is not None
        first = None
        if w.kind == JOINED or after_prefill:  # tokens only rank 0's device holds yet
            first = torch.empty(len(inputs["join_rows"]) if w.kind == JOINED else w.n, dtype=torch.int64, device=dev)
            self.channel.recv_raw([first])
        uploads = [inputs.pop(k, None) for k in HISTORY_UPLOADS]
        if uploads[0] is not None:  # as rank 0 writes its own history: a prefill's first tokens after the prompts
            write_history(graphs, inputs, torch.stack(uploads), first if after_prefill else None)
        if w.kind == JOINED:
            apply_join(graphs.buffers, inputs, first, self.settings.max_seqs)
        elif after_prefill:
            inputs["last"] = first
        graphs.run(w.n, {k: v for k, v in inputs.items() if k in graphs.buffers})
