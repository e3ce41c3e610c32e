"""Whether the paged KV cache's layout sets what a decode step's attention
costs (GPU only): the embedded target's attention (9 query heads, 3 KV
heads, head_dim 64, bf16, 30 layers, KV blocks of 16) for one decode row
of each of ``--rows`` sequences, replayed as a CUDA graph of one launch a
layer as a step replays it, over

* ``num_blocks``: the pool's size, which sets how far apart a layer's K
  and V and consecutive layers lie (the cache is ``[layers, 2, num_blocks,
  16, kv_heads, head_dim]``);
* the block tables: ``lockstep`` (rows that cross into a new block
  together: a row's blocks 64 apart), ``contiguous`` (a row's blocks in a
  run) and ``shuffled``.

``--engines``: instead, the inputs two engines' own steps give the kernel
at ``--rows`` (the autoregressive engine and the speculative one forced to
autoregressive steps, its drafter resting, as bench/ar_step_cost.py runs
them; both resident): after ``--after`` steps of a closed loop, each
engine's KV cache, row lengths and tables are timed as they are and with
the other engine's tables and lengths on its cache.

On the H100 at c=64 the speculative engine's resting autoregressive steps
spent 0.33 ms a step in this kernel where the autoregressive engine's
identical steps spent 0.27 (results/h100_ar_step_cost.json).

    python bench/kv_layout.py --out results/h100_kv_layout.json [--engines]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_report  # noqa: E402

LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16


def tables_for(layout: str, lens: list[int], gen: torch.Generator) -> torch.Tensor:
    need = [-(-n // BLOCK) for n in lens]
    rows, width = len(lens), max(need)
    out = torch.zeros(rows, width, dtype=torch.int32)
    if layout == "lockstep":
        ids = iter(range(1, 1 + rows * width))
        for j in range(width):
            for i in range(rows):
                b = next(ids)
                if j < need[i]:
                    out[i, j] = b
    elif layout == "contiguous":
        nxt = 1
        for i, n in enumerate(need):
            out[i, :n] = torch.arange(nxt, nxt + n)
            nxt += n
    else:
        perm = (torch.randperm(sum(need), generator=gen) + 1).tolist()
        for i, n in enumerate(need):
            out[i, :n] = torch.tensor([perm.pop() for _ in range(n)])
    return out


def step_ms(kv: torch.Tensor, tables: torch.Tensor, lens: list[int], reps: int) -> float:
    from specray.kernels.attention_triton import paged_attention

    dev = kv.device
    rows = len(lens)
    q = torch.randn(rows, Q_HEADS, HEAD_DIM, device=dev, dtype=kv.dtype)
    qsl = torch.arange(rows + 1, dtype=torch.int64, device=dev)
    seq = torch.tensor(lens, dtype=torch.int64, device=dev)
    tab = tables.to(dev)

    def step():
        for layer in range(LAYERS):
            paged_attention(q, kv[layer, 0], kv[layer, 1], qsl, seq, tab, 1, max(lens), HEAD_DIM**-0.5)

    step()  # compile
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(20):
        graph.replay()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / reps)
    return round(sorted(times)[len(times) // 2], 4)


def engine_inputs(rows: int, after: int) -> dict:
    """name -> (kv_cache, row lengths, tables) of each engine's
    autoregressive step graph after ``after`` steps of ``rows`` requests."""
    from specray import LLM, SamplingParams
    from specray.bench import load_prompts
    from specray.cli import resolve_models

    target, drafter = resolve_models(argparse.Namespace(target=None, drafter=None, no_drafter=False))
    kw = dict(device="cuda", gpu_memory_utilization=0.4, max_num_seqs=rows, cuda_graphs=True, async_scheduling=True)
    params = SamplingParams(max_tokens=128, temperature=1.0, ignore_eos=True, seed=0)
    out = {}
    for name, extra in (("ar", None), ("spec_rest", {"extra": {"policy_turns": [0]}})):
        llm = LLM(target, drafter if extra else None, **kw, **(extra or {}))
        prompts = [q for _, q in load_prompts(str(Path(__file__).resolve().parents[1] / "data/prompts/eval.jsonl"),
                                              llm.tokenizer)]
        eng = llm.engine
        for i in range(rows):
            eng.add_request(prompts[i % len(prompts)], params, request_id=f"{name}-{i}")
        for _ in range(after):
            eng.step()
        torch.cuda.synchronize()
        # an engine without a drafter has one kind of step; the other's resting AR steps are ("ar", "rest")
        (key, graphs), = [(k, g) for k, g in eng._step_graphs.items() if extra is None or "rest" in k]
        start = graphs.buffers["start"][:rows].clone()
        tables = graphs.buffers["target_tables"][:rows].clone()
        kv = getattr(eng.target, "worker", eng.target).kv_cache
        out[name] = (kv, (start + 1).tolist(), tables, str(key), llm)
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--num-blocks", type=int, nargs="+", default=[8192, 16384, 24000, 32768, 40000, 49152, 65536])
    p.add_argument("--layouts", nargs="+", default=["lockstep", "contiguous", "shuffled"])
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--engines", action="store_true", help="the engines' own inputs (see above)")
    p.add_argument("--after", type=int, default=64, help="--engines: steps before the inputs are taken")
    p.add_argument("--out")
    args = p.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    lens = (torch.randint(120, 360, (args.rows,), generator=gen)).tolist()
    report = {"command": "python bench/kv_layout.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "device": torch.cuda.get_device_name(), "rows": args.rows, "lens": lens, "points": []}
    if args.engines:
        got = engine_inputs(args.rows, args.after)
        for kv_of, (kv, _, _, _, _) in got.items():
            for rows_of, (_, lens_, tables, key, _) in got.items():
                ms = step_ms(kv, tables.cpu(), lens_, args.reps)
                point = {"kv_cache_of": kv_of, "lens_and_tables_of": rows_of, "graph": key,
                         "num_blocks": int(kv.shape[2]), "mean_len": round(sum(lens_) / len(lens_), 1),
                         "max_len": max(lens_), "attention_ms_per_step": ms}
                report["points"].append(point)
                print(point, flush=True)
        write_report(args.out, report)
        return report
    sizes = list(args.num_blocks)
    need = sum(-(-n // BLOCK) for n in lens) + 1
    for nb in sizes:
        if nb < need:
            continue
        kv = torch.randn(LAYERS, 2, nb, BLOCK, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        for layout in args.layouts:
            ms = step_ms(kv, tables_for(layout, lens, gen), lens, args.reps)
            point = {"num_blocks": nb, "kv_distance_mib": round(nb * BLOCK * KV_HEADS * HEAD_DIM * 2 / 2**20, 3),
                     "layout": layout, "attention_ms_per_step": ms}
            report["points"].append(point)
            print(point, flush=True)
        del kv
        torch.cuda.empty_cache()
    ms = [p["attention_ms_per_step"] for p in report["points"]]
    report["max_over_min"] = round(max(ms) / min(ms), 3)
    print(f"attention a step: {min(ms):.4f} .. {max(ms):.4f} ms ({report['max_over_min']}x)")
    write_report(args.out, report)
    return report


if __name__ == "__main__":
    main()
