"""What the control plane hands the workers each step: plain dataclasses of
CPU tensors (they cross process boundaries as they are)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specray.draft_tree import DraftTree
from specray.sampling import SamplingTensors


@dataclass
class AttentionMetadata:
    """Explicit per-forward attention metadata (no HF cache objects).

    ``num_tokens`` query tokens belong to ``num_seqs`` sequences; sequence
    ``s`` owns rows ``query_start_loc[s]:query_start_loc[s+1]``, which are
    its last positions once ``seq_lens[s]`` positions are cached.
    """

    positions: torch.Tensor  # [num_tokens] int64
    slot_mapping: torch.Tensor  # [num_tokens] int64
    query_start_loc: torch.Tensor  # [num_seqs + 1] int64
    seq_lens: torch.Tensor  # [num_seqs] int64, cached length after this step
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    max_query_len: int
    max_seq_len: int
    # [num_tokens] int32, draft trees (draft_tree.py): bit j of a row lets it
    # see row j of its sequence's new rows; -1 is plain causal. A row's
    # position is then its depth in the tree, not its index.
    tree_mask: torch.Tensor | None = None

    def to(self, device) -> "AttentionMetadata":
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return AttentionMetadata(
            move(self.positions),
            move(self.slot_mapping),
            move(self.query_start_loc),
            move(self.seq_lens),
            move(self.block_tables),
            self.max_query_len,
            self.max_seq_len,
            None if self.tree_mask is None else move(self.tree_mask),
        )


@dataclass
class TargetBatch:
    """One target forward: verify blocks and prefill chunks together."""

    input_ids: torch.Tensor  # [num_tokens] int64
    attn: AttentionMetadata
    logits_indices: torch.Tensor  # [num_logit_rows] int64, rows of input_ids
    want_hidden: bool  # tap hidden states for the drafter
    # >0: a decode-only batch where every sequence has exactly this many rows
    # and logits_indices covers all of them (what CUDA graphs replay).
    uniform_rows: int = 0


@dataclass
class ContextUpdate:
    """Accepted positions whose tapped hidden states enter the drafter's
    context KV. ``hidden_rows`` index the rows of the target output that
    carried them (the worker that holds the hidden states selects them)."""

    hidden_rows: torch.Tensor  # [n] int64
    positions: torch.Tensor  # [n] int64
    slot_mapping: torch.Tensor  # [n] int64, drafter context pool


@dataclass
class DraftBatch:
    """One batched propose: block ``[last, MASK x (B-1)]`` per request."""

    block_ids: torch.Tensor  # [S, B] int64
    ctx_lens: torch.Tensor  # [S] int64 = position of the block's first row
    block_lens: torch.Tensor  # [S] int64, real rows of each block (<= B)
    block_tables: torch.Tensor  # [S, max_blocks] int32, drafter context pool
    max_ctx_len: int
    sampling: SamplingTensors
    tree: bool = False  # draft a tree per row (draft_tree.py): greedy and sampled rows
    tree_lookup: torch.Tensor | None = None  # [S, L] int64: prompt-lookup drafts a tree takes as a branch
    tree_has_lookup: torch.Tensor | None = None  # [S] bool: rows that have one
    # The rows' Request objects, for a drafter in this process that asks
    # (``wants_requests``: oracle mode, oracle.py); never packed or sent.
    requests: list | None = None


@dataclass
class DraftOutput:
    tokens: torch.Tensor  # [S, B-1] int64
    draft_idx: torch.Tensor | None  # [S, B-1, K] when any row samples
    draft_q: torch.Tensor | None  # [S, B-1, K]
    tree: "DraftTree | None" = None  # with tree drafts: tokens are the nodes' (draft_tree.py)
