"""Acceptance of a trained drafter as specray serves it (greedy, its own
engine), on a prompt file: the figure training's estimate stands for."""

from __future__ import annotations

from pathlib import Path
import time

from specray.training.progress import log
from specray.training.prompts import chat_ids, load_prompts


def eval_acceptance(args, out: Path, tok) -> dict:
    from specray import LLM, SamplingParams

    prompts = [chat_ids(tok, m) for m in load_prompts(args.eval_prompts, args.eval_n)]
    llm = LLM(str(args.target), str(out), device=str(args.device))
    t = time.time()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.eval_max_tokens))
    steps = sum(len(o.metrics.acceptance_lengths) for o in outs)
    toks = sum(sum(o.metrics.acceptance_lengths) for o in outs)
    res = {"prompts": len(prompts), "mean_acceptance_length": round(toks / max(steps, 1), 3),
           "per_prompt": [round(o.metrics.mean_acceptance_length, 3) for o in outs],
           "seconds": round(time.time() - t, 1)}
    log(f"eval: specray acceptance length {res['mean_acceptance_length']} over {len(prompts)} prompts")
    return res
