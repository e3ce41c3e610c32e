"""Per-step exchange latency between target rank 0 and a drafter in another
process: the messages of one graphed decode step, with no model on either
side.

Rank 0 sends the context of the last step (the accepted rows of tapped
hidden states + positions + slots; here ``S * B`` rows ``[S*B, taps*H]``,
every block fully accepted: the most a step carries) and the next
DraftBatch, then
waits for the drafts ``[S, B-1]``; the drafter end answers as soon as both
have arrived. One round = one step's exchange, timed on rank 0 after a
device sync.

    python bench/bench_channel.py --channel nccl --batch 1 8 32 --out channel.json   # two GPUs
    python bench/bench_channel.py --channel gloo --batch 1 8                         # two CPU processes
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import statistics
import tempfile
import time

import torch

from specray.bench import save_report


def step_messages(S: int, B: int, width: int, device) -> tuple[list, object]:
    from specray.plan import DraftBatch
    from specray.sampling import SamplingParams, SamplingTensors

    hidden = torch.randn(S * B, width, device=device).to(torch.bfloat16)
    positions = torch.arange(S * B, device=device)
    slots = torch.arange(S * B, device=device)
    batch = DraftBatch(
        block_ids=torch.zeros(S, B, dtype=torch.int64), ctx_lens=torch.full((S,), 100),
        block_lens=torch.full((S,), B), block_tables=torch.zeros(S, 64, dtype=torch.int32), max_ctx_len=100,
        sampling=SamplingTensors.build([SamplingParams(temperature=0)] * S, list(range(S)), [0] * S, 16),
    )
    return [hidden, positions, slots], batch


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _end(rank: int, args, rendezvous, q) -> None:
    from specray.actors import messages as M, remote_drafter as R
    from specray.actors.transport import TorchP2PChannel

    if args.channel == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        ch = R.CupyNcclChannel(rendezvous, rank, device)
    else:
        import torch.distributed as dist

        device = torch.device("cpu")
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=2)
        ch = TorchP2PChannel(1 - rank, "cpu")
    B, width = args.block_size, args.taps * args.hidden
    if rank == 1:  # the drafter end: context in, batch in, drafts out
        while True:
            cmd, ts = ch.recv()
            if cmd == M.CMD_STOP:
                break
            if cmd == M.CMD_PROPOSE:
                S = ts[0].shape[0]
                ch.send(M.CMD_DRAFTS, M.pack_draft_output(
                    M.DraftOutput(torch.zeros(S, B - 1, dtype=torch.int64, device=device), None, None)))
        _sync(device)
        return
    drafter = R.RemoteDrafter(ch, device)
    results = {}
    for S in args.batch:
        ctx, batch = step_messages(S, B, width, device)
        times = []
        for i in range(args.warmup + args.iters):
            _sync(device)
            t = time.perf_counter()
            drafter.store_context(*ctx)
            out = drafter.propose(batch)
            _sync(device)
            if i >= args.warmup:
                times.append(time.perf_counter() - t)
        assert out.tokens.shape == (S, B - 1)
        ctx_bytes = sum(t.numel() * t.element_size() for t in ctx)
        results[str(S)] = {"median_us": round(1e6 * statistics.median(times), 1),
                           "p90_us": round(1e6 * sorted(times)[int(0.9 * len(times))], 1),
                           "context_bytes": ctx_bytes}
        print(f"batch {S:3d}: {results[str(S)]['median_us']:8.1f} us median, "
              f"{results[str(S)]['p90_us']:8.1f} us p90, context {ctx_bytes / 2**20:.2f} MiB")
    drafter.stop()
    _sync(device)
    q.put(results)


def run_pair(end, args, rendezvous):
    """Runs ``end(rank, args, rendezvous, queue)`` for ranks 0 and 1 in two
    spawned processes; returns what one of them puts on the queue."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=end, args=(r, args, rendezvous, q)) for r in (0, 1)]
    for proc in procs:
        proc.start()
    result = None
    while result is None:  # a crashed end must not leave us waiting
        try:
            result = q.get(timeout=1.0)
        except queue.Empty:
            dead = [proc.exitcode for proc in procs if proc.exitcode not in (None, 0)]
            if dead:
                for proc in procs:
                    proc.kill()
                raise RuntimeError(f"a benchmark end exited with code {dead[0]}") from None
    for proc in procs:
        proc.join(timeout=60)
    return result


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--channel", choices=["nccl", "gloo"], default="nccl" if torch.cuda.device_count() >= 2 else "gloo")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--hidden", type=int, default=4096, help="target hidden size (Qwen3-8B: 4096)")
    p.add_argument("--taps", type=int, default=5)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--out")
    args = p.parse_args(argv)
    if args.channel == "nccl":
        from specray.actors.transport import nccl_unique_id

        rendezvous = nccl_unique_id()
    else:
        rendezvous = "file://" + os.path.join(tempfile.mkdtemp(), "rdzv")
    results = run_pair(_end, args, rendezvous)
    report = {"channel": args.channel, "block_size": args.block_size, "hidden": args.hidden, "taps": args.taps,
              "iters": args.iters, "by_batch": results}
    return save_report(report, args.out)


if __name__ == "__main__":
    main()
