"""Sampled rows over draft trees (draft_tree.target_choices): the tokens a
step emits follow the target's filtered distribution, position by position
and jointly across a step boundary; the mean accepted length is the target's
mass on the tree's paths; and a biased rule is caught."""

import numpy as np
import pytest
import torch

from joint_sampling import pooled_chi2_p
from specray.draft_tree import (
    accept_greedy,
    build,
    generic_paths,
    make_universe,
    path_tokens,
    target_choices,
)
from specray.sampling import SamplingParams, SamplingTensors, filtered_probs

N = 20_000  # seeded trials
V, G = 24, 7  # vocabulary (top-k 20 cuts it), nodes a tree


class MarkovTarget:
    """A target whose logits for position ``start + d + 1`` depend on ``d``
    and the token at ``start + d`` only: ``table [D, V, V]``, a depth's rows
    near one another (as a drafter that sees positions only assumes) yet
    every tree row's distribution its own."""

    def __init__(self, depth, gen):
        self.base = torch.randn(depth, 1, V, generator=gen) * 3.0
        self.table = self.base + torch.randn(depth, V, V, generator=gen) * 0.7

    def logits(self, depths, tokens):  # [S, R] each -> [S, R, V]
        return self.table[depths, tokens]


def one_step(target, tokens, tree, anchor, offset, st, rule):
    """A verify step: block rows ``[anchor, nodes]`` at depths ``offset +
    row depth``. Returns (accepted count, bonus, path drafts)."""
    S = tokens.shape[0]
    depths = torch.cat([torch.zeros(S, 1, dtype=torch.long), tree.depth], 1)
    row_tokens = torch.cat([anchor[:, None], tokens], 1)
    logits = target.logits(offset[:, None] + depths, row_tokens)
    choices = rule(logits, tree, st, tokens)
    acc = accept_greedy(choices, tokens, tree, torch.full((S,), G))
    return acc.num_accepted, acc.bonus, path_tokens(tokens, acc.path_rows)


def exact(logits, tree, st, tokens):
    return target_choices(logits, tree, st)


def biased(logits, tree, st, tokens):
    """Wrong on purpose: where the target's sample is any depth-1 child,
    take the drafter's first child instead (over-accepting its favourite)."""
    choices = target_choices(logits, tree, st)
    children = tokens[:, tree.depth[0] == 1]  # the drafter's ranks 0, 1, ..
    hit = (children == choices[:, :1]).any(1)
    choices[:, 0] = torch.where(hit, children[:, 0], choices[:, 0])
    return choices


def run_trials(temperature, top_p, top_k, rule, seed=0):
    """``N`` seeded rows from one anchor, every row the same tree: the first
    two emitted tokens (a second step drafts where the first emitted one),
    the accepted counts, the target and the tree."""
    gen = torch.Generator().manual_seed(seed)
    target = MarkovTarget(2 * G + 2, gen)
    universe = make_universe(generic_paths(G, max_rank_sum=3), G)
    draft = (target.base[:G, 0] * 0.4 + torch.randn(G, V, generator=gen) * 0.2).log_softmax(-1)  # a flatter target
    top = draft.topk(universe.top_k, -1)
    tokens, tree = build(top.values[None], top.indices[None], universe, G)
    tokens = tokens.expand(N, -1).contiguous()
    tree = type(tree)(*(t.expand(N, -1).contiguous() for t in (tree.parent, tree.depth, tree.masks)))
    params = [SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)] * N
    seeds, start = list(range(N)), 40
    st = SamplingTensors.build(params, seeds, [start] * N, G + 1)
    anchor = torch.full((N,), 3)
    n1, bonus1, drafts1 = one_step(target, tokens, tree, anchor, torch.zeros(N, dtype=torch.long), st, rule)
    emitted = torch.cat([drafts1, bonus1[:, None]], 1)
    first = torch.where(n1 > 0, drafts1[:, 0], bonus1)
    # Rows that emitted one token verify a second step from it, its
    # uniforms those of its own positions (start + 1 ..).
    st2 = SamplingTensors.build(params, seeds, [start + 1] * N, G + 1)
    n2, bonus2, drafts2 = one_step(target, tokens, tree, first, torch.ones(N, dtype=torch.long), st2, rule)
    second_next = torch.where(n2 > 0, drafts2[:, 0], bonus2)
    second_here = torch.where(n1 > 1, emitted[:, 1], bonus1)
    second = torch.where(n1 > 0, second_here, second_next)
    return first, second, n1, target, tokens[0], tree, params[0]


