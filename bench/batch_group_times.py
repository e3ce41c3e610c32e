"""Where a batched `specray bench` run spends its time, group by group.

Batch 8 (or --batch-size), T=0, the eval prompts in groups as the bench
runs them, warmed as the bench warmed before it took the timed workload as
its warm-up (each prompt's prefill alone, then one group of rows finishing
one by one). Prints each group's wall time and the time in synchronous
steps, async launches and applies, and the drafter's context store: a
group far slower than the others is a one-off (a first-use compile or
capture), not the steady state.

    python bench/batch_group_times.py LABEL --target DIR --drafter DIR [--ar]

Run it twice in fresh processes to tell a compile (cached on disk, gone
the second time) from a capture or a real cost.
"""

from __future__ import annotations

import argparse
import collections
import json
import time

import torch

import specray.engine as engine_module
from specray import LLM, SamplingParams
from specray.bench import load_prompts
from specray.config import TargetSpec
from step_phases import timer


def group_times(llm: LLM, prompts: list, batch_size: int, max_tokens: int) -> dict:
    core = llm.engine
    B = core.block_size
    for p in prompts:
        llm.generate([p], SamplingParams(max_tokens=1))
    llm.generate(prompts[:batch_size], [SamplingParams(max_tokens=4 * B + 8 * i, temperature=0, ignore_eos=True)
                                        for i in range(batch_size)])
    spent, calls = collections.defaultdict(float), collections.Counter()
    timed = timer(spent, calls)

    for name in ("_apply_inflight", "_sync_step"):
        setattr(core, name, timed(name, getattr(core, name)))
    if core.drafter is not None:
        core.drafter.store_context = timed("store_context", core.drafter.store_context)
    launch = engine_module.launch_decode
    engine_module.launch_decode = timed("launch_decode", launch)
    groups, tokens = [], 0
    t = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        tg = time.perf_counter()
        outs = llm.generate(prompts[i : i + batch_size], SamplingParams(max_tokens=max_tokens, temperature=0))
        groups.append(round(1000 * (time.perf_counter() - tg), 1))
        tokens += sum(len(o.token_ids) for o in outs)
    wall = time.perf_counter() - t
    engine_module.launch_decode = launch
    return {"tokens": tokens, "wall_s": round(wall, 3), "tok_s": round(tokens / wall), "group_ms": groups,
            "calls": dict(calls), "ms": {k: round(1000 * v, 1) for k, v in spent.items()}}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("label")
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", required=True)
    p.add_argument("--ar", action="store_true", help="also the engine without the drafter")
    p.add_argument("--prompts", default="data/prompts/eval.jsonl")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    max_len = min(4096, TargetSpec.from_dir(args.target).max_position_embeddings)  # as specray bench sets it
    for name, drafter in (("spec", args.drafter),) + ((("ar", None),) if args.ar else ()):
        llm = LLM(args.target, drafter, device=args.device, dtype="bfloat16" if args.device != "cpu" else None,
                  cuda_graphs=True, async_scheduling=True, max_model_len=max_len,
                  max_num_seqs=max(8, args.batch_size), gpu_memory_utilization=0.4)
        prompts = [text for _, text in load_prompts(args.prompts, llm.tokenizer)]
        print(args.label, name, json.dumps(group_times(llm, prompts, args.batch_size, args.max_tokens)))
        del llm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
