"""Engine settings against each other in one process: every variant and the
autoregressive baseline run the same prompt set in turn, several passes,
so machine drift lands on all of them alike. Prints each pass's
speculative / autoregressive ratio per variant.

    python bench/ab_engines.py --cuda-graphs --async-scheduling \\
        --variant lookup2:prompt_lookup_min=2 --variant lookup1:prompt_lookup_min=1 \\
        --prompts data/prompts/eval.jsonl data/prompts/dev.jsonl --passes 3 --out ab.json

A variant is ``name:key=value,key=value`` over ``LLM`` keyword arguments
and ``SamplingParams`` fields (ints, floats, true/false, none): what a
feature of a request costs, e.g. ``--variant lp:logprobs=5``. Every
variant shares the model flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from specray.bench import load_prompts, run_engine, save_report


def parse_variant(text: str) -> tuple[str, dict]:
    name, _, body = text.partition(":")
    if not name:
        raise argparse.ArgumentTypeError(f"variant {text!r}: give it a name (name:key=value,...)")
    kw = {}
    for item in filter(None, body.split(",")):
        key, sep, raw = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"variant {text!r}: {item!r} is not key=value")
        low = raw.lower()
        if low in ("true", "false"):
            value = low == "true"
        elif low == "none":
            value = None
        else:
            try:
                value = int(raw)
            except ValueError:
                try:
                    value = float(raw)
                except ValueError:
                    value = raw
        kw[key] = value
    return name, kw


def main(argv: list[str] | None = None) -> int:
    from specray.cli import add_model_args

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, prompt_lookup=False)
    p.add_argument("--variant", type=parse_variant, action="append", required=True)
    p.add_argument("--prompts", nargs="+", default=["data/prompts/eval.jsonl"])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--cuda-graphs", action="store_true")
    p.add_argument("--async-scheduling", action="store_true")
    p.add_argument("--out")
    args = p.parse_args(argv)
    for path in args.prompts:
        if not Path(path).is_file():
            p.error(f"--prompts {path}: no such file")

    from specray import LLM, SamplingParams
    from specray.cli import resolve_models

    target, drafter = resolve_models(args)
    if drafter is None:
        p.error("a drafter is needed")
    from specray.config import TargetSpec

    max_len = args.max_model_len or min(4096, TargetSpec.from_dir(target).max_position_embeddings)
    share = 0.8 / (len(args.variant) + 1)
    common = dict(device=args.device, dtype=args.dtype, max_model_len=max_len,
                  gpu_memory_utilization=share, cuda_graphs=True if args.cuda_graphs else None,
                  async_scheduling=args.async_scheduling)
    request_fields = {f.name for f in dataclasses.fields(SamplingParams)}
    request_kw = {name: {k: v for k, v in kw.items() if k in request_fields} for name, kw in args.variant}
    # A variant's engine settings override the shared ones (e.g. async_scheduling=false).
    engines = {name: LLM(target, drafter, num_speculative_tokens=args.num_speculative_tokens,
                         **{**common, **{k: v for k, v in kw.items() if k not in request_fields}})
               for name, kw in args.variant}
    engines["ar"] = LLM(target, None, **common)
    request_kw["ar"] = {}
    tok = next(iter(engines.values())).tokenizer
    sets = {Path(path).stem: [text for _, text in load_prompts(path, tok)] for path in args.prompts}

    def params(name, n):
        return [SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=i, **request_kw[name])
                for i in range(n)]

    for prompts in sets.values():  # capture and compile every shape before timing
        for name, llm in engines.items():
            run_engine(llm, prompts, params(name, len(prompts)), 1)
    report = {"target": target, "drafter": drafter, "variants": dict(args.variant), "max_tokens": args.max_tokens,
              "temperature": args.temperature, "passes": []}
    for i in range(args.passes):
        for set_name, prompts in sets.items():
            row = {"pass": i, "set": set_name}
            outs = {}
            for name, llm in engines.items():
                outs[name], secs = run_engine(llm, prompts, params(name, len(prompts)), 1)
                tokens = sum(len(o.token_ids) for o in outs[name])
                steps = [a for o in outs[name] for a in o.metrics.acceptance_lengths]
                row[name] = {"tokens_per_s": tokens / secs,
                             "mean_acceptance_length": sum(steps) / len(steps) if steps else 1.0}
            for name in engines:
                if name == "ar":
                    continue
                row[name]["speedup"] = row[name]["tokens_per_s"] / row["ar"]["tokens_per_s"]
                if args.temperature == 0:
                    row[name]["identical"] = sum(a.token_ids == b.token_ids for a, b in zip(outs[name], outs["ar"]))
            report["passes"].append(row)
            print(f"pass {i} {set_name}: " + " | ".join(
                f"{n} {r['mean_acceptance_length']:.3f} {r['tokens_per_s']:.0f} tok/s"
                + (f" = {r['speedup']:.3f}x" if "speedup" in r else "")
                + (f" ({r['identical']}/{len(prompts)} identical)" if "identical" in r else "")
                for n, r in ((n, row[n]) for n in engines)), flush=True)
    save_report(report, args.out)
    print(json.dumps({n: round(sum(r[n]["speedup"] for r in report["passes"]) / len(report["passes"]), 4)
                      for n in engines if n != "ar"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
