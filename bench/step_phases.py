"""Where the host's time goes in a decode step, without a profiler: each
phase of ``EngineCore.step`` timed with ``perf_counter`` and no added
synchronisation, so a phase that launches GPU work costs its launch only,
and the wait for the GPU shows up where the step's one sync is (``accept``,
which reads the results back; with ``--async-scheduling``, the apply of the
step before, after the next one is launched). Batch 1, one prompt, speculative engine and
the same engine without a drafter.

    python bench/step_phases.py --target DIR --drafter DIR --cuda-graphs --out phases.json

What it says: a phase's host time beyond the GPU's is time the GPU waits.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter, defaultdict

import torch

import specray.engine as engine_module
from specray import LLM, SamplingParams

PHASES = {  # EngineCore method -> phase name
    "_lookup_drafts": "lookup",
    "_draft_batch": "draft batch",
    "_target_batch": "target batch",
    "_accept": "accept (+ wait for the GPU)",
    "_apply": "apply (+ context store launch)",
    "_apply_inflight": "apply an async step (+ wait for the GPU)",
}
LAUNCH = "launch an async step (one graph replay)"


def timer(spent: dict[str, float], calls: Counter | None = None):
    """``timed(name, fn)``: ``fn`` adding its wall time (and, with ``calls``,
    its call count) under ``name``."""
    def timed(name, fn):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[name] += time.perf_counter() - t
                if calls is not None:
                    calls[name] += 1
        return wrapper
    return timed


def time_phases(llm: LLM, prompt: str, steps: int) -> dict:
    core = llm.engine
    spent: dict[str, float] = defaultdict(float)
    timed = timer(spent)

    for method, name in PHASES.items():
        setattr(core, method, timed(name, getattr(core, method)))
    core.scheduler.schedule = timed("schedule", core.scheduler.schedule)
    if core.drafter is not None:
        # Under faults.GuardedDrafter: time the drafter's own propose.
        drafter = core.drafter.__dict__.get("inner", core.drafter)
        drafter.propose = timed("propose (launch + draft argmax)", drafter.propose)
    core.target.execute = timed("target execute (launch)", core.target.execute)
    launch = engine_module.launch_decode
    engine_module.launch_decode = timed(LAUNCH, launch)

    params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    rid = core.add_request(prompt, params)
    for _ in range(8):  # prefill + graph capture
        core.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    spent.clear()
    t = time.perf_counter()
    for _ in range(steps):
        core.step()
    wall = time.perf_counter() - t
    timed_steps = dict(spent)  # what follows is not part of the timed steps
    req = core.requests[rid]
    acc = req.metrics.acceptance_lengths[-steps:]
    core.abort_request(rid)
    # The aborted request's last step may still be in flight: drain it, so
    # that the steps timed next are the new request's own.
    while core._inflight:
        core.step()
    # A request's fixed cost, warm: its prefill step and first decode step
    # (which launches two steps and waits for the first), each with its phases.
    rid = core.add_request(prompt, params)
    first, first_phases = [], []
    for _ in range(3):
        spent.clear()
        t = time.perf_counter()
        core.step()
        first.append(round(1000 * (time.perf_counter() - t), 3))
        first_phases.append({k: round(1000 * v, 3) for k, v in sorted(spent.items(), key=lambda kv: -kv[1])})
    prompt_tokens = len(core.requests[rid].prompt_token_ids)
    core.abort_request(rid)
    while core._inflight:
        core.step()
    engine_module.launch_decode = launch
    per_step = {k: round(1000 * v / steps, 4) for k, v in sorted(timed_steps.items(), key=lambda kv: -kv[1])}
    timed_ms = sum(timed_steps.values()) * 1000 / steps
    return {
        "steps": steps,
        "step_ms": round(1000 * wall / steps, 4),
        "phases_ms": per_step,
        "untimed_ms": round(1000 * wall / steps - timed_ms, 4),
        "mean_acceptance_length": round(sum(acc) / len(acc), 3),
        "tokens_per_s": round(sum(acc) / wall, 1),
        "prompt_tokens": prompt_tokens,
        "prefill_step_ms": first[0],
        "first_decode_step_ms": first[1],
        "second_decode_step_ms": first[2],
        "fixed_cost_phases_ms": dict(zip(("prefill", "first decode", "second decode"), first_phases)),
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--cuda-graphs", action="store_true")
    p.add_argument("--async-scheduling", action="store_true")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--prompt", default="Explain why the sky is blue, in a few paragraphs.")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    res = {}
    for name, drafter in (("spec", args.drafter), ("ar", None)):
        llm = LLM(args.target, drafter, device=args.device, cuda_graphs=args.cuda_graphs, max_num_seqs=8,
                  async_scheduling=args.async_scheduling,
                  gpu_memory_utilization=0.3)
        res[name] = time_phases(llm, args.prompt, args.steps)
        del llm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        r = res[name]
        print(f"== {name}: step {r['step_ms']:.3f} ms, {r['tokens_per_s']} tok/s, "
              f"acceptance {r['mean_acceptance_length']}, untimed {r['untimed_ms']:.3f} ms; "
              f"prefill of {r['prompt_tokens']} tokens {r['prefill_step_ms']:.3f} ms, "
              f"first decode {r['first_decode_step_ms']:.3f} ms, second {r['second_decode_step_ms']:.3f} ms")
        for k, v in r["phases_ms"].items():
            print(f"   {v:7.3f} ms  {k}")
        for step, phases in r["fixed_cost_phases_ms"].items():
            print(f"   {step}: " + ", ".join(f"{k} {v:.3f}" for k, v in phases.items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
