"""Micro-batch overlap against the serial schedule, in one run: the same
engine and prompts with ``overlap`` off (one chain of step graphs) and on
(two lanes of half the batch, each on a CUDA stream of its own), greedy, at
several batch sizes; plus a profiler timeline of the overlapped schedule
that says how much of each lane's drafter work ran under the other lane's
kernels.

    python bench/overlap.py --device cuda --batch-sizes 8 16 32 64 --out results/h200_overlap.json

``--backend ray`` runs the engine inside the Ray backend's rank-0 actor
(drafter colocated), the path ``specray serve`` takes; the timeline is taken
in process.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

from common import add_model_args, write_report
from specray import LLM, SamplingParams
from specray.bench import load_prompts
from specray.cli import resolve_models

# Kernels only the drafter launches (its block attention, its context store's K/V).
DRAFTER_KERNELS = ("dflash_block_attention", "context_kv")


def run(llm, prompts, params, batch: int) -> tuple[float, list]:
    """Static batches of ``batch`` requests, as ``specray bench`` runs them."""
    t, outs = time.perf_counter(), []
    for i in range(0, len(prompts), batch):
        outs += llm.generate(prompts[i : i + batch], params[i : i + batch])
    return time.perf_counter() - t, outs


def timeline(llm, prompts, params) -> dict:
    """Kernel time on each stream and the share of it that ran while the
    other stream had a kernel running, from a profiler trace of one batch."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        events = json.load(open(path))["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    streams: dict[int, list] = {}
    for e in kernels:
        streams.setdefault(e["args"].get("stream"), []).append((e["ts"], e["ts"] + e["dur"], e["name"]))
    busy = sorted(streams, key=lambda s: -sum(b - a for a, b, _ in streams[s]))[:2]
    out = {"streams": len(streams), "kernels": len(kernels)}
    if len(busy) < 2:
        return out | {"note": "one stream ran kernels: no lane overlapped"}

    def merged(iv):
        res = []
        for a, b, _ in sorted(iv):
            if res and a <= res[-1][1]:
                res[-1][1] = max(res[-1][1], b)
            else:
                res.append([a, b])
        return res

    def covered(a, b, other):  # time of [a, b) inside the other stream's busy intervals
        return sum(max(0, min(b, y) - max(a, x)) for x, y in other if x < b and y > a)

    lanes = {}
    for s, o in ((busy[0], busy[1]), (busy[1], busy[0])):
        other = merged(streams[o])
        total = sum(b - a for a, b, _ in streams[s])
        drafter = [(a, b) for a, b, n in streams[s] if any(k in n for k in DRAFTER_KERNELS)]
        lanes[str(s)] = {
            "kernel_us": total,
            "overlapped_share": sum(covered(a, b, other) for a, b, _ in streams[s]) / max(total, 1e-9),
            "drafter_kernel_us": sum(b - a for a, b in drafter),
            "drafter_overlapped_share": sum(covered(a, b, other) for a, b in drafter) /
            max(sum(b - a for a, b in drafter), 1e-9),
        }
    return out | {"lanes": lanes}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, "cuda")
    p.add_argument("--backend", choices=["inprocess", "ray"], default="inprocess")
    p.add_argument("--prompts", nargs="+", default=["data/prompts/eval.jsonl", "data/prompts/dev.jsonl"])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--rounds", type=int, default=2, help="prompts per run: rounds x batch size")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--timeline-batch", type=int, default=16)
    p.add_argument("--out")
    args = p.parse_args(argv)
    target, drafter = resolve_models(args)
    report = {"command": " ".join(["python"] + sys.argv), "machine": platform.node(), "backend": args.backend,
              "max_tokens": args.max_tokens, "temperature": 0.0, "points": []}
    llms = {}
    for overlap in (False, True):
        kw = dict(device=args.device, max_model_len=2048, max_num_seqs=max(args.batch_sizes), overlap=overlap,
                  overlap_min_batch=2, gpu_memory_utilization=0.35)
        if args.backend == "ray":
            kw.update(backend="ray", drafter_placement="colocated")
        llms[overlap] = LLM(target, drafter, **kw)
    try:
        rows = []
        for f in args.prompts:
            rows += [q for _, q in load_prompts(f, llms[False].tokenizer)]
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
        for llm in llms.values():  # warm every batch size's graphs
            for b in args.batch_sizes:
                run(llm, rows[:b], [SamplingParams(max_tokens=24, temperature=0)] * b, b)
        for b in args.batch_sizes:
            n = args.rounds * b
            prompts = [rows[i % len(rows)] for i in range(n)]
            point = {"batch_size": b, "requests": n}
            outs = {}
            for overlap, llm in llms.items():
                secs, outs[overlap] = run(llm, prompts, [params] * n, b)
                tokens = sum(len(o.token_ids) for o in outs[overlap])
                point["overlap" if overlap else "serial"] = {"tok_s": tokens / secs, "tokens": tokens}
            point["identical"] = sum(a.token_ids == c.token_ids for a, c in zip(outs[False], outs[True]))
            point["overlap_over_serial"] = point["overlap"]["tok_s"] / point["serial"]["tok_s"]
            report["points"].append(point)
            print(f"batch {b:3d}: serial {point['serial']['tok_s']:8.1f} tok/s | overlap "
                  f"{point['overlap']['tok_s']:8.1f} tok/s = {point['overlap_over_serial']:.3f}x | identical "
                  f"{point['identical']}/{n}", flush=True)
        if args.backend == "inprocess" and args.device.startswith("cuda"):
            b = args.timeline_batch
            report["timeline"] = {"batch_size": b, **timeline(llms[True], rows[:b], [params] * b)}
            print("timeline:", json.dumps(report["timeline"]))
    finally:
        for llm in llms.values():
            llm.shutdown()
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
