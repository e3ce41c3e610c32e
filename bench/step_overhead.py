"""Control overhead of a decode step, in process and through the Ray
backend: the wall time of the engine's asynchronous steps against the GPU
time of their graph replays (``profile_steps``: two CUDA events a step),
one request at a time, the same prompts and settings on both paths.

    python bench/step_overhead.py --device cuda --out results/h200_step_overhead.json

What it says: ``overhead_ms_per_step`` is how long the GPU waits for the
host each step (the step's wall time beyond its replay); the Ray backend's
extra over the in-process figure is what the actor around the engine costs.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time

from common import add_model_args, write_report
from specray import LLM, SamplingParams
from specray.bench import load_prompts
from specray.cli import resolve_models


def measure(llm, prompts, params, stats) -> dict:
    before = stats()
    t = time.perf_counter()
    outs = []
    for p in prompts:  # batch 1: one request at a time
        outs += llm.generate([p], params)
    wall = time.perf_counter() - t
    after = stats()
    steps = after["num_async_steps"] - before["num_async_steps"]
    step_wall = after["async_wall_s"] - before["async_wall_s"]
    gpu = after["async_gpu_s"] - before["async_gpu_s"]
    tokens = sum(len(o.token_ids) for o in outs)
    return {"tokens": tokens, "tok_s": tokens / wall, "async_steps": steps,
            "step_wall_ms": 1000 * step_wall / max(steps, 1), "step_gpu_ms": 1000 * gpu / max(steps, 1),
            "overhead_ms_per_step": 1000 * (step_wall - gpu) / max(steps, 1),
            "token_ids": [o.token_ids for o in outs]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, "cuda")
    p.add_argument("--prompts", default="data/prompts/eval.jsonl")
    p.add_argument("--limit", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--out")
    args = p.parse_args(argv)
    target, drafter = resolve_models(args)
    kw = dict(device=args.device, max_model_len=2048, profile_steps=True, gpu_memory_utilization=0.3)
    report = {"command": " ".join(["python"] + sys.argv), "machine": platform.node(), "target": target,
              "drafter": drafter, "max_tokens": args.max_tokens, "temperature": args.temperature, "paths": {}}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=0)
    for path in ("inprocess", "ray"):
        extra = dict(backend="ray", drafter_placement="auto") if path == "ray" else {}
        llm = LLM(target, drafter, **kw, **extra)
        try:
            prompts = [q for _, q in load_prompts(args.prompts, llm.tokenizer, args.limit)]
            stats = (lambda: llm.stats()) if path == "ray" else \
                (lambda: {"num_async_steps": llm.engine.num_async_steps, "async_wall_s": llm.engine.async_wall_s,
                          "async_gpu_s": llm.engine.async_gpu_s})
            measure(llm, prompts[:2], params, stats)  # warm: graphs captured, kernels compiled
            report["paths"][path] = measure(llm, prompts, params, stats)
        finally:
            if path == "ray":
                llm.shutdown()
    a, b = report["paths"]["inprocess"], report["paths"]["ray"]
    report["identical"] = sum(x == y for x, y in zip(a.pop("token_ids"), b.pop("token_ids")))
    report["ray_over_inprocess_tok_s"] = b["tok_s"] / a["tok_s"]
    for path, r in report["paths"].items():
        print(f"{path:9s}: {r['tok_s']:8.1f} tok/s | step {r['step_wall_ms']:.3f} ms wall, {r['step_gpu_ms']:.3f} ms "
              f"GPU -> overhead {r['overhead_ms_per_step']:.3f} ms/step over {r['async_steps']} steps")
    print(f"ray / inprocess tok/s = {report['ray_over_inprocess_tok_s']:.3f}; identical {report['identical']}/{args.limit}")
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
