"""Per-step cost of sending the step plan (a TargetBatch of S verify blocks)
from TP rank 0 to a follower: broadcast + receive + unpack, no model.

    python bench/bench_plan_broadcast.py --batch 1 8 32             # gloo, two CPU processes
    python bench/bench_plan_broadcast.py --device cuda --batch 1 8 32  # NCCL, two GPUs
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from bench_channel import run_pair

from specray.bench import save_report


def plan(S: int, B: int, device):
    from specray.plan import AttentionMetadata, TargetBatch

    N = S * B
    attn = AttentionMetadata(torch.arange(N) + 100, torch.arange(N), torch.arange(0, N + 1, B),
                             torch.full((S,), 100 + B), torch.zeros(S, 64, dtype=torch.int32), B, 100 + B)
    return TargetBatch(torch.arange(N, device=device), attn, torch.arange(N), True)


def _end(rank: int, args, rendezvous: str, q) -> None:
    from specray.actors import messages as M
    from specray.actors.transport import broadcast_message, receive_broadcast

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    device = torch.device(args.device, rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo", init_method=rendezvous,
                            rank=rank, world_size=2)
    out = {}
    for S in args.batch:
        b, times = plan(S, args.block_size, device), []
        for _ in range(args.warmup + args.iters):
            dist.barrier()
            t = time.perf_counter()
            if rank == 0:
                broadcast_message(M.CMD_STEP, M.pack_target_batch(b), None, device)
            else:
                got = M.unpack_target_batch(receive_broadcast(None, device)[1])
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t)
        if rank == 1:
            assert got.attn.max_seq_len == 100 + args.block_size and got.input_ids.numel() == S * args.block_size
            out[str(S)] = {"median_us": round(1e6 * statistics.median(times[args.warmup :]), 1)}
            print(f"batch {S:3d}: {out[str(S)]['median_us']:8.1f} us median (follower: receive + unpack)")
    if rank == 1:
        q.put(out)
    dist.destroy_process_group()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--out")
    args = p.parse_args(argv)
    rendezvous = "file://" + os.path.join(tempfile.mkdtemp(), "rdzv")
    report = {"device": args.device, "block_size": args.block_size, "by_batch": run_pair(_end, args, rendezvous)}
    return save_report(report, args.out)


if __name__ == "__main__":
    main()