def dist(target, depth, token, sp):
    st = SamplingTensors.build([sp], [0], [0], 1)
    return filtered_probs(target.table[depth, token][None], st)[0].double()


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, 0), (1.0, 0.9, 20), (0.7, 0.9, 20)])
def test_sampled_tree_emits_the_target_distribution(temperature, top_p, top_k):
    first, second, n1, target, _, _, sp = run_trials(temperature, top_p, top_k, exact)
    p1 = dist(target, 0, 3, sp)
    assert pooled_chi2_p(np.bincount(first.numpy(), minlength=V), p1.numpy()) > 1e-3
    p2 = torch.stack([dist(target, 1, a, sp) for a in range(V)])  # [a] -> the second token's distribution
    joint = (p1[:, None] * p2).reshape(-1)
    cells = np.bincount((first * V + second).numpy(), minlength=V * V)
    assert pooled_chi2_p(cells, joint.numpy()) > 1e-3
    # The tree accepted often, and past depth 1 too: both branches ran.
    assert 0.2 < (n1 > 0).float().mean() < 0.98 and (n1 > 1).float().mean() > 0.05


def test_a_biased_rule_fails_the_same_check():
    """The check can fail: giving the drafter's first child the target's
    samples that landed on its siblings skews the first token."""
    first, _, _, target, _, _, sp = run_trials(1.0, 0.9, 20, biased)
    p1 = dist(target, 0, 3, sp)
    assert pooled_chi2_p(np.bincount(first.numpy(), minlength=V), p1.numpy()) < 1e-6


def test_accepted_length_is_the_targets_mass_on_the_tree():
    """E[accepted] = sum over nodes of the target's probability of the
    node's path: every node is reached exactly when the target's own
    samples walk to it (the most any exact rule can accept from a fixed tree)."""
    _, _, n1, target, tokens, tree, sp = run_trials(1.0, 0.9, 20, exact, seed=1)
    reach = [1.0] * (G + 1)  # row -> the target's probability of its path
    for j in range(G):
        parent = int(tree.parent[0, j])
        parent_token = 3 if parent == 0 else int(tokens[parent - 1])
        p = dist(target, int(tree.depth[0, j]) - 1, parent_token, sp)
        reach[j + 1] = reach[parent] * float(p[int(tokens[j])])
    expected = sum(reach[1:])
    assert abs(n1.double().mean().item() - expected) < 4 * n1.double().std().item() / N**0.5 + 1e-3


def test_greedy_rows_keep_the_argmax_and_uniforms_must_cover_the_tree():
    gen = torch.Generator().manual_seed(3)
    universe = make_universe(generic_paths(G, max_rank_sum=3), G)
    top = torch.randn(2, G, V, generator=gen).log_softmax(-1).topk(universe.top_k, -1)
    _, tree = build(top.values, top.indices, universe, G)
    logits = torch.randn(2, G + 1, V, generator=gen)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=1)]
    st = SamplingTensors.build(params, [0, 1], [5, 5], G + 1)
    choices = target_choices(logits, tree, st)
    assert torch.equal(choices[0], logits[0].argmax(-1))
    narrow = SamplingTensors.build(params, [0, 1], [5, 5], G)
    with pytest.raises(ValueError, match="uniforms"):
        target_choices(logits, tree, narrow)
