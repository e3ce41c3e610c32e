"""Operator count of the sampled path (temperature > 0): one speculative
step's draft sampling + verification at a given batch size and vocabulary
(how many of them are hash operators: none, since the host computes the
step's uniforms), one uniform draw if the hash ran on the device, and the
host's time for a step's uniforms. Counted with the PyTorch profiler on the
CPU: on a GPU outside CUDA graphs each top-level operator is at least one
kernel launch, and at batch 1 launches are what these small tensors cost.

    python bench/sampling_ops.py --out ops.json
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from specray.bench import save_report
from specray.sampling import (
    STREAM_DRAFT,
    SamplingParams,
    SamplingTensors,
    hash_uniform,
    host_uniforms,
    sample_draft_tokens,
    verify,
)


HASH_OPS = ("aten::bitwise_xor", "aten::bitwise_and", "aten::__rshift__", "aten::bitwise_right_shift")


def top_level_ops(fn) -> list[str]:
    """Names of the aten operators called from Python, not from inside
    another one."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return [e.name for e in prof.events()
            if e.name.startswith("aten::") and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]


def host_us(fn, repeats: int = 200) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return round(1e6 * sorted(times)[len(times) // 2], 1)


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
        seeds, starts = list(range(S)), [100 + 7 * s for s in range(S)]
        st = SamplingTensors.build([SamplingParams(temperature=1.0)] * S, seeds, starts, args.block_size)
        draft_logits, target_logits = torch.randn(S, G, V), torch.randn(S, G + 1, V)
        positions = torch.tensor(starts)[:, None] + 1 + torch.arange(G)[None]

        def step():
            tokens, idx, q = sample_draft_tokens(draft_logits, st, args.draft_top_k)
            verify(target_logits, tokens, torch.full((S,), G), st, idx, q)

        step()  # first calls initialise things the count should not include
        ops = top_level_ops(step)
        row = {
            "batch": S,
            "sampled_step_ops": len(ops),
            "hash_ops_in_step": sum(name in HASH_OPS for name in ops),
            "draw_ops_on_device": len(top_level_ops(
                lambda: hash_uniform(torch.arange(S)[:, None], positions, STREAM_DRAFT))),
            "host_uniforms_us": host_us(lambda: host_uniforms(seeds, starts, args.block_size)),
        }
        report["by_batch"].append(row)
        print(f"batch {S}: sampled draft + verify {row['sampled_step_ops']} ops ({row['hash_ops_in_step']} of them "
              f"hashing); one draw hashed on the device would be {row['draw_ops_on_device']} ops, a step has 3; "
              f"the host hashes a step's [3, {S}, {args.block_size}] uniforms in {row['host_uniforms_us']} us")
    return save_report(report, args.out)


if __name__ == "__main__":
    main()
