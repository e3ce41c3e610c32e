"""Draft trees: several continuations verified in one block.

DFlash's drafter gives, in one pass, a distribution for every position of
the block. A chain verifies the argmax of each; most of its rows are
wasted (past the fourth draft hardly one in ten is accepted). A tree spends
the same ``B - 1`` rows on the likeliest *paths* instead: node ``(r1, .., rd)``
is the path taking the ``r1``-th likeliest token at depth 1, the ``r2``-th at
depth 2, and so on; its score is the sum of those tokens' log-probabilities.
The drafter predicts each position from the context and mask tokens alone,
so a child's distribution does not depend on its parent's token and the
score needs the top-k of each position only.

The nodes come from a fixed *universe* of rank paths ordered parents first.
A child scores strictly below its parent (log-probabilities are <= 0, and
each depth costs a little more), so the ``B - 1`` best-scoring paths of the
universe always form a tree; taken in universe order, every node follows its
parent. A row's prompt-lookup draft takes the lowest-scoring nodes as a
chain of its own. That is a top-k over the drafter's vocabulary and one
small kernel a step (kernels/tree.py): no host work, and the shapes are
fixed (CUDA graphs).

Verification: block row 0 is the anchor (the last emitted token); row
``j + 1`` holds node ``j`` at position ``start + depth(j)`` and attends to the
context and to its own ancestors only (``DraftTree.masks``). Greedy acceptance
walks the tree: a node is accepted when its token is the target's argmax at
its parent's row and every ancestor is accepted; the deepest accepted node
gives the accepted count and the bonus (the argmax at its row). Every
accepted token is thus the target's argmax given exactly the accepted
prefix, so the output is the target's greedy output.

Sampled rows walk the tree the same way with the target's *sample* at each
row in place of its argmax (``target_choices``): row ``i``'s token is drawn
from the target's filtered distribution there by inverse CDF with the
row's STREAM_TOKEN uniform of position ``anchor + depth(i) + 1``, exactly
the draw an autoregressive step makes for that position. Exact: along the
accepted path every emitted token is the target's own sample given the
tokens before it, each position's uniform used once (siblings share their
position's uniform, but at most one of them is on the path), and the next
step starts past the bonus with fresh uniforms. So a sampled row's output
is token for token the autoregressive engine's with the same seed. The
tree's nodes are the drafter's top-ranked tokens, not samples, so
SpecInfer's rule (for i.i.d. drafts) does not apply; for a fixed set of
children ``C`` no exact rule accepts with probability above the target's
mass on ``C``, and this one attains it at every node.

The accepted nodes' K/V were written at their rows' slots; ``kv_moves``
lists the copies to the slots of their depths, where the next step expects
them.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass

import torch

from specray.kernels import ops
from specray.sampling import STREAM_TOKEN, SamplingTensors, filtered_probs, sample_inverse_cdf

TREE_FILE = "draft_tree.json"  # rank paths, beside a drafter's config.json


@dataclass
class TreeUniverse:
    """Candidate rank paths, parents before children, as the tables
    ``kernels/tree.py`` reads."""

    paths: list[tuple[int, ...]]
    top_k: int  # ranks 0 .. top_k - 1 at every depth
    path_index: torch.Tensor  # [U, D] int64: depth * top_k + rank of each step, -1 past the path
    anc_index: torch.Tensor  # [U, D] int64: the path's prefixes (its ancestors, then itself), -1 past it
    depth: torch.Tensor  # [U] int64, 1..D
    rank: torch.Tensor  # [U] int64, the rank at the path's last depth
    parent: torch.Tensor  # [U] int64, -1 for depth 1

    def to(self, device) -> "TreeUniverse":
        return TreeUniverse(self.paths, self.top_k, *(t.to(device) for t in
                            (self.path_index, self.anc_index, self.depth, self.rank, self.parent)))


def make_universe(paths: list[list[int]] | list[tuple[int, ...]], max_depth: int) -> TreeUniverse:
    """A universe of the given rank paths (at most ``max_depth`` deep), in
    their order; raises ValueError where a path's parent is missing or
    comes after it."""
    paths = [tuple(int(r) for r in p) for p in paths]
    index: dict[tuple[int, ...], int] = {}
    for u, p in enumerate(paths):
        if not p or len(p) > max_depth or min(p) < 0:
            raise ValueError(f"tree path {list(p)} must have 1..{max_depth} ranks >= 0")
        if p in index:
            raise ValueError(f"tree path {list(p)} is listed twice")
        if len(p) > 1 and p[:-1] not in index:
            raise ValueError(f"tree path {list(p)} comes before its parent {list(p[:-1])}")
        index[p] = u
    if not paths:
        raise ValueError("a draft tree needs at least one path")
    U, K, D = len(paths), max(max(p) for p in paths) + 1, max(len(p) for p in paths)
    path_index = torch.full((U, D), -1, dtype=torch.int64)
    anc_index = torch.full((U, D), -1, dtype=torch.int64)
    for u, p in enumerate(paths):
        for d, r in enumerate(p):
            path_index[u, d] = d * K + r
            anc_index[u, d] = index[p[: d + 1]]
    return TreeUniverse(paths, K, path_index, anc_index, torch.tensor([len(p) for p in paths]),
                        torch.tensor([p[-1] for p in paths]),
                        torch.tensor([index[p[:-1]] if len(p) > 1 else -1 for p in paths]))


def generic_paths(max_depth: int, max_rank_sum: int = 3, max_rank: int = 7) -> list[tuple[int, ...]]:
    """Every path whose ranks sum to at most ``max_rank_sum``, breadth first:
    the universe of a drafter that ships no ``draft_tree.json``."""
    paths, frontier = [], [()]
    for _ in range(max_depth):
        frontier = [p + (r,) for p in frontier for r in range(min(max_rank_sum - sum(p), max_rank) + 1)]
        paths += frontier
    return paths


def with_enough_paths(paths: list[tuple[int, ...]], max_depth: int) -> list[tuple[int, ...]]:
    """``paths`` and, if they are fewer than a tree's ``max_depth`` nodes,
    generic ones after them (parents first still)."""
    paths = [tuple(p) for p in paths]
    seen = set(paths)
    for p in generic_paths(max_depth):
        if len(paths) >= max_depth:
            break
        if p not in seen:
            paths.append(p)
            seen.add(p)
    return paths


def load_universe(drafter_dir: str | None, max_depth: int) -> TreeUniverse:
    """The drafter's own rank paths (``draft_tree.json``: ``{"paths": [[r1,
    ..], ..]}``, measured on held-out prompts by ``bench/draft_tree.py``),
    or the generic ones. A tree of ``max_depth`` nodes is chosen from it."""
    f = pathlib.Path(drafter_dir or "", TREE_FILE)
    if drafter_dir and f.is_file():
        paths = json.loads(f.read_text())["paths"]
        return make_universe(with_enough_paths([p for p in paths if len(p) <= max_depth], max_depth), max_depth)
    return make_universe(generic_paths(max_depth), max_depth)


def unsupported(block_size: int, layer_window) -> str | None:
    """Why blocks of ``block_size`` rows of a target with these sliding
    windows cannot hold draft trees (None: they can)."""
    if any(layer_window):
        return "is not built for sliding-window attention"
    if block_size > 32:
        return f"handles blocks of at most 32 rows, not {block_size}"
    if block_size < 3:
        return "needs at least two drafts a block"
    return None


@dataclass
class DraftTree:
    """The shape of each row's tree of ``N`` nodes; node ``j`` sits at block
    row ``j + 1`` (row 0 is the anchor)."""

    parent: torch.Tensor  # [S, N] int64: block row of node j's parent (0: the anchor)
    depth: torch.Tensor  # [S, N] int64: 1..N
    masks: torch.Tensor  # [S, N + 1] int32: bit j of row i: row i attends to row j (itself, an ancestor, the anchor)


def lookup_nodes(num_nodes: int) -> int:
    """Nodes a row's prompt-lookup draft takes from its tree: a chain of its
    first tokens, in place of the lowest-scoring drafter nodes (dev set,
    CPU replay: 0 / 2 / 4 / 6 nodes gave 3.035 / 3.081 / 3.174 / 3.193; eval
    2.997 / 3.013 / 3.042 / 3.062). At most half the tree."""
    return min(6, num_nodes // 2)


def build(top_logprobs: torch.Tensor, top_ids: torch.Tensor, universe: TreeUniverse, num_nodes: int,
          lookup: torch.Tensor | None = None, has_lookup: torch.Tensor | None = None) -> tuple[torch.Tensor, DraftTree]:
    """The ``num_nodes`` best-scoring paths of ``universe`` for each row, from
    the drafter's top-k per position (``[S, G, K]``, log-probabilities
    descending). With ``lookup`` ``[S, L]`` (prompt-lookup drafts), rows where
    ``has_lookup`` ``[S]`` give their ``L`` lowest-scoring nodes to a chain of
    those tokens, placed last. Returns the nodes' tokens ``[S, N]`` and the
    tree (``kernels/tree.py``)."""
    K = universe.top_k
    if top_ids.shape[2] < K:
        raise ValueError(f"the tree needs the top {K} drafts of each position, got {top_ids.shape[2]}")
    tokens, parent, depth, masks = ops.build_tree(
        top_logprobs[:, :, :K].contiguous(), top_ids[:, :, :K].contiguous(), universe.path_index, universe.anc_index,
        universe.depth, universe.rank, universe.parent, num_nodes, lookup, has_lookup)
    return tokens, DraftTree(parent, depth, masks)


def row_depths(tree: DraftTree) -> torch.Tensor:
    """``[S, N + 1]``: each block row's offset from the anchor's position."""
    return torch.cat([torch.zeros_like(tree.depth[:, :1]), tree.depth], 1)


@dataclass
class TreeAcceptance:
    num_accepted: torch.Tensor  # [S] int64: depth of the deepest accepted node
    bonus: torch.Tensor  # [S] int64: the target's argmax at that node's row
    path_rows: torch.Tensor  # [S, N] int64: block row of the accepted node at depth k + 1 (row k + 1 past the path)
    row_kept: torch.Tensor  # [S, N + 1] bool: the anchor and the accepted nodes


def target_choices(logits: torch.Tensor, tree: DraftTree, st: SamplingTensors,
                   argmax: torch.Tensor | None = None) -> torch.Tensor:
    """``[S, R]``: the target's token at each of the first ``R`` block rows
    of ``logits`` ``[S, R, V]``: the argmax for greedy rows; for sampled
    rows the inverse-CDF sample of the row's filtered distribution with the
    STREAM_TOKEN uniform of the position it predicts (``st.uniforms`` built
    from the anchors' positions, at least ``N + 1`` wide): what an
    autoregressive step after the row's path would emit. Fixed shapes, no
    host sync (async step graphs run it too)."""
    S, R, V = logits.shape
    argmax = ops.argmax(logits) if argmax is None else argmax
    if st.all_greedy:
        return argmax
    depths = row_depths(tree)[:, :R]
    if st.uniforms.shape[-1] <= int(tree.depth.shape[1]):
        raise ValueError(f"the sampling uniforms cover {st.uniforms.shape[-1]} positions per row, "
                         f"a tree of {tree.depth.shape[1]} nodes reads {tree.depth.shape[1] + 1}")
    p = filtered_probs(logits.reshape(S * R, V), st, rows_per_seq=R, greedy_rows=False)
    u = st.uniforms[STREAM_TOKEN - 1].gather(1, depths)
    sampled = sample_inverse_cdf(p, u.reshape(-1)).view(S, R)
    return torch.where(st.temperature[:, None] == 0, argmax, sampled)


def accept_greedy(target_argmax: torch.Tensor, tokens: torch.Tensor, tree: DraftTree,
                  num_drafts: torch.Tensor) -> TreeAcceptance:
    """Acceptance over each row's tree: ``target_argmax`` ``[S, N + 1]`` the
    target's token at every block row (its argmax, or for sampled rows its
    sample: ``target_choices``), ``tokens`` ``[S, N]`` the nodes' drafts; only the
    first ``num_drafts[s]`` nodes are real (a block cut short by its emit
    budget keeps its first rows: a closed subtree, nodes following their
    parents)."""
    S, N = tokens.shape
    dev = tokens.device
    nodes = torch.arange(N, device=dev)
    match = (tokens == target_argmax.gather(1, tree.parent)) & (nodes[None] < num_drafts[:, None])
    # A node is accepted when it and every ancestor match: its mask's bits
    # are all among the matching rows' (the anchor always matches).
    matching = (match.long() << (nodes + 1)).sum(1, keepdim=True) | 1
    node_bits = tree.masks[:, 1:].long() & 0xFFFFFFFF
    ok = (node_bits & matching) == node_bits  # [S, N]
    reach = torch.where(ok, tree.depth, 0)
    num_accepted, deepest = reach.max(1)
    best_row = torch.where(num_accepted > 0, deepest + 1, 0)
    bonus = target_argmax.gather(1, best_row[:, None]).squeeze(1)
    # Accepted nodes have distinct depths (one per depth: the target's
    # choices are a single path, and siblings hold distinct tokens).
    path = torch.cat([nodes + 1, nodes.new_zeros(1)]).expand(S, -1).clone()  # [S, N + 1]
    path.scatter_(1, torch.where(ok, tree.depth - 1, N), (nodes + 1).expand(S, -1))
    row_kept = torch.cat([torch.ones_like(ok[:, :1]), ok], 1)
    return TreeAcceptance(num_accepted, bonus, path[:, :N], row_kept)


def path_tokens(tokens: torch.Tensor, path_rows: torch.Tensor) -> torch.Tensor:
    """``[S, N]``: the accepted path's drafts first (what a chain's drafts
    would be), the rest filler."""
    return tokens.gather(1, path_rows - 1)


def kv_moves(row_slots: torch.Tensor, path_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache slots to copy (``src``) to (``dst``), ``[S * N]`` each: the
    accepted node at depth k was written at its row's slot and belongs at
    row k's. Past the path, rows copy onto themselves."""
    src = row_slots.gather(1, path_rows)
    return src.reshape(-1), row_slots[:, 1:].reshape(-1)
