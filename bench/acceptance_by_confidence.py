"""Where the drafter misses: whether the first draft of each speculative step
is accepted, grouped by how sure the target itself is of the token it emits
there (its probability of its own greedy token). Greedy decoding through
specray, then one target forward over each prompt + answer.

    python bench/acceptance_by_confidence.py --target DIR --drafter DIR --out conf.json
"""

from __future__ import annotations

import argparse

import torch
from specray import LLM, SamplingParams
from specray.bench import load_prompts, save_report
from specray.detokenizer import load_tokenizer

EDGES = [0.0, 0.3, 0.5, 0.7, 0.9, 0.99, 1.0 + 1e-9]


def first_draft_outcomes(out) -> list[tuple[int, bool]]:
    """(response index of the first drafted token, accepted?) per step. A step
    that starts at anchor s (a response index) drafts s+1.. and produces
    ``a`` tokens; its first draft was accepted when a >= 2."""
    res, s = [], 0
    for a in out.metrics.acceptance_lengths:
        if s + 1 >= len(out.token_ids):
            break
        res.append((s + 1, a >= 2))
        s += a
    return res


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", required=True)
    p.add_argument("--prompts", default="data/prompts/eval.jsonl")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out")
    args = p.parse_args(argv)
    from transformers import AutoModelForCausalLM

    prompts = [text for _, text in load_prompts(args.prompts, load_tokenizer(args.target))]
    outs = LLM(args.target, args.drafter, device=args.device).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens))
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    hf = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).to(args.device).eval()
    hits, counts, p_all = [0] * (len(EDGES) - 1), [0] * (len(EDGES) - 1), []
    for o in outs:
        ids = torch.tensor([o.prompt_token_ids + o.token_ids], device=args.device)
        with torch.no_grad():
            probs = hf(ids).logits[0].float().softmax(-1)
        r0 = len(o.prompt_token_ids)
        for i, accepted in first_draft_outcomes(o):
            pt = probs[r0 + i - 1, o.token_ids[i]].item()  # the logits before token i predict it
            b = next(k for k in range(len(EDGES) - 1) if EDGES[k] <= pt < EDGES[k + 1])
            hits[b] += accepted
            counts[b] += 1
            p_all.append(pt)
    steps = sum(len(o.metrics.acceptance_lengths) for o in outs)
    report = {
        "target": args.target, "drafter": args.drafter, "prompts": len(prompts), "device": args.device,
        "mean_acceptance_length": round(sum(sum(o.metrics.acceptance_lengths) for o in outs) / steps, 3),
        "first_drafts": len(p_all), "mean_target_p": round(sum(p_all) / len(p_all), 3),
        "first_draft_accepted": round(sum(hits) / len(p_all), 3),
        "by_target_p": [{"target_p": f"[{EDGES[k]:g}, {min(EDGES[k + 1], 1.0):g}{']' if k == len(EDGES) - 2 else ')'}",
                         "first_drafts": counts[k], "accepted": round(hits[k] / max(counts[k], 1), 3)}
                        for k in range(len(EDGES) - 1)],
    }
    for row in report["by_target_p"]:
        print(f"target p in {row['target_p']:12s} {row['first_drafts']:5d} first drafts, {row['accepted']:.3f} accepted")
    print(f"all: {report['first_drafts']} first drafts, {report['first_draft_accepted']:.3f} accepted, "
          f"mean target p {report['mean_target_p']}, mean acceptance length {report['mean_acceptance_length']}")
    return save_report(report, args.out)


if __name__ == "__main__":
    main()
