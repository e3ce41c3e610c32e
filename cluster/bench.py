"""``specray bench``: speculative vs autoregressive decoding with the same
engine on a prompt set, one run, printed as ratios.

For every temperature: acceptance length (mean, and per draft position),
tokens/s of the speculative engine and of the same engine without a drafter,
and at temperature 0 whether the two outputs are token-identical.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from specray.cli import add_model_args, drafting_args
from specray.detokenizer import chat_prompt_ids


def load_prompts(path: str, tokenizer, limit: int | None = None) -> list[tuple[str, str | list[int]]]:
    """``(id, prompt)`` from a JSONL of ``messages`` or ``prompt`` rows (a
    ``messages`` row as its chat template's token ids, as served)."""
    rows = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        if "messages" in row:
            prompt = chat_prompt_ids(tokenizer, row["messages"])
        else:
            prompt = row["prompt"]
        rows.append((row.get("id", str(len(rows))), prompt))
    return rows[:limit] if limit else rows


def save_report(report: dict, path: str | None) -> dict:
    """Write a benchmark's report as JSON when a path is given; returns it."""
    if path:
        Path(path).write_text(json.dumps(report, indent=2))
    return report


def run_engine(llm, prompts: list[str], params: list, batch_size: int) -> tuple[list, float]:
    """Generate in groups of ``batch_size`` (1 = one request at a time);
    returns outputs and wall seconds."""
    outs = []
    t = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        outs += llm.generate(prompts[i : i + batch_size], params[i : i + batch_size])
    return outs, time.perf_counter() - t


def summarize(spec_outs, ar_outs, spec_s, ar_s, block_size: int) -> dict:
    steps = [a for o in spec_outs for a in o.metrics.acceptance_lengths]
    drafts = sum(o.metrics.num_draft_tokens for o in spec_outs)
    accepted = sum(o.metrics.num_accepted_tokens for o in spec_outs)
    per_pos = [0] * (block_size - 1)
    n_steps = 0
    for o in spec_outs:
        n_steps += len(o.metrics.acceptance_lengths)
        for i, c in enumerate(o.metrics.accepted_per_position):
            per_pos[i] += c
    spec_tokens = sum(len(o.token_ids) for o in spec_outs)
    ar_tokens = sum(len(o.token_ids) for o in ar_outs)
    identical = sum(a.token_ids == b.token_ids for a, b in zip(spec_outs, ar_outs))
    return {
        "prompts": len(spec_outs),
        "mean_acceptance_length": statistics.fmean(steps) if steps else 0.0,
        "acceptance_rate": accepted / drafts if drafts else 0.0,
        "per_position_acceptance": [c / n_steps for c in per_pos] if n_steps else [],
        "spec_tokens": spec_tokens,
        "ar_tokens": ar_tokens,
        "spec_tokens_per_s": spec_tokens / spec_s,
        "ar_tokens_per_s": ar_tokens / ar_s,
        "speedup": (spec_tokens / spec_s) / (ar_tokens / ar_s),
        "token_identical_outputs": identical,
        "lookup_step_fraction": sum(o.metrics.num_lookup_steps for o in spec_outs) / n_steps if n_steps else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # the serving benchmark: HTTP load against `specray serve`
        from specray.bench_serve import main as bench_serve

        return bench_serve(argv[1:])
    p = argparse.ArgumentParser(prog="specray bench", description=__doc__,
                                epilog="`specray bench serve --help`: the serving benchmark (HTTP load)")
    add_model_args(p)
    p.add_argument("--prompts", default="data/prompts/eval.jsonl")
    p.add_argument("--limit", type=int)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0, help="top-p of the sampled runs (T > 0)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="replay decode steps from CUDA graphs (the default on a GPU; off CUDA: the same padded path)")
    p.add_argument("--eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    if not 0 < args.top_p <= 1:
        p.error(f"--top-p must be in (0, 1], got {args.top_p}")
    if not Path(args.prompts).is_file():  # before two models load, not after
        p.error(f"--prompts {args.prompts}: no such file (the default is relative to the repository root: "
                "run from there or pass --prompts)")

    from specray import LLM, SamplingParams
    from specray.cli import resolve_models

    target, drafter = resolve_models(args)
    if drafter is None:
        print("specray bench: a drafter is needed (--drafter DIR)", file=sys.stderr)
        return 2
    # Two engines share the device: each takes a part of its memory.
    from specray.config import TargetSpec

    graphs = False if args.eager else (True if args.cuda_graphs else None)
    max_len = args.max_model_len or min(4096, TargetSpec.from_dir(target).max_position_embeddings)
    mem = dict(max_model_len=max_len, gpu_memory_utilization=0.4, cuda_graphs=graphs,
               async_scheduling=args.async_scheduling, max_num_seqs=max(8, args.batch_size))
    spec = LLM(target, drafter, device=args.device, dtype=args.dtype, num_speculative_tokens=args.num_speculative_tokens,
               **drafting_args(args), **mem)
    ar = LLM(target, None, device=args.device, dtype=args.dtype, **mem)
    rows = load_prompts(args.prompts, spec.tokenizer, args.limit)
    prompts = [text for _, text in rows]
    block = spec.engine.block_size
    def workload(temp):
        return [SamplingParams(max_tokens=args.max_tokens, temperature=temp, seed=args.seed + i, top_p=args.top_p)
                for i in range(len(prompts))]

    # Warm both engines outside the timed runs. On a GPU, with the timed
    # runs themselves: every shape they meet (prefill batches, padded batch
    # sizes, each sampling kind's step graphs) is captured and compiled
    # before timing (a warm-up of other shapes left a first-use kernel
    # compile, ~0.75 s on the H200, inside a timed batch-8 run). The CPU
    # runs eagerly: one short request each.
    for eng in (spec, ar):
        for temp in args.temperatures:
            if str(spec.config.device).startswith("cuda"):
                run_engine(eng, prompts, workload(temp), args.batch_size)
            else:
                eng.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=temp, seed=args.seed))
    results = {"target": target, "drafter": drafter, "device": args.device, "batch_size": args.batch_size,
               "cuda_graphs": spec.config.cuda_graphs, "async_scheduling": spec.config.async_scheduling, "prompt_lookup_min": spec.config.prompt_lookup_min,
               "prompt_lookup_agree": spec.config.prompt_lookup_agree,
               "draft_tree": getattr(getattr(spec, "engine", None), "tree", None) is not None,
               "num_speculative_tokens": block - 1,
               "max_tokens": args.max_tokens, "block_size": block, "top_p": args.top_p, "by_temperature": {}}
    for temp in args.temperatures:
        params = workload(temp)
        spec_outs, spec_s = run_engine(spec, prompts, params, args.batch_size)
        ar_outs, ar_s = run_engine(ar, prompts, params, args.batch_size)
        s = summarize(spec_outs, ar_outs, spec_s, ar_s, block)
        s["per_prompt"] = [
            {"id": rid, "tokens": len(o.token_ids), "mean_acceptance_length": o.metrics.mean_acceptance_length}
            for (rid, _), o in zip(rows, spec_outs)
        ]
        results["by_temperature"][str(temp)] = s
        print(
            f"T={temp}: mean acceptance length {s['mean_acceptance_length']:.2f} | "
            f"spec {s['spec_tokens_per_s']:.1f} tok/s vs AR {s['ar_tokens_per_s']:.1f} tok/s = "
            f"{s['speedup']:.2f}x | identical {s['token_identical_outputs']}/{s['prompts']} | "
            f"lookup drafts {s['lookup_step_fraction']:.0%} of steps"
        )
        print("  per-position acceptance:", " ".join(f"{x:.2f}" for x in s["per_position_acceptance"]))
    save_report(results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
