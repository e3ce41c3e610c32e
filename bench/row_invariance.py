"""Do a verify block's rows get the same bits as decode steps?

Greedy speculative output equals autoregressive output only if the target
gives a position the same logits whether it is computed alone (a decode
step) or as one row of a verify block. This runs the target teacher-forced
on its own greedy continuation of each prompt, once one position at a
time and once in blocks of ``--block`` (and 8) positions, and counts the
positions whose logits differ bitwise; for the first prompt with a
difference it records every op's output for that position in both forms
and names the first op that differs.

    python bench/row_invariance.py --target DIR --out rows.json   # on a GPU, bf16

(results/archive/verify_rows/README.md: 3 534 of 3 840
positions differed with 16-row blocks before the attention kernel took
decode-shaped tiles for verify launches, none after.)
"""

from __future__ import annotations

import argparse
import json

import torch

import specray.actors.models.qwen3 as qwen3
from specray import LLM, SamplingParams
from specray.bench import load_prompts
from specray.plan import AttentionMetadata


OPS = ("norm_linear", "qkv_rope", "paged_attention", "linear", "silu_mul_linear", "rms_norm")


def trace(fn, row: int = 0) -> list[tuple[str, torch.Tensor]]:
    """Run ``fn`` (a target forward) with its ops and GEMMs wrapped; returns
    each one's output row ``row`` in call order. The wrappers live only
    for the call (``kernels.ops`` is shared by every model)."""
    log: list[tuple[str, torch.Tensor]] = []

    def keep(name, out):
        log.append((name, out[row].float().clone()))
        return out

    def wrap(name, op):
        def wrapped(*a, **kw):
            out = op(*a, **kw)
            keep(name, out[0] if isinstance(out, tuple) else out)
            return out
        return wrapped

    ops, F = {name: getattr(qwen3.ops, name) for name in OPS}, qwen3.F
    for name, op in ops.items():
        setattr(qwen3.ops, name, wrap(name, op))
    qwen3.F = type("F", (), {"linear": staticmethod(lambda x, w, b=None: keep(f"linear{list(w.shape)}",
                                                                             F.linear(x, w, b)))})
    try:
        fn()
    finally:
        for name, op in ops.items():
            setattr(qwen3.ops, name, op)
        qwen3.F = F
    return log


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--prompts", default="data/prompts/eval.jsonl")
    p.add_argument("--limit", type=int, default=48)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--positions", type=int, default=80)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--out")
    args = p.parse_args(argv)

    dev = torch.device(args.device)
    max_len = args.max_model_len
    llm = LLM(args.target, None, device=args.device, dtype=args.dtype, cuda_graphs=False, num_kv_blocks=256,
              max_model_len=max_len)
    worker = llm.engine.target
    model, kv = worker.model, worker.kv_cache
    kv_block = kv.shape[3]
    table = torch.arange(1, kv.shape[2], dtype=torch.int32, device=dev)[None]

    def forward(ids, p0):
        """Positions ``p0 ..`` of one sequence, its earlier positions cached;
        ``max_seq_len`` fixed, as in a captured graph."""
        n = len(ids)
        pos = torch.arange(p0, p0 + n, device=dev)
        slots = table[0, pos // kv_block].long() * kv_block + pos % kv_block
        attn = AttentionMetadata(pos, slots, torch.tensor([0, n], device=dev), torch.tensor([p0 + n], device=dev),
                                 table, n, max_len + 32)
        return model.forward(torch.tensor(ids, device=dev), attn, kv, logits_indices=torch.arange(n, device=dev))[0]

    def logits_in_blocks(seq, start, block):
        forward(seq[:start], 0)
        end = start + args.positions
        return torch.cat([forward(seq[p:p + block], p) for p in range(start, end, block)])[: args.positions]

    report: dict = {"block": args.block, "prompts": {}}
    n_tokens = args.positions + args.block
    for rid, text in load_prompts(args.prompts, llm.tokenizer, args.limit):
        out = llm.generate([text], SamplingParams(max_tokens=n_tokens, temperature=0, ignore_eos=True))[0]
        seq, L = list(out.prompt_token_ids) + list(out.token_ids), len(out.prompt_token_ids)
        with torch.inference_mode():
            one = logits_in_blocks(seq, L, 1)
            blk = logits_in_blocks(seq, L, args.block)
            blk8 = logits_in_blocks(seq, L, 8)
        differ = (one != blk).any(-1).nonzero().flatten().tolist()
        report["prompts"][rid] = {
            "prompt_len": L,
            f"positions_differ_block_{args.block}": len(differ),
            "positions_differ_block_8": int((one != blk8).any(-1).sum()),
            f"argmax_differ_block_{args.block}": int((one.argmax(-1) != blk.argmax(-1)).sum()),
            "max_abs_diff": float((one.float() - blk.float()).abs().max()),
        }
        if differ and "first_difference" not in report:
            # The position again, alone and at the row it held in its block:
            # a row's bits can depend on where in the block it sits.
            p = L + differ[0]
            row = differ[0] % args.block
            with torch.inference_mode():
                forward(seq[:p], 0)
                alone = trace(lambda: forward([seq[p]], p))
                forward(seq[:p - row], 0)
                in_block = trace(lambda: forward(seq[p - row:p - row + args.block], p - row), row)
            first = next((i for i, ((_, a), (_, b)) in enumerate(zip(alone, in_block)) if not torch.equal(a, b)), None)
            report["first_difference"] = {
                "prompt": rid, "position": p, "row_in_block": row, "ops": len(alone), "first_op_index": first,
                "first_op": alone[first][0] if first is not None else None,
                "max_abs_diff": float((alone[first][1] - in_block[first][1]).abs().max()) if first is not None else 0.0,
            }
        print(rid, report["prompts"][rid], flush=True)
    rows = report["prompts"].values()
    key = f"positions_differ_block_{args.block}"
    report["total"] = {key: sum(r[key] for r in rows), "positions": args.positions * len(rows),
                       "positions_differ_block_8": sum(r["positions_differ_block_8"] for r in rows)}
    print(report["total"], report.get("first_difference"))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
