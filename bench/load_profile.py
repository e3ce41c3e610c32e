"""Where the time of a closed-loop point goes, speculative engine against
autoregressive: the same prompts at one concurrency and temperature run by
the AR engine, the speculative engine (defaults), and the speculative
engine forced to autoregressive steps (its policy answers "no" every
step), each run once untimed (graph captures, kernel compiles), then
timed clean, then once more under cProfile (the host's
functions by own time), with why each chain of asynchronous steps ended.

    python bench/load_profile.py --device cuda --concurrency 64 --temperature 0 \\
        --out results/h200_load_profile_c64.json

What it says: ``forced_ar`` against ``ar`` isolates what a speculative
engine's autoregressive step costs beyond the AR engine's (the drafter's
context store, the taps, the host's bookkeeping); ``chain_breaks`` counts
the synchronous steps a point fell back to, by the rule that ended the
chain. cProfile slows the host: its tok/s are not the point's.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import CaptureCounter, write_report
from concurrency_sweep import closed_loop, step_counters, step_summary

from specray import LLM, SamplingParams
from specray.bench import load_prompts
from specray.phase_timer import PhaseTimer, per_cycle


def host_top(prof: cProfile.Profile, n: int, key: str = "own_ms", files: str | None = None) -> list[dict]:
    """The ``n`` functions with the most ``key`` time ("own_ms" or
    "cum_ms"), of files whose path contains ``files`` (all: None)."""
    st = pstats.Stats(prof, stream=io.StringIO())
    rows = []
    for (file, line, fn), (_cc, nc, tt, ct, _callers) in st.stats.items():
        if files is None or files in file:
            rows.append({"function": f"{Path(file).name}:{line}:{fn}", "calls": nc,
                         "own_ms": round(1000 * tt, 2), "cum_ms": round(1000 * ct, 2)})
    rows.sort(key=lambda r: -r[key])
    return rows[:n]


def run_variant(llm, prompts, params, c: int, force_ar: bool, top: int, captures: CaptureCounter,
                phases: bool = False) -> dict:
    eng = llm.engine
    if force_ar:
        if eng.policy is None:
            raise SystemExit(f"forced_ar needs the adaptive policy: {eng.features().get('adaptive_speculation')}")
        eng.policy.choose = lambda n, kind: False
    closed_loop(eng, prompts, params, c)  # untimed: graphs captured, kernels compiled
    breaks, joins = Counter(eng.chain_breaks), eng.num_chain_joins
    before, cap = step_counters(eng), captures.snapshot()
    outs, secs = closed_loop(eng, prompts, params, c)
    tokens = sum(len(o.token_ids) for o in outs)
    out = {"tok_s": round(tokens / secs, 1), "seconds": round(secs, 4), "tokens": tokens,
           "steps": step_summary(eng, before, secs) | captures.since(cap),
           "chain_breaks": dict(eng.chain_breaks - breaks), "chain_joins": eng.num_chain_joins - joins}
    acc = [a for o in outs for a in o.metrics.acceptance_lengths]
    out["mean_acceptance_length"] = round(sum(acc) / len(acc), 3) if acc else None
    if phases:
        timer = PhaseTimer(eng)
        try:
            closed_loop(eng, prompts, params, c)
        finally:
            timer.close()
        out["phases"] = per_cycle(timer.totals())
    prof = cProfile.Profile()
    prof.enable()
    t = time.perf_counter()
    closed_loop(eng, prompts, params, c)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    out["profiled_seconds"] = round(time.perf_counter() - t, 4)
    prof.disable()
    out["host_top"] = host_top(prof, top)
    # the project's own functions by inclusive time: which engine path the time is in
    root = str(Path(__file__).resolve().parents[1])
    out["host_top_cumulative"] = host_top(prof, top, "cum_ms", root)
    out["tokens_ids"] = [o.token_ids for o in outs]
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--prompts", default="data/prompts/eval.jsonl")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--variants", nargs="+", default=["ar", "spec", "forced_ar"],
                   choices=["ar", "spec", "forced_ar"])
    p.add_argument("--phases", action="store_true",
                   help="also time the engine's phases (no profiler), join cycles apart from the others")
    p.add_argument("--out", default="results/load_profile.json")
    args = p.parse_args(argv)
    from specray.cli import resolve_models

    target, drafter = resolve_models(argparse.Namespace(target=None, drafter=None, no_drafter=False))
    c = args.concurrency
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=True, seed=0)
    report = {"device": args.device, "concurrency": c, "temperature": args.temperature,
              "max_tokens": args.max_tokens, "variants": {}}
    common = dict(device=args.device, max_num_seqs=c)
    prompts, captures = None, CaptureCounter()
    for name in args.variants:
        llm = LLM(target, None if name == "ar" else drafter, **common, profile_steps=True)
        if prompts is None:
            rows = [q for _, q in load_prompts(args.prompts, llm.tokenizer)]
            prompts = [rows[(c + j) % len(rows)] for j in range(args.rounds * c)]
        v = run_variant(llm, prompts, params, c, name == "forced_ar", args.top, captures, args.phases)
        report["variants"][name] = v
        s = v["steps"]
        print(f"{name}: {v['tok_s']} tok/s, {s['steps']} steps, async {s['async_steps']} at "
              f"{s['async_wall_ms_per_step']} ms (GPU {s['async_gpu_ms_per_step']}), other {s['other_steps']} at "
              f"{s['other_ms_per_step']} ms, breaks {v['chain_breaks']}, joins {v['chain_joins']}, {s['graph_captures']} captures timed", flush=True)
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    ids = {k: v.pop("tokens_ids") for k, v in report["variants"].items()}
    if args.temperature == 0 and "ar" in ids:
        report["identical_to_ar"] = {k: sum(a == b for a, b in zip(v, ids["ar"])) for k, v in ids.items()}
    if "ar" in report["variants"]:
        ar = report["variants"]["ar"]["tok_s"]
        report["tok_s_over_ar"] = {k: round(v["tok_s"] / ar, 3) for k, v in report["variants"].items()}
    report["command"] = "python " + " ".join(sys.argv)
    write_report(args.out, report)
    return report


if __name__ == "__main__":
    main()
