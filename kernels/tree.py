"""Building draft trees from the drafter's top tokens (cluster/draft_tree.py
explains the trees): the PyTorch reference for ``tree_triton``.

A universe of ``U`` rank paths is given as tables, parents before children:
``path_index`` ``[U, D]`` (the flat ``depth * K + rank`` of each step of the
path, -1 past its end), ``anc_index`` ``[U, D]`` (the universe index of the
path's prefix of each length: its ancestors and itself, -1 past its end),
``depth``, ``rank`` and ``parent`` ``[U]`` (-1 for depth 1)."""

from __future__ import annotations

import torch


def build_tree_ref(top_logprobs: torch.Tensor, top_ids: torch.Tensor, path_index: torch.Tensor,
                   anc_index: torch.Tensor, depth: torch.Tensor, rank: torch.Tensor, parent: torch.Tensor,
                   num_nodes: int, lookup: torch.Tensor | None = None, has_lookup: torch.Tensor | None = None):
    """Each row's ``num_nodes`` best-scoring paths (score: the sum of the
    path's log-probabilities ``top_logprobs`` ``[S, G, K]``, less 1e-4 a
    depth; ties go to the lower universe index), in universe order; where
    ``has_lookup`` ``[S]``, the ``L`` lowest-ranked of them give way to a
    chain of ``lookup`` ``[S, L]``'s tokens, placed last.

    Returns ``tokens``, ``parent`` (block row of the parent; 0: the anchor),
    ``depth`` ``[S, N]`` int64 and ``masks`` ``[S, N + 1]`` int32 (bit ``j``
    of row ``i``: row ``i`` sees block row ``j``)."""
    S, G, K = top_ids.shape
    U, N, dev = depth.shape[0], num_nodes, top_ids.device
    lp = top_logprobs.float().reshape(S, G * K)
    on_path = path_index >= 0
    score = torch.where(on_path[None], lp[:, path_index.clamp(min=0)], 0.0).sum(-1) - 1e-4 * depth
    by_score = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :N]  # [S, N]
    j = torch.arange(N, device=dev)
    L = 0 if lookup is None else lookup.shape[1]
    dropped = (j >= N - L)[None] & has_lookup[:, None] if L else torch.zeros(S, N, dtype=torch.bool, device=dev)
    kept = torch.zeros(S, U + 1, dtype=torch.bool, device=dev)
    kept.scatter_(1, torch.where(dropped, U, by_score), True)
    kept = kept[:, :U]
    row_of = torch.where(kept, kept.long().cumsum(1), 0)  # block row of each kept path, in universe order
    node_u = torch.zeros(S, N + 1, dtype=torch.int64, device=dev)
    node_u.scatter_(1, torch.where(kept, row_of - 1, N), torch.arange(U, device=dev).expand(S, -1))
    node_u = node_u[:, :N]
    flat_ids = top_ids.reshape(S, G * K)
    tokens = flat_ids.gather(1, (depth[node_u] - 1) * K + rank[node_u])
    parent_u = parent[node_u]
    parent_row = torch.where(parent_u < 0, 0, row_of.gather(1, parent_u.clamp(min=0)))
    anc = anc_index[node_u]  # [S, N, D]
    anc_rows = row_of.gather(1, anc.clamp(min=0).reshape(S, -1)).view(anc.shape)
    masks = ((torch.where(anc >= 0, 1, 0) << anc_rows).sum(-1)) | 1
    node_depth = depth[node_u]
    if L:
        is_lookup = dropped  # in universe order the chain's nodes are the last L too
        c = (j - (N - L)).clamp(min=0)
        tokens = torch.where(is_lookup, lookup.gather(1, c[None].expand(S, -1).clamp(max=L - 1)), tokens)
        node_depth = torch.where(is_lookup, c + 1, node_depth)
        parent_row = torch.where(is_lookup, torch.where(c == 0, 0, j), parent_row)
        chain_bits = ((1 << (j + 2)) - 1) & ~((1 << (N - L + 1)) - 1)  # rows N - L + 1 .. j + 1
        masks = torch.where(is_lookup, chain_bits[None] | 1, masks)
    masks = torch.cat([torch.ones_like(masks[:, :1]), masks], 1)
    masks = torch.where(masks >= 2**31, masks - 2**32, masks).int()
    return tokens, parent_row, node_depth, masks


def top_logprobs_ref(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest log-softmax entries of each row of ``logits``
    ``[..., V]`` (float32, descending) and their indices."""
    top = logits.topk(k, dim=-1)
    return top.values.float() - logits.float().logsumexp(-1, keepdim=True), top.indices
