"""What crosses between the processes of one engine on the step path, as a
few tensors each: a tensor is one transfer of its own (and a host copy
when it starts on the host), which costs more than its bytes.

* the TargetBatch rank 0 broadcasts to the other TP ranks;
* the DraftBatch rank 0 sends to a drafter in another process, and the
  DraftOutput it sends back;
* a draft tree's K/V moves, which every TP rank applies to its shard.
"""

from __future__ import annotations

import torch

from specray.draft_tree import DraftTree
from specray.plan import AttentionMetadata, DraftBatch, DraftOutput, TargetBatch
from specray.sampling import SamplingTensors

CMD_STOP, CMD_STEP, CMD_CONTEXT, CMD_PROPOSE, CMD_DRAFTS, CMD_MOVE, CMD_ASYNC = 0, 1, 2, 3, 4, 5, 6
# Messages of host tensors only: they travel over the host path (gloo) whatever the devices.
HOST_CMDS = (CMD_STOP, CMD_ASYNC)
_EMPTY = torch.zeros(0)


def _maybe(t: torch.Tensor | None) -> torch.Tensor:
    return _EMPTY if t is None else t


def _present(t: torch.Tensor) -> torch.Tensor | None:
    return t if t.numel() else None


def pack_target_batch(b: TargetBatch) -> list[torch.Tensor]:
    """Per-token ids / positions / slots (and a draft tree's masks) ``[3 or
    4, N]``, the integer fields, and the block tables."""
    a = b.attn
    dev = b.input_ids.device  # on rank 0's device once the drafts are in
    rows = [b.input_ids, a.positions.to(dev), a.slot_mapping.to(dev)]
    if a.tree_mask is not None:
        rows.append(a.tree_mask.to(dev).long())
    meta = torch.tensor([a.max_query_len, a.max_seq_len, int(b.want_hidden)], dtype=torch.int64)
    ints = torch.cat([a.query_start_loc.cpu(), a.seq_lens.cpu(), b.logits_indices.cpu(), meta])  # [2S + 1 + M + 3]
    return [torch.stack(rows), ints, a.block_tables]


def unpack_target_batch(ts: list[torch.Tensor]) -> TargetBatch:
    per_token, ints, tables = ts
    S = tables.shape[0]
    ids, pos, slots = per_token[:3]
    tree_mask = per_token[3].int() if per_token.shape[0] == 4 else None
    qsl, seq_lens, logit_idx = ints[: S + 1], ints[S + 1 : 2 * S + 1], ints[2 * S + 1 : -3]
    max_q, max_s, want_hidden = ints[-3:].tolist()
    attn = AttentionMetadata(pos, slots, qsl, seq_lens, tables, max_q, max_s, tree_mask)
    return TargetBatch(ids, attn, logit_idx, bool(want_hidden))


def pack_draft_batch(b: DraftBatch) -> list[torch.Tensor]:
    """The draft blocks, the block tables, the integer fields (the float64
    uniforms ride along as their bit patterns), the sampling floats, and a
    tree's lookup branches (``[S, 1 + L]``: has one, its tokens)."""
    st = b.sampling
    W = st.uniforms.shape[-1]
    meta = torch.tensor([b.max_ctx_len, int(st.all_greedy), int(st.any_filter), W, int(b.tree)], dtype=torch.int64)
    uniform_bits = st.uniforms.cpu().reshape(-1).view(torch.int64)
    ints = torch.cat([b.ctx_lens.cpu(), b.block_lens.cpu(), st.top_k.cpu(), uniform_bits, meta])  # [3S + 3SW + 5]
    floats = torch.stack([st.temperature.cpu(), st.top_p.cpu()])  # [2, S]
    lookup = _EMPTY
    if b.tree_lookup is not None:
        lookup = torch.cat([b.tree_has_lookup.long()[:, None].cpu(), b.tree_lookup.cpu()], 1)
    return [b.block_ids, b.block_tables, ints, floats, lookup]


def unpack_draft_batch(ts: list[torch.Tensor]) -> DraftBatch:
    block_ids, tables, ints, floats, lookup = ts
    S = block_ids.shape[0]
    max_ctx, all_greedy, any_filter, W, tree = ints[-5:].tolist()
    ctx_lens, block_lens, top_k = ints[: 3 * S].view(3, S)
    uniforms = ints[3 * S : 3 * S + 3 * S * W].view(torch.float64).view(3, S, W)
    st = SamplingTensors(floats[0], floats[1], top_k, uniforms, bool(all_greedy), bool(any_filter))
    has, branches = (lookup[:, 0].bool(), lookup[:, 1:]) if lookup.numel() else (None, None)
    return DraftBatch(block_ids, ctx_lens, block_lens, tables, max_ctx, st, bool(tree), branches, has)


def pack_draft_output(o: DraftOutput) -> list[torch.Tensor]:
    """Drafts, the sparse draft distribution (sampled rows), and a draft
    tree's shape ``[S, 3N + 1]`` (parents, depths, masks)."""
    tree = _EMPTY
    if o.tree is not None:
        tree = torch.cat([o.tree.parent, o.tree.depth, o.tree.masks.long()], 1)
    return [o.tokens, _maybe(o.draft_idx), _maybe(o.draft_q), tree]


def unpack_draft_output(ts: list[torch.Tensor]) -> DraftOutput:
    tokens, idx, q, tree = ts
    shape = None
    if tree.numel():
        N = tokens.shape[1]
        shape = DraftTree(tree[:, :N], tree[:, N : 2 * N], tree[:, 2 * N :].int())
    return DraftOutput(tokens, _present(idx), _present(q), shape)
