"""Fit a drafter's draft-tree universe, and replay chains against trees.

Greedy output does not depend on the drafts, so the drafter's top-k at
every anchor of each prompt's greedy continuation (teacher-forced, as
bench/draft_policies.py does) decides what any tree would accept. This
script counts, over a prompt set, how often each rank path (draft_tree.py)
is the accepted prefix, writes the ``--paths`` most frequent ones, parents
first, as ``draft_tree.json`` (``--write``), and replays a step sequence
per policy on the same anchors: the drafter's chain, the generic universe
and the fitted one (``--universe`` to replay another set than the one it
was fitted on: fit on dev, replay on eval).

    python bench/draft_tree.py --prompts data/prompts/dev.jsonl \\
        --write cluster/assets/smollm2-dflash/draft_tree.json
    python bench/draft_tree.py --prompts data/prompts/eval.jsonl \\
        --universe cluster/assets/smollm2-dflash/draft_tree.json --out tree_eval.json
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import torch
from draft_policies import accepted, teacher_forced

from specray.bench import load_prompts, save_report
from specray.cli import add_model_args, resolve_models
from specray.detokenizer import load_tokenizer
from specray.draft_tree import TREE_FILE, build, generic_paths, load_universe, make_universe, with_enough_paths
from specray.prompt_lookup import NgramIndex, lookup_rows

TOP_K = 8


@torch.no_grad()
def score(target_dir: str, drafter_dir: str, rows, max_tokens: int) -> list[dict]:
    """Per prompt: its tokens, prompt length, the drafter's top-k
    log-probabilities / ids at every anchor ``[anchors, B - 1, TOP_K]`` and
    the prompt-lookup draft there, as served (1..4-token matches)."""
    seqs = []
    for rid, o, tokens, block, logits_of in teacher_forced(target_dir, drafter_dir, rows, max_tokens):
        P, B = len(o.prompt_token_ids), block.shape[-1]
        top = logits_of(block).log_softmax(-1).topk(TOP_K, -1)
        index = NgramIndex(1, 4)
        found = [index.propose(o.prompt_token_ids, o.token_ids[: a - P + 1], B - 1) for a in range(P, len(tokens) - 1)]
        seqs.append({"id": rid, "prompt_len": P, "tokens": tokens, "top_lp": top.values, "top_ids": top.indices,
                     "lookup": lookup_rows(found, B - 1), "has_lookup": torch.tensor([bool(d) for d in found])})
    return seqs


def path_counts(seqs: list[dict]) -> Counter:
    """How many anchors accept each rank path's prefix (the ranks of the
    continuation's tokens among the drafter's top-k, depth by depth)."""
    counts: Counter = Counter()
    for s in seqs:
        tokens, P = s["tokens"], s["prompt_len"]
        top_ids = s["top_ids"].tolist()
        for a in range(P, len(tokens) - 1):
            path: tuple[int, ...] = ()
            for d, ids in enumerate(top_ids[a - P]):
                if a + 1 + d >= len(tokens) or tokens[a + 1 + d] not in ids:
                    break
                path += (ids.index(tokens[a + 1 + d]),)
                counts[path] += 1
    return counts


def fitted_paths(counts: Counter, n: int) -> list[tuple[int, ...]]:
    """The ``n`` most frequent paths; a path is never more frequent than
    its parent, and ties go to the shorter, so parents come first."""
    return [p for p, _ in sorted(counts.items(), key=lambda kv: (-kv[1], len(kv[0]), kv[0]))[:n]]


def replay(seqs: list[dict], universe, lookup_nodes: int = 0) -> float:
    """Mean acceptance length of serving each sequence with trees of
    ``B - 1`` nodes from ``universe`` (None: the drafter's chain), a lookup
    draft taking ``lookup_nodes`` of them where there is one."""
    tokens_out = steps = 0
    for s in seqs:
        tokens, P = s["tokens"], s["prompt_len"]
        G = s["top_ids"].shape[1]
        if universe is not None:
            lk = (s["lookup"][:, :lookup_nodes], s["has_lookup"]) if lookup_nodes else (None, None)
            node_tokens, tree = build(s["top_lp"], s["top_ids"], universe, G, *lk)
            node_tokens, parents = node_tokens.tolist(), tree.parent.tolist()
        a = P
        while a < len(tokens) - 1:
            i = a - P
            if universe is None:
                n = accepted(s["top_ids"][i, :, 0].tolist(), tokens, a)
            else:
                # Walk the tree depth by depth: every child of a matched row
                # holding the next token matches (a lookup branch may repeat
                # a drafter node's token and reach deeper below it).
                k, rows = 0, {0}
                while a + 1 + k < len(tokens):
                    rows = {j + 1 for j in range(G) if parents[i][j] in rows and node_tokens[i][j] == tokens[a + 1 + k]}
                    if not rows:
                        break
                    k += 1
                n = min(1 + k, len(tokens) - 1 - a)
            tokens_out, steps, a = tokens_out + n, steps + 1, a + n
    return round(tokens_out / max(steps, 1), 3)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, prompt_lookup=False)
    p.add_argument("--prompts", default="data/prompts/dev.jsonl")
    p.add_argument("--limit", type=int)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--paths", type=int, default=128, help="rank paths the fitted universe keeps")
    p.add_argument("--write", help="write the paths fitted on --prompts here (draft_tree.json)")
    p.add_argument("--universe", help="a draft_tree.json to replay as well")
    p.add_argument("--lookup-nodes", type=int, nargs="*", default=[],
                   help="also replay the last universe with a lookup branch of each of these sizes")
    p.add_argument("--out")
    args = p.parse_args(argv)
    if args.device != "cpu":
        raise SystemExit("draft_tree runs on the CPU (fp32)")
    target, drafter = resolve_models(args)
    if drafter is None:
        raise SystemExit("a drafter is needed")
    rows = load_prompts(args.prompts, load_tokenizer(target), args.limit)
    seqs = score(target, drafter, rows, args.max_tokens)
    G = seqs[0]["top_ids"].shape[1]
    paths = with_enough_paths(fitted_paths(path_counts(seqs), args.paths), G)
    universes = {"chain": None, "generic": make_universe(generic_paths(G), G),
                 f"fitted here ({len(paths)} paths)": make_universe(paths, G)}
    if args.universe:
        universes[args.universe] = load_universe(str(Path(args.universe).parent), G) \
            if Path(args.universe).name == TREE_FILE else make_universe(json.load(open(args.universe))["paths"], G)
    report = {"target": target, "drafter": drafter, "prompts": args.prompts, "n": len(seqs),
              "max_tokens": args.max_tokens, "mean_acceptance_length": {}}
    runs = [(name, u, 0) for name, u in universes.items()]
    runs += [(f"{name} + lookup branch of {n}", u, n) for n in args.lookup_nodes for name, u in list(universes.items())[-1:]]
    for name, u, n in runs:
        report["mean_acceptance_length"][name] = replay(seqs, u, n)
        print(f"{name:60s} {report['mean_acceptance_length'][name]:.3f}", flush=True)
    if args.write:
        with open(args.write, "w") as f:
            json.dump({"fitted_on": args.prompts, "max_tokens": args.max_tokens, "paths": [list(q) for q in paths]}, f)
            f.write("\n")
    return save_report(report, args.out)


if __name__ == "__main__":
    main()
