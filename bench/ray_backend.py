"""The Ray backend against the in-process engine, in one run: the same
prompts and settings through ``LLM(backend="inprocess")``, the Ray backend
with the drafter colocated in rank 0 and with the drafter as its own actor,
at several batch sizes (static batches, as ``specray bench``), in rounds
that alternate the engines so that a machine's drift hits them alike.

    python bench/ray_backend.py --device cpu --batch-sizes 1 8 --out results/cpu_ray_backend.json
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch
from common import add_model_args, write_report
from specray import LLM, SamplingParams
from specray.bench import load_prompts
from specray.cli import resolve_models

PATHS = {"inprocess": {}, "ray_colocated": dict(backend="ray", drafter_placement="colocated"),
         "ray_separate": dict(backend="ray", drafter_placement="separate")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, "cpu")
    p.add_argument("--prompts", default="data/prompts/eval.jsonl")
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    p.add_argument("--cpu-threads", type=int,
                   help="torch threads of every engine process, this one and the actors (on a CPU shared with "
                        "other work, two threads per process oversubscribe the cores: the in-process engine ran "
                        "2-3x slower than with one)")
    p.add_argument("--out")
    args = p.parse_args(argv)
    if args.cpu_threads:
        # Before the actors start: they read it (workers.cpu_threads).
        os.environ["SPECRAY_CPU_THREADS"] = str(args.cpu_threads)
        torch.set_num_threads(args.cpu_threads)
    target, drafter = resolve_models(args)
    llms = {path: LLM(target, drafter, device=args.device, max_model_len=2048, max_num_seqs=max(args.batch_sizes),
                      gpu_memory_utilization=0.25, **PATHS[path]) for path in args.paths}
    report = {"command": " ".join(["python"] + sys.argv), "machine": platform.node(), "cpus": os.cpu_count(),
              "device": args.device, "torch_threads": torch.get_num_threads(),
              "max_tokens": args.max_tokens, "temperature": 0.0, "points": []}
    try:
        prompts = [q for _, q in load_prompts(args.prompts, llms[args.paths[0]].tokenizer, args.limit)]
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
        for llm in llms.values():
            llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0))
        for b in args.batch_sizes:
            rates: dict[str, list[float]] = {path: [] for path in llms}
            tokens = {}
            for _ in range(args.rounds):
                for path, llm in llms.items():
                    t, outs = time.perf_counter(), []
                    for i in range(0, len(prompts), b):
                        outs += llm.generate(prompts[i : i + b], [params] * len(prompts[i : i + b]))
                    n = sum(len(o.token_ids) for o in outs)
                    rates[path].append(n / (time.perf_counter() - t))
                    tokens[path] = [o.token_ids for o in outs]
            point = {"batch_size": b, "tok_s": {k: statistics.median(v) for k, v in rates.items()},
                     "rounds": rates}
            base = point["tok_s"].get("inprocess")
            if base:
                point["over_inprocess"] = {k: v / base for k, v in point["tok_s"].items() if k != "inprocess"}
                point["identical"] = {k: sum(a == c for a, c in zip(tokens["inprocess"], v))
                                      for k, v in tokens.items() if k != "inprocess"}
            report["points"].append(point)
            print(f"batch {b}: " + " | ".join(f"{k} {v:.1f} tok/s" for k, v in point["tok_s"].items()) +
                  ("  ratios " + " ".join(f"{k} {v:.3f}" for k, v in point.get("over_inprocess", {}).items())),
                  flush=True)
    finally:
        for llm in llms.values():
            llm.shutdown()
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
