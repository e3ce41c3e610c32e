"""How close a target's decode step runs to the GPU's memory bandwidth, and
what verifying a block costs against one autoregressive row, one run:

* the device's copy bandwidth (a 2 GiB device-to-device copy, read + write);
* the target's forward at batch 1 replayed as a CUDA graph, 1 row (an
  autoregressive step) and ``--block`` rows (a chain's verify block), over a
  context of ``--context`` tokens: CUDA events around ``--replays`` replays;
* the engine's whole autoregressive step at batch 1 (asynchronous step
  graphs: forward, sampling, the host's apply), wall time per token;
* with ``--tune-linear SHAPE``, the few-row projection kernels on (their
  configurations tuned first for the shape's projections,
  ``bench/linear_kernels.py``), and the AR and verify forwards again with
  them off (cuBLAS and the separate norm and activation kernels):
  ``*_cublas_ms``.

Bytes read a step are the weights (less an untied embedding table, of
which a step reads one row) plus the context's K/V. ``of_copy_bandwidth`` is those bytes
over the step time, over the copy bandwidth.

    python bench/decode_efficiency.py --random-shape qwen3-8b --out results/h200_decode_efficiency_qwen3_8b.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_target_args, ar_decode_s, copy_bandwidth, resolve_target, sync

from specray import LLM
from specray.actors.graphs import DecodeGraphs
from specray.actors.target import chunk_padding
from specray.kernels import ops


def checkpoint_bytes(path: str, itemsize: int) -> int:
    """The checkpoint's weights at ``itemsize`` bytes an element (what the
    engine holds; counted from the files, which the CPU's allocator does not report)."""
    from safetensors import safe_open

    n = 0
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            for k in st.keys():
                n += math.prod(st.get_slice(k).get_shape())
    return n * itemsize


