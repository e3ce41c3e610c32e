"""What prompt-lookup drafts add to the drafter's: decoding of a prompt set
with the drafter alone and with lookups at each ``min,max`` n-gram
setting; mean acceptance length (overall and by category), the share of
steps that drafted from a lookup, and whether the tokens stay those of the
drafter alone (greedy: they must, both are the target's greedy output;
sampled: they need not, only their distribution is the target's). At a
temperature above 0 the lookups are forced on (``prompt_lookup_sampled``),
which is what this measures.

    python bench/prompt_lookup.py --prompts data/prompts/dev.jsonl --settings 2,4 1,4 3,6 --out lookup.json
"""

from __future__ import annotations

import argparse
import time

from specray import LLM, SamplingParams
from specray.bench import load_prompts, save_report
from specray.cli import add_model_args, resolve_models


def run(target, drafter, args, rows, lo: int, hi: int) -> tuple[dict, list]:
    llm = LLM(target, drafter, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
              prompt_lookup_min=lo, prompt_lookup_max=max(hi, lo), prompt_lookup_sampled=True,
              prompt_lookup_agree=args.agree)
    t = time.perf_counter()
    params = [SamplingParams(temperature=args.temperature, seed=i, max_tokens=args.max_tokens)
              for i in range(len(rows))]
    outs = llm.generate([text for _, text in rows], params)
    seconds = time.perf_counter() - t
    by_cat: dict[str, list[int]] = {}
    for (rid, _), o in zip(rows, outs):
        cat = rid.split("-")[1] if rid.count("-") >= 2 else "all"
        e = by_cat.setdefault(cat, [0, 0])
        e[0] += sum(o.metrics.acceptance_lengths)
        e[1] += len(o.metrics.acceptance_lengths)
    steps = sum(e[1] for e in by_cat.values())
    return {
        "prompt_lookup_min": lo, "prompt_lookup_max": hi,
        "mean_acceptance_length": round(sum(e[0] for e in by_cat.values()) / steps, 3),
        "by_category": {c: round(a / n, 3) for c, (a, n) in by_cat.items()},
        "steps": steps,
        "lookup_step_fraction": round(sum(o.metrics.num_lookup_steps for o in outs) / steps, 3),
        "seconds": round(seconds, 1),
    }, [o.token_ids for o in outs]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, prompt_lookup=False)  # --settings chooses
    p.add_argument("--prompts", default="data/prompts/eval.jsonl")
    p.add_argument("--limit", type=int)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--settings", nargs="+", default=["2,4"], help="min,max n-gram lengths to try")
    p.add_argument("--agree", action="store_true",
                   help="a greedy row takes its lookup only where it opens with the drafter's first draft "
                        "(the async engine's default rule)")
    p.add_argument("--out")
    args = p.parse_args(argv)
    target, drafter = resolve_models(args)
    if drafter is None:
        raise SystemExit("a drafter is needed")
    from specray.detokenizer import load_tokenizer

    rows = load_prompts(args.prompts, load_tokenizer(target), args.limit)
    base, base_tokens = run(target, drafter, args, rows, 0, 0)
    print(f"drafter alone: mean acceptance length {base['mean_acceptance_length']} {base['by_category']}")
    report = {"target": target, "drafter": drafter, "prompts": args.prompts, "n": len(rows), "device": args.device,
              "max_tokens": args.max_tokens, "temperature": args.temperature, "agree": args.agree,
              "drafter_alone": base, "with_lookup": []}
    for setting in args.settings:
        lo, hi = (int(x) for x in setting.split(","))
        r, tokens = run(target, drafter, args, rows, lo, hi)
        r["identical_to_drafter_alone"] = sum(a == b for a, b in zip(tokens, base_tokens))
        report["with_lookup"].append(r)
        print(f"lookup {lo}..{hi}: mean acceptance length {r['mean_acceptance_length']} "
              f"({r['mean_acceptance_length'] / base['mean_acceptance_length']:.3f}x), lookup drafts on "
              f"{r['lookup_step_fraction']:.0%} of steps, {r['by_category']}, "
              f"identical {r['identical_to_drafter_alone']}/{len(rows)}")
    return save_report(report, args.out)


if __name__ == "__main__":
    main()
