"""Where a decode step's time goes: wall time per step, GPU busy time per
step, and the host-side work around the model passes, for the speculative
engine and the same engine without a drafter (one prompt, batch 1 or ``--batch-size`` copies).

    python bench/profile_step.py --target DIR --drafter DIR --cuda-graphs --out prof.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

from specray import LLM, SamplingParams


def profile_engine(llm: LLM, prompt: str, steps: int, temperature: float = 0.0, batch_size: int = 1,
                   top_p: float = 1.0) -> dict:
    core = llm.engine
    for i in range(batch_size):
        params = SamplingParams(temperature=temperature, top_p=top_p, seed=i, max_tokens=10_000, ignore_eos=True)
        core.add_request(prompt, params)
    for _ in range(8):  # prefill + warm-up (graph capture)
        core.step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            core.step()
        torch.cuda.synchronize()
    wall = time.perf_counter() - t
    acc = []
    for req in list(core.requests.values()):
        acc += req.metrics.acceptance_lengths[-steps:]
        core.abort_request(req.request_id)
    events = prof.events()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_us = sum(e.device_time for e in kernels)
    launches = sum(1 for e in events if e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    copies = sum(1 for e in events if e.name.startswith("cudaMemcpy"))
    graph_launches = sum(1 for e in events if e.name == "cudaGraphLaunch")
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    # Which kernels the GPU time goes to (inside graphs too: CUPTI records
    # their kernels), and how many run a step: at this model size a kernel's
    # fixed cost, not its bytes, sets the step's GPU time.
    by_kernel: dict[str, list[float]] = {}
    for e in kernels:
        by_kernel.setdefault(e.name, []).append(e.device_time)
    top = sorted(by_kernel.items(), key=lambda kv: -sum(kv[1]))[:30]
    return {
        "steps": steps,
        "wall_ms_per_step": round(1000 * wall / steps, 3),
        "gpu_kernel_ms_per_step": round(gpu_us / 1000 / steps, 3),
        "kernel_launches_per_step": round(launches / steps, 1),
        "graph_launches_per_step": round(graph_launches / steps, 2),
        "memcpy_calls_per_step": round(copies / steps, 1),
        "mean_acceptance_length": round(sum(acc) / max(len(acc), 1), 3),
        "ms_per_token": round(1000 * wall / max(sum(acc), 1), 3),  # over the batch's tokens
        "gpu_kernels_per_step": round(len(kernels) / steps, 1),
        "kernels_by_gpu_time": [
            {"name": name[:120], "per_step": round(len(ts) / steps, 2), "us_per_step": round(sum(ts) / steps, 1),
             "mean_us": round(sum(ts) / len(ts), 2)}
            for name, ts in top
        ],
        "cpu_table": table,
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", required=True)
    p.add_argument("--cuda-graphs", action="store_true")
    p.add_argument("--async-scheduling", action="store_true")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--num-speculative-tokens", type=int, help="drafts per step (default: the drafter's block - 1)")
    p.add_argument("--prompt", default="Explain why the sky is blue, in a few paragraphs.")
    p.add_argument("--no-draft-tree", action="store_true", help="verify chains (draft_tree=False)")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    res = {"temperature": args.temperature, "top_p": args.top_p, "batch_size": args.batch_size,
           "num_speculative_tokens": args.num_speculative_tokens}
    for name, drafter in (("spec", args.drafter), ("ar", None)):
        llm = LLM(args.target, drafter, device="cuda", cuda_graphs=args.cuda_graphs, max_num_seqs=max(8, args.batch_size),
                  async_scheduling=args.async_scheduling, gpu_memory_utilization=0.3,
                  num_speculative_tokens=args.num_speculative_tokens,
                  draft_tree=False if args.no_draft_tree else None)
        res[name] = profile_engine(llm, args.prompt, args.steps, args.temperature, args.batch_size, args.top_p)
        del llm
        torch.cuda.empty_cache()
    for name in ("spec", "ar"):
        r = res[name]
        print(f"== {name}: " + ", ".join(f"{k} {v}" for k, v in r.items() if k != "cpu_table"))
        print(r["cpu_table"])
        for k in r["kernels_by_gpu_time"]:
            print(f"  {k['us_per_step']:8.1f} us/step  {k['per_step']:6.2f}/step  {k['mean_us']:7.2f} us  {k['name']}")
    s, a = res["spec"], res["ar"]
    print(f"spec step / AR step: {s['wall_ms_per_step'] / a['wall_ms_per_step']:.2f}x wall, "
          f"{s['gpu_kernel_ms_per_step'] / a['gpu_kernel_ms_per_step']:.2f}x GPU kernel time")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
