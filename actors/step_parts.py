"""The pieces of a whole-step graph (step_graph.py) that every placement
shares: the static settings, the drafter's half of a step, and what the
halves exchange when they run in different processes.

A step is: block inputs from each row's start, last token and emit budget
-> the drafter's proposal (a chain, a tree, sampled drafts; prompt lookups)
-> the target's verify forward -> acceptance -> the next step's inputs ->
the drafter's context store of the accepted rows. With the drafter in
another process the step graph of rank 0 receives the proposal and sends
the acceptance and the tapped rows back; TP followers receive the verify
block's rows (and a draft tree's K/V moves) from rank 0. Every exchange has
shapes fixed by the batch size, so each side captures it in its graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specray.draft_tree import DraftTree, TreeUniverse, row_depths
from specray.kernels.ops import lookup_drafts
from specray.sampling import SamplingTensors, position_uniforms, sample_draft_tokens

MODES = ("greedy", "sampled", "filtered")  # the sampling kinds of a batch, each its own graphs


@dataclass(frozen=True)
class StepSettings:
    """What every process of an engine must agree on to run the same step."""

    block_size: int  # B: the anchor row and B - 1 drafts
    max_seqs: int
    kv_block_size: int
    width: int  # block-table width
    mask_token_id: int
    lookup: tuple[int, int] | None  # prompt lookup (min_n, max_n), or None
    lookup_agree: bool
    draft_top_k: int

    @staticmethod
    def make(config, block_size: int, max_model_len: int, mask_token_id: int | None) -> "StepSettings":
        lookup = (config.prompt_lookup_min, config.prompt_lookup_max) if config.prompt_lookup_min else None
        return StepSettings(block_size, config.max_num_seqs, config.kv_block_size,
                            -(-(max_model_len + 2 * block_size) // config.kv_block_size), mask_token_id or 0, lookup,
                            bool(config.prompt_lookup_agree), config.draft_top_k)


def state_buffers(cfg: StepSettings, dev, sampling: str, draft_tables: bool, history: bool,
                  shared: dict | None, oracle: bool = False) -> dict[str, torch.Tensor]:
    """A chain's state on the device: each row's block start, last token,
    emit budget, whether it is real, its block tables; the sampling
    settings of sampled batches; with lookups, the token history."""
    S, W = cfg.max_seqs, cfg.width
    bufs = {
        "start": torch.zeros(S, dtype=torch.int64, device=dev),
        "last": torch.zeros(S, dtype=torch.int64, device=dev),
        "real": torch.zeros(S, dtype=torch.bool, device=dev),
        "budget": torch.zeros(S, dtype=torch.int64, device=dev),
        "target_tables": torch.zeros(S, W, dtype=torch.int32, device=dev),
    }
    if draft_tables:
        bufs["draft_tables"] = torch.zeros(S, W, dtype=torch.int32, device=dev)
    if history:
        bufs["slot"] = torch.zeros(S, dtype=torch.int64, device=dev)
        bufs["history"] = torch.zeros(S + 1, W * cfg.kv_block_size, dtype=torch.int64, device=dev)
    if oracle:  # oracle acceptance (oracle.py): each row's recorded sequence, hash key, whether it is drafted
        bufs["oracle_seq"] = torch.zeros(S, W * cfg.kv_block_size, dtype=torch.int64, device=dev)
        bufs["oracle_key"] = torch.zeros(S, dtype=torch.int64, device=dev)
        bufs["oracle_use"] = torch.zeros(S, dtype=torch.bool, device=dev)
    if sampling != "greedy":
        bufs["temperature"] = torch.zeros(S, dtype=torch.float32, device=dev)
        bufs["top_p"] = torch.ones(S, dtype=torch.float32, device=dev)
        bufs["top_k"] = torch.zeros(S, dtype=torch.int64, device=dev)
        bufs["keys"] = torch.zeros(S, 3, dtype=torch.int64, device=dev)
    if shared is not None:
        bufs = {name: shared.setdefault(name, buf) for name, buf in bufs.items()}
    return bufs


def padding(bufs: dict, sampling: str, max_seqs: int) -> dict:
    """Padding rows: block 0, positions from 0, their state reset every
    step; their history row is the padding row (``slot``), so the token
    history itself is never padded."""
    return dict.fromkeys(bufs, 0) | ({"top_p": 1} if sampling != "greedy" else {}) | \
        ({"slot": max_seqs, "history": None} if "slot" in bufs else {})


_GREEDY = SamplingTensors(temperature=torch.zeros(0), top_p=torch.zeros(0), top_k=torch.zeros(0, dtype=torch.int64),
                          uniforms=torch.zeros(3, 0, 0, dtype=torch.float64), all_greedy=True)


def sampling_tensors(bufs: dict, sampling: str, n: int, start: torch.Tensor, B: int) -> SamplingTensors:
    """A sampled batch's settings, its uniforms drawn from the rows' starts on the device."""
    if sampling == "greedy":
        return _GREEDY
    return SamplingTensors(bufs["temperature"][:n], bufs["top_p"][:n], bufs["top_k"][:n],
                           position_uniforms(bufs["keys"][:n].T, start, B), all_greedy=False,
                           any_filter=sampling == "filtered")


@dataclass
class Drafted:
    """The drafter's half of a step, for ``n`` rows."""

    input_ids: torch.Tensor  # [n, B]: the last token, then the drafts (a lookup's where taken)
    looked_up: torch.Tensor  # [n] bool
    shape: DraftTree | None = None  # a draft tree's, where the block holds one
    draft_idx: torch.Tensor | None = None  # [n, B - 1, K]: the sparse draft distribution of sampled rows
    draft_q: torch.Tensor | None = None

    @property
    def drafts(self) -> torch.Tensor:
        return self.input_ids[:, 1:]

    def row_offsets(self) -> torch.Tensor | None:
        """``[n, B]``: each row's position past the anchor (a tree's depths), None for a chain."""
        return None if self.shape is None else row_depths(self.shape)


