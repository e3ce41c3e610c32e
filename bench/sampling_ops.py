"""Operator count of the sampled path (temperature > 0): one speculative
step's draft sampling + verification at a given batch size and vocabulary,
and one uniform draw with the full hash against the keyed one. Counted with
the PyTorch profiler on the CPU: on a GPU outside CUDA graphs each top-level
operator is at least one kernel launch, and at batch 1 launches are what
these small tensors cost.

    python bench/sampling_ops.py --out ops.json
"""

from __future__ import annotations

import argparse
import json

import torch
from torch.profiler import ProfilerActivity, profile

from specray.sampling import (
    STREAM_DRAFT,
    SamplingParams,
    SamplingTensors,
    hash_uniform,
    keyed_uniform,
    sample_draft_tokens,
    verify,
)


def top_level_ops(fn) -> int:
    """aten operators called from Python, not from inside another one."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events()
               if e.name.startswith("aten::") and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--draft-top-k", type=int, default=64)
    p.add_argument("--out")
    args = p.parse_args(argv)
    G, V = args.block_size - 1, args.vocab
    report = {"block_size": args.block_size, "vocab": V, "by_batch": []}
    for S in args.batch:
        st = SamplingTensors.build([SamplingParams(temperature=1.0)] * S, list(range(S)), "cpu")
        draft_logits, target_logits = torch.randn(S, G, V), torch.randn(S, G + 1, V)
        starts = torch.arange(S) * 7 + 100
        positions = starts[:, None] + 1 + torch.arange(G)[None]

        def step():
            tokens, idx, q = sample_draft_tokens(draft_logits, st, starts, args.draft_top_k)
            verify(target_logits, tokens, torch.full((S,), G), st, starts, idx, q)

        step()  # first calls initialise things the count should not include
        row = {
            "batch": S,
            "sampled_step_ops": top_level_ops(step),
            "draw_ops_full_hash": top_level_ops(lambda: hash_uniform(torch.arange(S)[:, None], positions, STREAM_DRAFT)),
            "draw_ops_keyed": top_level_ops(lambda: keyed_uniform(st.keys[STREAM_DRAFT - 1][:, None], positions)),
        }
        report["by_batch"].append(row)
        print(f"batch {S}: sampled draft + verify {row['sampled_step_ops']} ops; one draw: full hash "
              f"{row['draw_ops_full_hash']}, keyed {row['draw_ops_keyed']} (a step makes 3 draws)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