def forward_graph(worker, rows: int, context: int, kv_block: int):
    """A batch-1 forward of ``rows`` query rows over ``context`` cached
    tokens, captured (on the CPU: run eagerly): ``(run, graph or None)``."""
    bufs, per_seq, forward = worker._static_forward(rows, 1, kv_block, want_hidden=False, one_logits_row=False)
    graphs = DecodeGraphs(forward, bufs, per_seq, chunk_padding(bufs), 1, worker.device)
    blocks = -(-context // kv_block)
    positions = torch.arange(context - rows, context, dtype=torch.int64)
    # Blocks 1..: the engine holds no request, its cache is the bench's.
    table = torch.arange(1, blocks + 1, dtype=torch.int32)[None]
    inputs = {"input_ids": torch.randint(1, worker.spec.vocab_size, (rows,)), "positions": positions,
              "slot_mapping": (positions // kv_block + 1) * kv_block + positions % kv_block,
              "seq_lens": torch.tensor([context]), "block_tables": table}
    for _ in range(3):
        graphs.run(1, inputs)
    return (lambda: graphs.run(1, inputs)), graphs.graphs.get(1) if worker.device.type == "cuda" else None


def forward_s(worker, rows: int, context: int, kv_block: int, replays: int) -> float:
    """Seconds a batch-1 forward of ``rows`` query rows over ``context``
    cached tokens takes, replayed as a graph (on the CPU: run eagerly)."""
    run, graph = forward_graph(worker, rows, context, kv_block)
    dev = worker.device
    if graph is None:
        t = time.perf_counter()
        for _ in range(replays):
            run()
        return (time.perf_counter() - t) / replays
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    sync(dev)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    sync(dev)
    return start.elapsed_time(end) / 1000 / replays


def kernel_times(worker, context: int, kv_block: int, replays: int = 20) -> dict:
    """Where an autoregressive forward's GPU time goes: the profiler's
    kernels over ``replays`` graph replays (eager runs on the CPU), summed
    by name a forward, and one forward's kernels in launch order."""
    from torch.profiler import ProfilerActivity, profile

    run, graph = forward_graph(worker, 1, context, kv_block)
    cuda = graph is not None
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(replays):
            graph.replay() if cuda else run()
        sync(worker.device)
    events = [e for e in prof.events() if (e.device_type.name == "CUDA") == cuda and
              (cuda or e.cpu_parent is None)]
    events.sort(key=lambda e: e.time_range.start)
    by_name: dict[str, list] = {}
    for e in events:
        t = by_name.setdefault(e.name, [0, 0.0])
        t[0] += 1
        t[1] += e.time_range.elapsed_us()
    total_us = sum(t[1] for t in by_name.values())
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])
    per = len(events) // replays
    return {
        "kernels_per_forward": per, "kernel_us_per_forward": round(total_us / replays, 1),
        "by_name": [{"name": k[:120], "count_per_forward": round(c / replays, 2), "us_per_forward": round(us / replays, 1)}
                    for k, (c, us) in top[:30]],
        "one_forward": [{"name": e.name[:80], "us": round(e.time_range.elapsed_us(), 2)} for e in events[:per]],
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_args(p)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--replays", type=int, default=200)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--kernels", action="store_true", help="add the AR forward's kernels (torch profiler)")
    p.add_argument("--tune-linear", default="", help="a linear_kernels.py shape: turn the few-row kernels on "
                   "(ops.FEW_ROW_KERNELS) and tune them first")
    p.add_argument("--quick-tune", action="store_true", help="a smaller tuning grid")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    target = resolve_target(args)
    linear = {}
    if args.tune_linear:
        from linear_kernels import GRID_QUICK, tune

        ops.FEW_ROW_KERNELS = True
        linear = tune(args.tune_linear, rows=(1, args.block), grid=GRID_QUICK if args.quick_tune else None)
    llm = LLM(target, None, device=args.device, dtype=args.dtype, max_model_len=args.context + 2 * args.block + 256,
              max_num_seqs=4, gpu_memory_utilization=0.5)
    core = llm.engine
    worker = getattr(core.target, "worker", core.target)
    dev = worker.device
    bandwidth = copy_bandwidth(dev, (2 << 30) if dev.type == "cuda" else (64 << 20))
    m = worker.model
    weight_bytes = checkpoint_bytes(target, m.embed.element_size())
    # An untied embedding table is read a row a step; a tied one is the LM head.
    embed_bytes = 0 if m.lm_head is m.embed else m.embed.numel() * m.embed.element_size()
    step_bytes = weight_bytes - embed_bytes + worker.bytes_per_block(1) * args.context
    kv_block = core.config.kv_block_size
    ar_s = forward_s(worker, 1, args.context, kv_block, args.replays)
    verify_s = forward_s(worker, args.block, args.context, kv_block, args.replays)
    step_s = ar_decode_s(llm, args.steps)
    ar_cublas_s = verify_cublas_s = None
    if ops.FEW_ROW_KERNELS and dev.type == "cuda":
        ops.FEW_ROW_KERNELS = False
        try:
            ar_cublas_s = forward_s(worker, 1, args.context, kv_block, args.replays)
            verify_cublas_s = forward_s(worker, args.block, args.context, kv_block, args.replays)
        finally:
            ops.FEW_ROW_KERNELS = True
    report = {
        "target": target, "device": str(dev), "dtype": args.dtype, "context": args.context,
        "copy_bandwidth_TBps": round(bandwidth / 1e12, 3),
        "weight_bytes": weight_bytes, "bytes_read_per_step": step_bytes,
        "weight_GB": round(weight_bytes / 1e9, 3), "bytes_read_per_step_GB": round(step_bytes / 1e9, 3),
        "forward_ar_ms": round(1000 * ar_s, 4), f"forward_verify{args.block}_ms": round(1000 * verify_s, 4),
        f"verify{args.block}_over_ar": round(verify_s / ar_s, 3),
        "forward_ar_of_copy_bandwidth": round(step_bytes / ar_s / bandwidth, 3),
        "forward_ar_cublas_ms": ar_cublas_s and round(1000 * ar_cublas_s, 4),
        "forward_ar_cublas_of_copy_bandwidth": ar_cublas_s and round(step_bytes / ar_cublas_s / bandwidth, 3),
        f"forward_verify{args.block}_cublas_ms": verify_cublas_s and round(1000 * verify_cublas_s, 4),
        "engine_ar_ms_per_token": round(1000 * step_s, 4), "engine_ar_tok_s": round(1 / step_s, 1),
        "engine_ar_of_copy_bandwidth": round(step_bytes / step_s / bandwidth, 3),
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]),
    }
    if linear:
        report["linear_kernels"] = linear
    if args.kernels:
        report["ar_forward_kernels"] = kernel_times(worker, args.context, kv_block)
    print(json.dumps(report, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    llm.shutdown()
    return report


if __name__ == "__main__":
    main()
