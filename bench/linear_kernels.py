"""A decoder layer's projections at one row (a batch-1 decode step) and at
16 (a verify block): the few-row kernels (``kernels/linear_triton.py``)
against cuBLAS with the separate norm and activation kernels, per
projection of a model's shape, one run:

* each projection as the model runs it: QKV and gate/up with the norm
  before them (``norm_linear``), o (``linear``), down with ``silu * up``
  (``silu_mul_linear``); the reference is ``rms_norm`` + ``F.linear`` etc.;
* time per call from CUDA events around graph replays, cycling through
  enough copies of the weight that none is read from L2;
* ``--tune``: every kernel configuration of a small grid, the fastest kept
  (printed as ``CONFIGS`` entries for ``linear_triton``).

    python bench/linear_kernels.py --shape qwen3-8b --tune --out results/h200_linear_kernels_qwen3_8b.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import copy_bandwidth, write_report

from specray.kernels import linear_triton

# hidden, q heads, kv heads, head dim, intermediate
SHAPES = {"qwen3-8b": (4096, 32, 8, 128, 12288), "qwen3-32b": (5120, 64, 8, 128, 25600),
          "smollm2-135m": (576, 9, 3, 64, 1536)}
GRID = [(bn, bk, 4, st) for bn, bk, st in itertools.product([16, 32, 64], [64, 128, 256, 512], [3, 4])]
GRID_QUICK = [(bn, bk, 4, 4) for bn, bk in itertools.product([16, 32, 64], [128, 256])]


def projections(shape: str) -> list[tuple[str, int, int, int]]:
    """(name, kernel kind, N, K) of one decoder layer."""
    H, nq, nkv, D, inter = SHAPES[shape]
    L = linear_triton
    return [("qkv", L.NORM, (nq + 2 * nkv) * D, H), ("o", L.PLAIN, H, nq * D),
            ("gate_up", L.NORM, 2 * inter, H), ("down", L.SILU, H, inter)]


def call_us(fn, calls: int, replays: int = 20) -> float:
    """Microseconds a call of ``fn(i)`` (``i`` cycles the weight copies),
    replayed as a CUDA graph of ``calls`` calls."""
    for i in range(calls):  # compile, warm
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1000 * start.elapsed_time(end) / (replays * calls)


def bench_projection(kind: int, N: int, K: int, rows: int, dtype, grid, bandwidth: float) -> dict:
    dev = torch.device("cuda")
    wbytes = N * K * torch.finfo(dtype).bits // 8
    copies = max(2, -(-(512 << 20) // wbytes))  # > 2x any L2
    ws = [torch.randn(N, K, device=dev, dtype=dtype) * K ** -0.5 for _ in range(copies)]
    x = torch.randn(rows, 2 * K if kind == linear_triton.SILU else K, device=dev, dtype=dtype)
    r = torch.randn(rows, K, device=dev, dtype=dtype)
    g = torch.ones(K, device=dev, dtype=dtype)

    def kernel(i):
        w = ws[i % copies]
        if kind == linear_triton.NORM:
            return linear_triton.norm_linear(x, g, 1e-6, r, w)
        return (linear_triton.silu_mul_linear if kind == linear_triton.SILU else linear_triton.linear)(x, w)

    def reference(i):
        w = ws[i % copies]
        if kind == linear_triton.NORM:
            return torch.nn.functional.linear(fused_rms(x, g, r), w)
        return torch.nn.functional.linear(fused_silu(x) if kind == linear_triton.SILU else x, w)

    calls = 2 * copies
    ref_us = call_us(reference, calls)
    key = (N, K)
    tried = []
    for cfg in grid:
        linear_triton.CONFIGS[key] = cfg
        try:
            tried.append((call_us(kernel, calls), cfg))
        except Exception as e:  # a configuration the compiler refuses (registers, shared memory)
            print(f"  {cfg}: {type(e).__name__}", file=sys.stderr)
    # Against the configuration in force without this sweep: the default,
    # or one an earlier sweep (at fewer rows) set.
    kept = linear_triton.CONFIGS.pop(key, None)
    if not grid and kept:
        linear_triton.CONFIGS[key] = kept
    base_us = call_us(kernel, calls)
    best_us, best = min(tried) if tried else (base_us, linear_triton.config(N, K))
    if best_us < base_us:
        linear_triton.CONFIGS[key] = best
    else:
        best_us, best = base_us, linear_triton.config(N, K)
    ideal_us = 1e6 * wbytes / bandwidth
    return {"N": N, "K": K, "rows": rows, "weight_MB": round(wbytes / 1e6, 1),
            "kernel_us": round(best_us, 2), "config": list(best), "untuned_us": round(base_us, 2),
            "cublas_unfused_us": round(ref_us, 2), "kernel_over_cublas": round(best_us / ref_us, 3),
            "kernel_of_copy_bandwidth": round(ideal_us / best_us, 3),
            "cublas_of_copy_bandwidth": round(ideal_us / ref_us, 3)}


def fused_rms(x, g, r):
    from specray.kernels import ops

    return ops.rms_norm(x, g, 1e-6, r)[0]


def fused_silu(x):
    from specray.kernels import ops

    return ops.silu_mul(x)


def tune(shape: str, dtype=torch.bfloat16, rows=(1, 16), grid=None, bandwidth: float | None = None) -> dict:
    """Each projection of ``shape``: the fastest configuration of ``grid``
    at the first of ``rows`` (set in ``linear_triton.CONFIGS`` for this
    process), then that configuration at the other row counts; each against
    cuBLAS."""
    bandwidth = bandwidth or copy_bandwidth("cuda")
    out = {}
    for i, m in enumerate(rows):
        for name, kind, N, K in projections(shape):
            g = (GRID if grid is None else grid) if i == 0 else []
            out[f"{name}@{m}"] = r = bench_projection(kind, N, K, m, dtype, g, bandwidth)
            print(name, json.dumps(r), file=sys.stderr)
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16], help="tuned at the first (at most "
                   f"{linear_triton.MAX_ROWS})")
    p.add_argument("--tune", action="store_true", help="sweep the configuration grid (else the defaults)")
    p.add_argument("--quick", action="store_true", help="with --tune: a smaller grid")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    bandwidth = copy_bandwidth("cuda")
    grid = (GRID_QUICK if args.quick else GRID) if args.tune else []
    per = tune(args.shape, rows=args.rows, grid=grid, bandwidth=bandwidth)
    layer = {}
    for m in args.rows:
        mine = [v for v in per.values() if v["rows"] == m]
        kernel_us, ref_us = sum(v["kernel_us"] for v in mine), sum(v["cublas_unfused_us"] for v in mine)
        layer[m] = {"kernel_us": round(kernel_us, 2), "cublas_unfused_us": round(ref_us, 2),
                    "kernel_over_cublas": round(kernel_us / ref_us, 3)}
    report = {"shape": args.shape, "rows": args.rows, "device": torch.cuda.get_device_name(),
              "copy_bandwidth_TBps": round(bandwidth / 1e12, 3), "projections": per, "layer": layer,
              "configs": {f"({v['N']}, {v['K']})": v["config"] for v in per.values() if v["rows"] == args.rows[0]},
              "command": "python " + " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:])}
    print(json.dumps(report, indent=2))
    write_report(args.out, report)
    return report


if __name__ == "__main__":
    main()
