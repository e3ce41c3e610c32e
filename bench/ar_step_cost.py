"""What an autoregressive step of the speculative engine costs against the
autoregressive engine's, in one run: the adaptive policy is made to choose
autoregressive steps only, and the same closed-loop workload runs on the AR
engine, the speculative engine whose drafter rests (the default,
cluster/drafter_rest.py) and one whose drafter is fed every step
(``drafter_rest=False``). Per engine and concurrency: tokens/s, the async
cycles' wall and device ms by kind (``32a``: autoregressive at padded 32),
host ms per cycle by phase (cluster/phase_timer.py) and, on CUDA, the
device time per step of each kernel and the host time of each CUDA runtime
call (torch.profiler).

    python bench/ar_step_cost.py --device cuda --concurrency 32 64 --out results/h200_ar_step_cost.json

Prints each engine's tokens/s and its ratio to the AR engine's. On the CPU
(tests) the async path runs eagerly: the mechanics, not the speed.
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_model_args, write_report  # noqa: E402
from concurrency_sweep import closed_loop, cycle_summary  # noqa: E402

from specray import LLM, SamplingParams  # noqa: E402
from specray.bench import load_prompts  # noqa: E402
from specray.phase_timer import PhaseTimer, per_cycle  # noqa: E402

# The speculative engines' policy answers "autoregressive" to every step (spec_policy.scripted).
ALWAYS_AR = {"extra": {"policy_turns": [0]}}
ENGINES = {"ar": None, "spec_rest": ALWAYS_AR, "spec_fed": ALWAYS_AR | {"drafter_rest": False}}


def kernel_ms(prof, steps: int, top: int = 30) -> dict:
    """Device ms a step of each kernel, the most costly first."""
    per = {}
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", 0)
        if t and e.device_type.name == "CUDA":
            per[e.key[:100]] = round(t / 1000 / steps, 4)
    return dict(sorted(per.items(), key=lambda kv: -kv[1])[:top])


def runtime_ms(prof, steps: int, top: int = 15) -> dict:
    """Host ms a step in each CUDA runtime / driver call (graph launches,
    copies, event records and waits), the most costly first."""
    per = {}
    for e in prof.key_averages():
        if e.device_type.name == "CPU" and e.key.startswith("cu") and e.self_cpu_time_total:
            per[e.key[:60]] = (round(e.self_cpu_time_total / 1000 / steps, 4), round(e.count / steps, 2))
    return {k: {"ms": ms, "calls": n} for k, (ms, n) in sorted(per.items(), key=lambda kv: -kv[1][0])[:top]}


def measure(llm, prompts: list, c: int, max_tokens: int, cuda: bool, kernels: bool = True) -> dict:
    eng = llm.engine
    work = [prompts[(c + j) % len(prompts)] for j in range(4 * c)]
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, ignore_eos=True, seed=0)
    closed_loop(eng, work, params, c)  # graphs captured, kernels compiled
    before = {k: list(v) for k, v in eng.cycle_costs.items()}
    outs, secs = closed_loop(eng, work, params, c)
    point = {"tok_s": round(sum(len(o.token_ids) for o in outs) / secs, 1),
             "cycles": cycle_summary(before, eng.cycle_costs)}
    timer = PhaseTimer(eng)
    closed_loop(eng, work, params, c)
    point["host_ms_per_cycle"] = per_cycle(timer.totals())
    timer.close()
    if cuda and kernels:
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            closed_loop(eng, work[:c], params, c)
        point["kernel_ms_per_step"] = kernel_ms(prof, eng.loop_steps)
        point["runtime_calls_per_step"] = runtime_ms(prof, eng.loop_steps)
    if eng.policy is not None:
        point["drafter_rest"] = eng.rest.snapshot()
    return point


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p, "cuda")
    p.add_argument("--concurrency", type=int, nargs="+", default=[32, 64])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompts", default=str(Path(__file__).resolve().parents[1] / "data/prompts/eval.jsonl"))
    p.add_argument("--engines", nargs="+", choices=list(ENGINES), default=list(ENGINES),
                   help="which engines run (one alone: a profiler attached from outside sees only it)")
    p.add_argument("--kernels", action=argparse.BooleanOptionalAction, default=True,
                   help="profile each point's kernels and runtime calls after its timed runs (the profiler may "
                        "stay attached to the process and tax later points' launches: --no-kernels for clean ones)")
    p.add_argument("--out")
    args = p.parse_args(argv)
    from specray.cli import resolve_models

    target, drafter = resolve_models(argparse.Namespace(target=args.target, drafter=args.drafter, no_drafter=False))
    cuda = args.device.startswith("cuda")
    common = dict(device=args.device, max_num_seqs=max(args.concurrency), profile_steps=True,
                  cuda_graphs=True, async_scheduling=True)
    if cuda:
        common["gpu_memory_utilization"] = 0.4
    report = {"command": "python bench/ar_step_cost.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "target": target, "drafter": drafter, "device": args.device, "temperature": 1.0,
              "max_tokens": args.max_tokens, "policy": "forced autoregressive", "engines": {}}
    for name in args.engines:
        settings = ENGINES[name]
        llm = LLM(target, None if settings is None else drafter, **common, **(settings or {}))
        prompts = [q for _, q in load_prompts(args.prompts, llm.tokenizer)]
        report["engines"][name] = {str(c): measure(llm, prompts, c, args.max_tokens, cuda, args.kernels)
                                   for c in args.concurrency}
        llm.shutdown()
        del llm
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    report["ratios"] = {name: {c: round(point["tok_s"] / report["engines"]["ar"][c]["tok_s"], 3)
                               for c, point in points.items()}
                        for name, points in report["engines"].items() if name != "ar"} if "ar" in args.engines else {}
    for name, ratios in report["ratios"].items():
        print(f"{name} / ar tok/s: " + ", ".join(f"c={c} {r:.3f}x" for c, r in ratios.items()), flush=True)
    write_report(args.out, report)
    return report


if __name__ == "__main__":
    main()