def propose(drafter, cfg: StepSettings, bufs: dict, blk, st: SamplingTensors, n: int, sampling: str,
            tree: TreeUniverse | None, oracle=None) -> Drafted:
    """The drafter's proposal for the blocks ``blk`` (``kernels.ops.block_inputs``).
    ``oracle`` (oracle acceptance, oracle.py; with its buffers in ``bufs``):
    the drafter runs, the oracle's drafts replace its chain."""
    from specray.actors.drafter import draft_tree_of

    start, last = bufs["start"][:n], bufs["last"][:n]
    d_tables = bufs["draft_tables"][:n]
    hidden = drafter.model.propose_hidden(blk.block_ids, start, blk.block_len, d_tables, drafter.max_model_len,
                                          drafter.kv_cache, blk.positions)
    draft_logits = drafter.model.logits(hidden[:, 1:])
    lookup = cfg.lookup
    history, rows = (bufs["history"], bufs["slot"][:n]) if lookup else (None, None)
    # Lookups draft for greedy rows only, as in synchronous steps.
    greedy_rows = None if sampling == "greedy" or not lookup else st.temperature == 0
    if tree is not None:
        looked_up = found = None
        if lookup:  # a row's lookup draft joins its tree as a branch (greedy rows', as synchronous steps)
            _, found, looked_up = lookup_drafts(history, rows, blk.known_lens, blk.block_len, greedy_rows,
                                                torch.zeros_like(blk.block_ids[:, 1:]), last, lookup[0], lookup[1])
        drafts, shape = draft_tree_of(draft_logits, tree, found, looked_up,
                                      None if sampling == "greedy" else st.temperature)
        if looked_up is None:
            looked_up = torch.zeros(n, dtype=torch.bool, device=start.device)
        return Drafted(torch.cat([last[:, None], drafts], 1), looked_up, shape)
    drafts, idx, q = sample_draft_tokens(draft_logits, st, cfg.draft_top_k)
    if oracle is not None:
        drafts = oracle.device_drafts(bufs, n, start, last, drafts)
    if lookup:
        input_ids, _, looked_up = lookup_drafts(history, rows, blk.known_lens, blk.block_len, greedy_rows, drafts,
                                                last, lookup[0], lookup[1], cfg.lookup_agree)
    else:
        input_ids = torch.cat([last[:, None], drafts], 1)
        looked_up = torch.zeros(n, dtype=torch.bool, device=start.device)
    return Drafted(input_ids, looked_up, None, idx, q)


# ------------------------------------------------ what the halves exchange
def drafted_columns(B: int, tree: bool) -> dict[str, slice]:
    """Where each field of a proposal lies among its int64 columns
    (``pack_drafted``): the block's token ids, looked up, and a tree's
    parents' rows, depths and attention masks."""
    G = B - 1
    cols = {"input_ids": slice(0, B), "looked_up": slice(B, B + 1)}
    if tree:
        o = B + 1
        cols |= {"parent": slice(o, o + G), "depth": slice(o + G, o + 2 * G), "masks": slice(o + 2 * G, o + 3 * G + 1)}
    return cols


def _is_tree(ints: torch.Tensor, B: int) -> bool:
    return ints.shape[1] > B + 1


