"""Shared pieces of the draft-tree tests (test_draft_tree.py,
test_draft_tree_gpu.py): random trees, their ancestor masks, engines that
verify trees, and an oracle drafter whose greedy continuation only a tree
accepts."""

from __future__ import annotations

import torch
from factories import make_models

from specray.config import EngineConfig
from specray.draft_tree import build, generic_paths, make_universe
from specray.llm import build_engine


def is_ancestor(tree, s, i, k) -> bool:
    """Whether node ``k`` is node ``i`` or one of its ancestors."""
    return bool((int(tree.masks[s, i + 1]) >> (k + 1)) & 1)


def random_tree(S=4, G=7, K=4, vocab=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    universe = make_universe(generic_paths(G, max_rank_sum=3), G)
    logits = torch.randn(S, G, vocab, generator=g) * 2
    top = logits.log_softmax(-1).topk(K, -1)
    tokens, tree = build(top.values, top.indices, universe, G)
    return universe, top, tokens, tree


def tree_models(tmp_path_factory):
    """A tiny target and a drafter of 8-token blocks, for a module's ``models``."""
    return make_models(tmp_path_factory.mktemp("tree"), block_size=8)


def engine(root, **kw):
    base = dict(target=str(root / "t"), drafter=str(root / "d"), kv_block_size=4, num_kv_blocks=300,
                max_model_len=96, max_num_seqs=8, adaptive_speculation=False)
    return build_engine(EngineConfig(**(base | kw)))


class OracleDrafts:
    """Drafter logits that rank the greedy continuation second at odd depths
    (a decoy first) and first at even ones, so only a tree off the argmax
    chain accepts it; the engine must still emit exactly the greedy tokens.
    Keyed by (anchor position, anchor token): the drafter's inputs."""

    def __init__(self, eng, sequences: list[list[int]]):
        self.next = {}
        for seq in sequences:
            for a in range(len(seq)):
                self.next.setdefault((a, seq[a]), seq[a + 1 :])
        model = eng.drafter.model
        self.propose_hidden, self.logits = model.propose_hidden, model.logits
        model.propose_hidden, model.logits = self._propose_hidden, self._logits
        self.keys = None

    def _propose_hidden(self, block_ids, ctx_lens, *args, **kw):
        self.keys = list(zip(ctx_lens.tolist(), block_ids[:, 0].tolist()))
        return self.propose_hidden(block_ids, ctx_lens, *args, **kw)

    def _logits(self, hidden):
        out = self.logits(hidden).float()
        V = out.shape[-1]
        for s, key in enumerate(self.keys):
            cont = self.next.get(key, [])
            for d in range(min(out.shape[1], len(cont))):
                out[s, d] = -5.0
                out[s, d, cont[d]] = 3.0
                if d % 2 == 0:
                    out[s, d, (cont[d] + 1) % V] = 4.0  # the decoy, ranked first
        return out
