"""Attention kernels against their PyTorch references on realistic shapes
(GPU only).

    python bench/bench_attention.py [--json out.json] [--quick]

Shapes are Qwen3-8B's attention (32 q heads, 8 KV heads, head_dim 128, bf16,
KV block size 16), with random non-contiguous block tables. For each shape it
prints the max error against the float64 reference, then

* ``kernel_us``: the Triton kernel (KV split + combine when used), timed with
  ``triton.testing.do_bench`` (L2 flushed before each call);
* ``graph_us``: the same call replayed inside a CUDA graph (launch overhead
  removed, L2 *not* flushed: small KV sets may be read from L2);
* ``ref_us``: the PyTorch reference (gather + masked SDPA), eager;
* ``GB/s`` and ``%peak``: unique K/V bytes read / ``kernel_us`` against the
  H200's ~4.3 TB/s measured copy bandwidth (meaningful for decode, verify and
  DFlash blocks, which are memory-bound);
* ``TFLOP/s``: 4 * head_dim * q_heads * (visible query-key pairs) / kernel_us
  (meaningful for the prefill, which is compute-bound).
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch

PEAK_BYTES_PER_S = 4.3e12
Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16


def _tables(batch, lens, gen, device):
    """Caches holding every sequence's blocks in shuffled order, and tables."""
    need = [math.ceil(n / BLOCK_SIZE) for n in lens]
    width = max(need) + 1
    num_blocks = 1 + sum(need)
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(batch, width, dtype=torch.int32)
    for s, n in enumerate(need):
        tables[s, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=torch.int32)
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k = torch.randn(shape, device=device, dtype=DTYPE)
    v = torch.randn(shape, device=device, dtype=DTYPE)
    return k, v, tables.to(device)


def paged_inputs(batch, q_len, seq_len, gen, device="cuda"):
    lens = [seq_len] * batch
    k, v, tables = _tables(batch, lens, gen, device)
    qsl = torch.arange(batch + 1, dtype=torch.int64, device=device) * q_len
    q = torch.randn(batch * q_len, Q_HEADS, HEAD_DIM, device=device, dtype=DTYPE)
    args = dict(q=q, k_cache=k, v_cache=v, query_start_loc=qsl,
                seq_lens=torch.tensor(lens, dtype=torch.int64, device=device), block_tables=tables,
                max_query_len=q_len, max_seq_len=seq_len, scale=HEAD_DIM**-0.5, sliding_window=None)
    kv_bytes = 2 * batch * seq_len * KV_HEADS * HEAD_DIM * k.element_size()
    ctx = seq_len - q_len
    pairs = batch * sum(ctx + i + 1 for i in range(q_len))
    return args, kv_bytes, pairs


def dflash_inputs(batch, ctx_len, gen, B=16, device="cuda"):
    lens = [ctx_len] * batch
    k, v, tables = _tables(batch, lens, gen, device)

    def rnd(h):
        return torch.randn(batch, B, h, HEAD_DIM, device=device, dtype=DTYPE)

    args = dict(q=rnd(Q_HEADS), k_block=rnd(KV_HEADS), v_block=rnd(KV_HEADS), k_cache=k, v_cache=v,
                ctx_lens=torch.tensor(lens, dtype=torch.int64, device=device), block_tables=tables,
                max_ctx_len=ctx_len, block_lens=torch.full((batch,), B, dtype=torch.int64, device=device),
                scale=HEAD_DIM**-0.5, causal=False, sliding_window=None)
    kv_bytes = 2 * batch * (ctx_len + B) * KV_HEADS * HEAD_DIM * k.element_size()
    pairs = batch * B * (ctx_len + B)
    return args, kv_bytes, pairs


def _f64(args):
    return {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in args.items()}


def run_case(name, kernel, ref, args, kv_bytes, pairs, with_ref=True):
    from triton.testing import do_bench, do_bench_cudagraph

    out = kernel(**args)
    err = (out.double() - ref(**_f64(args))).abs().max().item()
    k_ms = do_bench(lambda: kernel(**args), warmup=25, rep=100, return_mode="median")
    g_ms = do_bench_cudagraph(lambda: kernel(**args), rep=100, return_mode="median")
    r_ms = do_bench(lambda: ref(**args), warmup=5, rep=50, return_mode="median") if with_ref else float("nan")
    row = dict(
        name=name, max_err=err, kernel_us=k_ms * 1e3, graph_us=g_ms * 1e3, ref_us=r_ms * 1e3,
        speedup=r_ms / k_ms, kv_mb=kv_bytes / 1e6,
        gbps=kv_bytes / (k_ms * 1e-3) / 1e9, pct_peak=100 * kv_bytes / (k_ms * 1e-3) / PEAK_BYTES_PER_S,
        tflops=4 * HEAD_DIM * Q_HEADS * pairs / (k_ms * 1e-3) / 1e12,
    )
    print(f"{name:<34} {err:9.2e} {row['kernel_us']:10.1f} {row['graph_us']:9.1f} {row['ref_us']:10.1f} "
          f"{row['speedup']:8.1f} {row['kv_mb']:8.1f} {row['gbps']:8.0f} {row['pct_peak']:6.1f} {row['tflops']:7.1f}",
          flush=True)
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_attention needs a CUDA device")
    from specray.kernels import attention_triton as tri
    from specray.kernels.attention import dflash_block_attention_ref, paged_attention_ref

    gen = torch.Generator().manual_seed(0)
    seqs = (1024, 4096) if not a.quick else (4096,)
    batches = (1, 8, 64) if not a.quick else (1, 64)
    print(f"{torch.cuda.get_device_name()}  q_heads={Q_HEADS} kv_heads={KV_HEADS} head_dim={HEAD_DIM} "
          f"{str(DTYPE).split('.')[-1]} block_size={BLOCK_SIZE}")
    print(f"{'shape':<34} {'max_err':>9} {'kernel_us':>10} {'graph_us':>9} {'ref_us':>10} {'speedup':>8} "
          f"{'KV_MB':>8} {'GB/s':>8} {'%peak':>6} {'TFLOP/s':>7}")
    rows = []
    for q_len, kind in ((1, "decode"), (16, "verify")):
        for batch in batches:
            for seq in seqs:
                args, nbytes, pairs = paged_inputs(batch, q_len, seq, gen)
                rows.append(run_case(f"{kind} b={batch} seq={seq}", tri.paged_attention, paged_attention_ref,
                                     args, nbytes, pairs))
                del args
    for batch in batches:
        for ctx in seqs:
            args, nbytes, pairs = dflash_inputs(batch, ctx, gen)
            rows.append(run_case(f"dflash B=16 b={batch} ctx={ctx}", tri.dflash_block_attention,
                                 dflash_block_attention_ref, args, nbytes, pairs))
            del args
    args, nbytes, pairs = paged_inputs(1, 2048, 2048, gen)
    rows.append(run_case("prefill b=1 q=2048", tri.paged_attention, paged_attention_ref, args, nbytes, pairs))
    args, nbytes, pairs = paged_inputs(1, 2048, 6144, gen)
    rows.append(run_case("prefill chunk q=2048 ctx=4096", tri.paged_attention, paged_attention_ref,
                         args, nbytes, pairs))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