def pack_drafted(d: Drafted) -> list[torch.Tensor]:
    """The proposal's integers in ``drafted_columns``' order, then a
    sampled batch's sparse draft distribution (ids, probabilities)."""
    fields = {"input_ids": d.input_ids, "looked_up": d.looked_up.long()[:, None]}
    if d.shape is not None:
        fields |= {"parent": d.shape.parent, "depth": d.shape.depth, "masks": d.shape.masks.long()}
    B = d.input_ids.shape[1]
    out = [torch.cat([fields[name] for name in drafted_columns(B, d.shape is not None)], 1)]
    if d.draft_q is not None:
        out += [d.draft_idx, d.draft_q]
    return out


def drafted_buffers(n: int, B: int, tree: bool, sampled: bool, top_k: int, dev) -> list[torch.Tensor]:
    """Empty tensors of ``pack_drafted``'s shapes."""
    width = max(cols.stop for cols in drafted_columns(B, tree).values())
    out = [torch.empty(n, width, dtype=torch.int64, device=dev)]
    if sampled:
        out += [torch.empty(n, B - 1, top_k, dtype=torch.int64, device=dev),
                torch.empty(n, B - 1, top_k, dtype=torch.float32, device=dev)]
    return out


def placeholder_drafted(ts: list[torch.Tensor], B: int) -> None:
    """A capture's warm-up stand-in for a proposal that did not come
    (graphs.peer_recv): ``drafted_buffers``' zeros, a tree's columns a
    chain (node j's parent row j, depth j + 1, row i attending rows 0..i);
    all-zero depths sent the tree acceptance's scatter to row -1."""
    ints = ts[0]
    if _is_tree(ints, B):
        cols, j = drafted_columns(B, True), torch.arange(B, dtype=torch.int64, device=ints.device)
        ints[:, cols["parent"]] = j[:-1]
        ints[:, cols["depth"]] = j[1:]
        ints[:, cols["masks"]] = (1 << (j + 1)) - 1


def drafted_bounds(B: int, vocab: int, tree: bool, dev) -> tuple[torch.Tensor, torch.Tensor]:
    """``[1, C]`` lower and upper bounds of each of a proposal's integer
    columns (``drafted_columns``): token ids, looked up (0 or 1), a tree's
    parents' rows (0..G), depths (1..G) and masks (any bits)."""
    G, big = B - 1, torch.iinfo(torch.int64).max
    ranges = {"input_ids": (0, vocab - 1), "looked_up": (0, 1), "parent": (0, G), "depth": (1, G), "masks": (-big, big)}
    lo, hi = [], []
    for name, cols in drafted_columns(B, tree).items():
        width = cols.stop - cols.start
        lo += [ranges[name][0]] * width
        hi += [ranges[name][1]] * width
    return (torch.tensor([lo], dtype=torch.int64, device=dev), torch.tensor([hi], dtype=torch.int64, device=dev))


def bound_drafted(ts: list[torch.Tensor], bounds: tuple[torch.Tensor, torch.Tensor], vocab: int) -> None:
    """In place: every index a received proposal carries within its range
    (``drafted_bounds``; sparse draft ids, and finite draft probabilities).
    A receive ended by an abort (the drafter lost mid-step) leaves whatever
    bytes the channel held; rank 0 drops that step's results, but its
    kernels run on them first, and an index out of range there is a device
    assert, which ends rank 0's CUDA context (H100: a gather out of bounds
    after a drafter was killed). A real proposal is unchanged. One kernel
    a step, three for sampled batches."""
    ts[0].clamp_(*bounds)
    if len(ts) == 3:
        ts[1].clamp_(0, vocab - 1)
        ts[2].nan_to_num_(nan=0.0, posinf=1.0, neginf=0.0)


def unpack_drafted(ts: list[torch.Tensor], B: int) -> Drafted:
    ints = ts[0]
    cols = drafted_columns(B, _is_tree(ints, B))
    shape = None
    if "parent" in cols:
        shape = DraftTree(ints[:, cols["parent"]], ints[:, cols["depth"]], ints[:, cols["masks"]].int())
    idx, q = (ts[1], ts[2]) if len(ts) == 3 else (None, None)
    return Drafted(ints[:, cols["input_ids"]], ints[:, cols["looked_up"]][:, 0].bool(), shape, idx, q)


def kept_rows(num_accepted: torch.Tensor, B: int, row_kept: torch.Tensor | None) -> torch.Tensor:
    """``[n, B]`` bool: the block rows whose tapped states enter the
    drafter's context (the anchor and the accepted drafts)."""
    if row_kept is not None:
        return row_kept
    return torch.arange(B, device=num_accepted.device)[None] <= num_accepted[:, None]
