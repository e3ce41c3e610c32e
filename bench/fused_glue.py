"""The fused layer glue (``kernels/fused_triton.py``) against its PyTorch
references on the same model and GPU: batch-1 autoregressive decode with
CUDA graphs, the references first, then the fused kernels, one run. Also
prints the weight bytes read per token over the step time, against the
device's copy bandwidth (measured in the same run).

    python bench/fused_glue.py --target DIR --out fused.json
    python bench/fused_glue.py --random-shape qwen3-8b --ckpt-dir /tmp/rc --out fused_8b.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_target_args, ar_decode_s, copy_bandwidth, resolve_target

from specray import LLM
from specray.kernels import ops


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    add_target_args(p)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    target = resolve_target(args)
    bandwidth = copy_bandwidth()
    res = {"target": target, "copy_bandwidth_TBps": round(bandwidth / 1e12, 3)}
    fused = ops._fused
    for name, kernels in (("references", None), ("fused", fused)):
        ops._fused = kernels  # graphs capture whichever ops are live at their first step
        try:
            llm = LLM(target, None, device="cuda", cuda_graphs=True, max_model_len=1024, max_num_seqs=4,
                      gpu_memory_utilization=0.5)
            step = ar_decode_s(llm, args.steps, warmup=8)
            weights = llm.engine.target.weight_bytes
        finally:
            ops._fused = fused
        res[name] = {"step_ms": round(step * 1e3, 4), "tokens_per_s": round(1 / step, 1),
                     "weight_GB": round(weights / 1e9, 3), "weights_TBps": round(weights / step / 1e12, 3),
                     "of_copy_bandwidth": round(weights / step / bandwidth, 3)}
        print(f"{name}: {res[name]}")
        del llm
        torch.cuda.empty_cache()
    res["fused_speedup"] = round(res["references"]["step_ms"] / res["fused"]["step_ms"], 3)
    print(f"fused / references: {res['fused_speedup']}x tokens/s; copy bandwidth {res['copy_bandwidth_TBps']} TB/s")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
