"""What a better choice of drafts could buy, measured offline.

Greedy output does not depend on the drafts, so once the target's greedy
continuation of each prompt is known, any candidate draft at any anchor
(the position of a step's first block token) is scored without serving:
it is accepted up to its first disagreement with the continuation, plus the
bonus token. This script scores, at every anchor, the drafter's block and
the prompt-lookup drafts, then replays a step sequence per policy (each
step jumps by its acceptance, as serving does):

* ``drafter``: the drafter alone (serving with ``--prompt-lookup-min 0``);
* ``lookup first``: a lookup draft whenever there is one (the engine's rule);
* ``lookup if it agrees``: a lookup draft only when its first token is the
  drafter's first token;
* ``oracle``: the better of the candidates at every step (an upper bound).

It also scores, over every anchor (teacher-forced), a second drafter pass
that is shown its own first ``j`` drafts instead of mask tokens, against
the one-pass block: whether refining a block in place could help.

    python bench/draft_policies.py --prompts data/prompts/eval.jsonl --out policies.json
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from specray import LLM, SamplingParams
from specray.bench import load_prompts, save_report
from specray.cli import add_model_args, resolve_models
from specray.detokenizer import load_tokenizer
from specray.prompt_lookup import NgramIndex

LOOKUPS = {"2..4": (2, 4), "1..4": (1, 4), "3..6": (3, 6)}


def accepted(draft: list[int], tokens: list[int], anchor: int) -> int:
    """Tokens a step anchored at ``anchor`` emits with ``draft``: the drafts
    matching the continuation, plus the bonus; no more than are left."""
    k = 0
    while k < len(draft) and anchor + 1 + k < len(tokens) and draft[k] == tokens[anchor + 1 + k]:
        k += 1
    return min(1 + k, len(tokens) - 1 - anchor)


def replay(seqs: list[dict], choose) -> dict:
    """Serve every sequence with ``choose(candidates, tokens, anchor)``:
    mean acceptance length overall and by category."""
    by_cat: dict[str, list[int]] = {}
    for s in seqs:
        tokens, a = s["tokens"], s["prompt_len"]
        while a < len(tokens) - 1:
            cand = {k: v[a - s["prompt_len"]] for k, v in s["candidates"].items()}
            n = accepted(choose(cand, tokens, a), tokens, a)
            e = by_cat.setdefault(s["category"], [0, 0])
            e[0] += n
            e[1] += 1
            a += n
    toks, steps = sum(e[0] for e in by_cat.values()), sum(e[1] for e in by_cat.values())
    return {"mean_acceptance_length": round(toks / max(steps, 1), 3), "steps": steps,
            "by_category": {c: round(t / n, 3) for c, (t, n) in by_cat.items()}}


def policies() -> dict:
    def lookup_first(key):
        return lambda c, t, a: c[key] or c["drafter"]

    def lookup_if_agrees(key):
        return lambda c, t, a: c[key] if c[key] and c[key][0] == c["drafter"][0] else c["drafter"]

    def oracle(keys):
        return lambda c, t, a: max((c[k] for k in keys), key=lambda d: accepted(d, t, a))

    out = {"drafter": lambda c, t, a: c["drafter"]}
    for name in LOOKUPS:
        out[f"lookup {name} first"] = lookup_first(name)
        out[f"lookup {name} if it agrees"] = lookup_if_agrees(name)
    out["oracle: drafter or lookup 2..4"] = oracle(["drafter", "2..4"])
    out["oracle: any"] = oracle(["drafter", *LOOKUPS])
    return out


@torch.no_grad()
def teacher_forced(target_dir: str, drafter_dir: str, rows, max_tokens: int):
    """Serve ``rows`` greedily (CPU fp32), then yield per prompt with two or
    more new tokens ``(id, output, tokens, block, logits_of)``: ``block``
    ``[1, anchors, B]`` is ``[token at a, MASK...]`` at every anchor ``a``
    of the continuation (context: the tokens before ``a``), and
    ``logits_of(block)`` the drafter's logits ``[anchors, B - 1, V]`` for
    such blocks, all anchors in one forward, as training runs them."""
    from transformers import AutoModelForCausalLM

    from specray.training.export import load_drafter
    from specray.training.model import Drafter

    llm = LLM(target_dir, None, device="cpu", dtype="float32")
    outs = llm.generate([text for _, text in rows], SamplingParams(temperature=0.0, max_tokens=max_tokens))
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    config, state = load_drafter(drafter_dir, target_dir)
    taps, B = config.dflash_config["target_layer_ids"], config.block_size
    mask_id = config.dflash_config["mask_token_id"]
    drafter = Drafter(config, max(len(o.prompt_token_ids) + len(o.token_ids) for o in outs) + B)
    drafter.load_state_dict(state, strict=False)
    drafter = drafter.float().eval()
    embed, lm_head = target.model.embed_tokens.weight, target.lm_head.weight
    for (rid, _), o in zip(rows, outs):
        P, tokens = len(o.prompt_token_ids), o.prompt_token_ids + o.token_ids
        if len(tokens) - P < 2:
            continue
        ids = torch.tensor(tokens)
        hs = target.model(input_ids=ids[None], output_hidden_states=True, use_cache=False).hidden_states
        feats = torch.cat([hs[t + 1] for t in taps], -1)  # decoder layer t's output is hidden_states[t + 1]
        anchors = torch.arange(P, len(tokens) - 1)[None]  # block [token at a, MASK...], context < a
        block = ids[(anchors[..., None] + torch.arange(B)).clamp(max=len(tokens) - 1)]
        block[..., 1:] = mask_id

        def logits_of(blk, feats=feats, anchors=anchors):
            return F.linear(drafter(feats, F.embedding(blk, embed), anchors)[:, :, 1:], lm_head)[0]

        yield rid, o, tokens, block, logits_of


@torch.no_grad()
def score(target_dir: str, drafter_dir: str, rows, max_tokens: int, feed: list[int]) -> tuple[list[dict], dict]:
    seqs, tf = [], {"one pass": [0, 0], **{f"second pass shown {j}": [0, 0] for j in feed}}
    for rid, o, tokens, block, logits_of in teacher_forced(target_dir, drafter_dir, rows, max_tokens):
        P, B = len(o.prompt_token_ids), block.shape[-1]
        first = logits_of(block).argmax(-1)  # [anchors, B-1]
        cand = {"drafter": first.tolist()}
        for name, (lo, hi) in LOOKUPS.items():
            index = NgramIndex(lo, hi)
            found = [index.propose(o.prompt_token_ids, o.token_ids[: a - P + 1], B - 1)
                     for a in range(P, len(tokens) - 1)]
            # padded with its last token to the block, as merge_lookup_drafts does
            cand[name] = [(d + d[-1:] * (B - 1))[: B - 1] for d in found]
        seqs.append({"id": rid, "category": rid.split("-")[1] if rid.count("-") >= 2 else "all",
                     "prompt_len": P, "tokens": tokens, "candidates": cand})
        variants = {"one pass": first}
        for j in feed:
            shown = block.clone()
            shown[0, :, 1 : 1 + j] = first[:, :j]
            second = logits_of(shown).argmax(-1)
            second[:, :j] = first[:, :j]
            variants[f"second pass shown {j}"] = second
        for name, d in variants.items():
            for i, a in enumerate(range(P, len(tokens) - 1)):
                tf[name][0] += accepted(d[i].tolist(), tokens, a)
                tf[name][1] += 1
    return seqs, {k: round(t / max(n, 1), 3) for k, (t, n) in tf.items()}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, prompt_lookup=False)
    p.add_argument("--prompts", default="data/prompts/eval.jsonl")
    p.add_argument("--limit", type=int)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--feed", type=int, nargs="*", default=[1, 2, 4],
                   help="second-pass variants: how many of its own drafts the drafter is shown")
    p.add_argument("--out")
    args = p.parse_args(argv)
    if args.device != "cpu":
        raise SystemExit("draft_policies runs on the CPU (fp32): the scores must match CPU serving exactly")
    target, drafter = resolve_models(args)
    if drafter is None:
        raise SystemExit("a drafter is needed")
    rows = load_prompts(args.prompts, load_tokenizer(target), args.limit)
    seqs, teacher_forced = score(target, drafter, rows, args.max_tokens, args.feed)
    report = {"target": target, "drafter": drafter, "prompts": args.prompts, "n": len(seqs),
              "max_tokens": args.max_tokens, "policies": {}, "teacher_forced_all_anchors": teacher_forced}
    for name, choose in policies().items():
        r = report["policies"][name] = replay(seqs, choose)
        print(f"{name:34s} {r['mean_acceptance_length']:.3f}  {r['by_category']}")
    print("teacher-forced over every anchor:", teacher_forced)
    return save_report(report, args.out)


if __name__ == "__main__":
    main()
