"""Run prompts through the Ray backend (target TP group + drafter actor) and
report what the cluster issue asks for, measured in one run:

* tokens/s of speculative vs autoregressive decoding (same engine, same Ray
  deployment shape, requests one at a time);
* control overhead per step: wall time of a step minus the time spent in the
  model passes (the device is synchronised around them for this);
* token agreement with a reference run (e.g. the same prompts on CPU):
  ``--write-reference`` saves one, ``--reference`` compares against it.

    python examples/ray_run.py --target DIR --drafter DIR --device cuda \\
        --placement colocated --limit 16 --max-tokens 128 --out ray_gpu.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def run(llm, prompts, params):
    outs = []
    t = time.perf_counter()
    for p in prompts:
        outs += llm.generate([p], params)
    return outs, time.perf_counter() - t


def agreement(outs, ref):
    same, prefix = 0, []
    for o, r in zip(outs, ref):
        same += o == r
        n = next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), min(len(o), len(r)))
        prefix.append(n / max(len(r), 1))
    return {"identical": same, "of": len(ref), "mean_common_prefix_fraction": sum(prefix) / len(prefix)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--placement", default="separate", choices=["separate", "colocated"])
    ap.add_argument("--prompts", default="data/prompts/eval.jsonl")
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--reference")
    ap.add_argument("--write-reference")
    ap.add_argument("--cuda-graphs", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()

    from specray import LLM, SamplingParams
    from specray.bench import load_prompts
    from specray.detokenizer import load_tokenizer
    from specray.placement import ensure_ray

    ensure_ray()
    rows = load_prompts(args.prompts, load_tokenizer(args.target), args.limit)
    prompts = [t for _, t in rows]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    result = {"device": args.device, "tp": args.tp, "placement": args.placement, "prompts": len(prompts),
              "cuda_graphs": args.cuda_graphs,
              "max_tokens": args.max_tokens}
    for name, drafter in (("spec", args.drafter), ("ar", None)):
        llm = LLM(args.target, drafter, device=args.device, dtype=args.dtype, backend="ray",
                  tensor_parallel_size=args.tp, drafter_placement=args.placement, sync_timing=True,
                  max_model_len=2048, cuda_graphs=args.cuda_graphs, max_num_seqs=8)
        try:
            llm.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0))  # warm-up
            before = llm.stats()
            outs, secs = run(llm, prompts, params)
            after = llm.stats()
        finally:
            llm.shutdown()
        steps = after["num_steps"] - before["num_steps"]
        step_s = after["step_time_s"] - before["step_time_s"]
        model_s = after["model_time_s"] - before["model_time_s"]
        tokens = sum(len(o.token_ids) for o in outs)
        accept = [a for o in outs for a in o.metrics.acceptance_lengths]
        result[name] = {
            "tokens": tokens,
            "seconds": secs,
            "tokens_per_s": tokens / secs,
            "steps": steps,
            "step_ms": 1e3 * step_s / steps,
            "model_ms_per_step": 1e3 * model_s / steps,
            "control_overhead_ms_per_step": 1e3 * (step_s - model_s) / steps,
            "mean_acceptance_length": sum(accept) / len(accept) if accept else None,
            "token_ids": [o.token_ids for o in outs],
        }
        print(f"{name}: {tokens / secs:.1f} tok/s, {steps} steps, step {1e3 * step_s / steps:.2f} ms "
              f"(model {1e3 * model_s / steps:.2f} ms, control {1e3 * (step_s - model_s) / steps:.2f} ms)")
    result["speedup"] = result["spec"]["tokens_per_s"] / result["ar"]["tokens_per_s"]
    result["spec_vs_ar"] = agreement(result["spec"]["token_ids"], result["ar"]["token_ids"])
    print(f"spec vs AR: {result['speedup']:.2f}x, outputs identical {result['spec_vs_ar']}")
    if args.reference:
        ref = json.loads(Path(args.reference).read_text())["spec"]["token_ids"]
        result["vs_reference"] = agreement(result["spec"]["token_ids"], ref)
        print("agreement with the reference run:", result["vs_reference"])
    if args.write_reference:
        Path(args.write_reference).write_text(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
