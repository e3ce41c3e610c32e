"""Speculative vs autoregressive tokens/s over a closed-loop concurrency
sweep, in process, one JSON (``points``) and a PNG beside it when
matplotlib is installed.

    # the trained embedded pair, the engine's defaults (the path users run)
    python bench/concurrency_sweep.py --model embedded --device cuda \\
        --concurrency 1 2 4 8 16 32 64 --out results/h200_concurrency_sweep.json
    # a random-weight Qwen3-8B-shape target + drafter, ORACLE acceptance
    python bench/concurrency_sweep.py --model qwen3-8b-oracle --oracle-acceptance paper-qwen3-8b-gsm8k \\
        --device cuda --concurrency 1 2 4 8 16 32 64 --out results/h200_concurrency_sweep.json

Both runs write the same file: a point replaces the file's point of the
same model, profile, concurrency and temperature and keeps the others, so
a sweep may also run in pieces (``--fresh``: start the file anew).

``*-oracle`` models are ORACLE ACCEPTANCE runs (specray/oracle.py): the
target decodes every prompt alone first (the AR measurement, which records
its greedy continuations), then the speculative engine runs the drafter's
real forward but verifies the recorded continuation cut by the profile.
Their speculative tokens/s is the system's throughput at that acceptance,
never a measure of a drafter; every point, the run's settings, stdout and
the plot title carry ``oracle_acceptance``. Greedy only. The oracle engine
drafts chains (no draft trees, no prompt lookups); the AR engine runs the
engine's defaults; both use asynchronous step graphs on a GPU.

``--policy fixed`` runs the speculative engine without the adaptive policy
(every step verifies a whole block); a point's ``policy`` says which, and
points of both policies live side by side in the file and the plot.

Concurrency is closed-loop: ``c`` requests in flight, a new one admitted
as soon as one finishes, ``--rounds * c`` requests a point (at least
``--min-requests``), all with ``max_tokens`` and ``ignore_eos``, driven by
stepping the in-process engine (``EngineCore.step``) in this thread:
continuous batching as the engine does it, with no serving layer (HTTP
costs are ``specray bench serve``'s). tokens/s = output tokens / wall time
from the first admission to the last finish. Each point's workload is run
once untimed before it is timed, so graphs are captured and kernels
compiled outside the timed points (``--no-warmup`` skips it); a point's
``spec_steps`` / ``ar_steps`` count the graph captures its timed run still
paid.
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import sys
import time
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from scaling_sweep import SHAPES, random_checkpoints  # random checkpoints of real shapes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import CaptureCounter, GcWatch
from sweep_plot import plot, policy_of

from specray import LLM, SamplingParams
from specray.engine_loop import freeze_startup_heap
from specray.oracle import ORACLE_ENGINE_SETTINGS, Oracle, OracleStats, get_profile, install_oracle

MODELS = ["embedded"] + [f"{shape}-oracle" for shape in sorted(SHAPES)]
# A repeat's speculative steps, kept per run: what a run far from the others did.
RUN_STEP_FIELDS = ("steps", "speculative_steps", "autoregressive_steps", "rests", "wakes", "chain_joins",
                   "other_steps", "async_gpu_ms_per_step", "gc_full_collections", "graph_captures")


def closed_loop(engine, prompts: list, params: SamplingParams, concurrency: int) -> tuple[list, float]:
    """``concurrency`` requests in flight until every prompt ran; the final
    outputs (prompt order) and the wall seconds. ``engine.loop_steps``: the
    engine steps it took (what the steps were: ``step_counters``)."""
    tag, outs, live, i, steps = uuid.uuid4().hex[:8], {}, 0, 0, 0
    t = time.perf_counter()
    while i < len(prompts) or engine.has_unfinished():
        while i < len(prompts) and live < concurrency:
            engine.add_request(prompts[i], params, request_id=f"{tag}-{i}")
            i, live = i + 1, live + 1
        steps += 1
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
                live -= 1
    secs = time.perf_counter() - t
    engine.loop_steps = steps
    return [outs[f"{tag}-{j}"] for j in range(len(prompts))], secs


def step_counters(engine) -> dict:
    """Running totals that tell what kind of steps a point ran: async
    (graph-replayed, chained) cycles and their wall / device seconds, and
    the adaptive policy's speculative / autoregressive choices."""
    out = {"async_steps": engine.num_async_steps, "async_wall_s": engine.async_wall_s,
           "async_gpu_s": engine.async_gpu_s, "chain_joins": engine.num_chain_joins,
           "cycles": {k: list(v) for k, v in engine.cycle_costs.items()}}
    if engine.policy is not None:
        snap = engine.policy.snapshot()
        out |= {"speculative_steps": snap["speculative_steps"], "autoregressive_steps": snap["autoregressive_steps"],
                "measured": snap["measured"]}
        rest = engine.rest.snapshot()  # the resting drafter (drafter_rest.py)
        out |= {"rests": rest["rests"], "rest_probe_steps": rest["probe_steps"],
                "refilled_tokens": rest["refilled_tokens"], "wakes": engine.chain_breaks["the drafter wakes"]}
    return out


def step_summary(engine, before: dict, secs: float) -> dict:
    """What the point's steps were (``step_counters`` since ``before``)."""
    after = step_counters(engine)
    d = {k: after[k] - before[k] for k in after if k not in ("cycles", "measured")}
    steps = engine.loop_steps
    sync = steps - d["async_steps"]
    per = lambda s, n: round(1000 * s / n, 4) if n else None  # noqa: E731
    out = {"steps": steps, "wall_ms_per_step": per(secs, steps), "async_steps": d["async_steps"],
           "async_wall_ms_per_step": per(d["async_wall_s"], d["async_steps"]),
           "async_gpu_ms_per_step": per(d["async_gpu_s"], d["async_steps"]),
           # the rest of the loop's time: synchronous steps (prefills, chain starts) and the loop itself
           "other_steps": sync, "other_ms_per_step": per(secs - d["async_wall_s"], sync),
           "chain_joins": d["chain_joins"]}  # requests that joined a running chain (chain_admit.py)
    if "speculative_steps" in d:
        snap, rest = engine.policy.snapshot(), engine.rest.snapshot()
        out |= {"speculative_steps": d["speculative_steps"], "autoregressive_steps": d["autoregressive_steps"],
                "rests": d["rests"], "rest_probe_steps": d["rest_probe_steps"], "wakes": d["wakes"],
                "refilled_tokens": d["refilled_tokens"], "policy_step_ms": snap["step_ms"],
                # at the point's end: what the policy expects a row to emit (recent / settled) and the rest's state
                "policy_tokens_per_row": snap["tokens_per_speculative_row"],
                "policy_settled_tokens_per_row": snap["settled_tokens_per_row"],
                "drafter_rest": {k: rest[k] for k in ("resting", "trials", "trial_after")},
                "policy_measured": measured_summary(before["measured"], after["measured"])}
    out["cycles"] = cycle_summary(before["cycles"], after["cycles"])
    return out


def measured_summary(before: dict, after: dict) -> dict:
    """The steps the policy timed during the point, by sampling kind, padded
    size and drafts: how many and their plain mean (beside ``policy_step_ms``, its moving
    means, and ``cycles``, what every cycle cost)."""
    return {kind: summary for kind, m in after.items()
            if (summary := {key: {"n": n, "mean_ms": round(1000 * secs / n, 3)}
                            for key, n, (secs,) in _since(before.get(kind, {}), m)})}


def cycle_summary(before: dict, after: dict) -> dict:
    """The point's async cycles by the step they applied (padded size,
    ``s``peculative / ``a``utoregressive, ``+join``: requests joined in it):
    how many, their mean wall and GPU ms, tokens a cycle."""
    return {key: {"n": n, "wall_ms": round(1000 * wall / n, 3), "gpu_ms": round(1000 * gpu / n, 3),
                  "tokens": round(tokens / n, 2)}
            for key, n, (wall, gpu, tokens) in _since(before, after)}


def _since(before: dict, after: dict):
    """Of counters ``key -> [count, *sums]`` keyed by padded size first
    ("16a", "64s+join"): (key, count, sums) of what came since ``before``,
    by padded size."""
    for key in sorted(after, key=lambda k: (int(re.match(r"\d+", k).group()), k)):
        count, *sums = after[key]
        count0, *sums0 = before.get(key) or [0] * len(after[key])
        if count > count0:
            yield key, count - count0, [a - b for a, b in zip(sums, sums0)]


def workload(args, tokenizer, vocab: int) -> dict[int, list]:
    """The prompts of each concurrency: random token ids for a
    random-weight target (seeded by the concurrency), the eval set's chat
    prompts (cycled) for the embedded pair."""
    out = {}
    rows = None
    if args.model == "embedded":
        from specray.bench import load_prompts

        rows = [p for _, p in load_prompts(args.prompts, tokenizer)]
    for c in args.concurrency:
        # At least the whole prompt set: at c=1, 8 of the eval set's 48
        # prompts accepted 2.82 tokens a step where the set accepts 3.13.
        least = args.min_requests if args.min_requests is not None else len(rows) if rows else 8
        n = max(args.rounds * c, least)
        if rows is not None:
            out[c] = [rows[(c + j) % len(rows)] for j in range(n)]
        else:
            g = torch.Generator().manual_seed(1000 + c)
            out[c] = [torch.randint(1, vocab - 1, (args.prompt_len,), generator=g).tolist() for _ in range(n)]
    return out


def summarize(outs: list, secs: float) -> dict:
    tokens = sum(len(o.token_ids) for o in outs)
    steps = [a for o in outs for a in o.metrics.acceptance_lengths]
    return {"tokens": tokens, "seconds": secs, "tok_s": tokens / secs,
            "mean_acceptance_length": sum(steps) / len(steps) if steps else None}


def run_point(eng, prompts: list, args, temperature: float, c: int, captures=None,
              warm: bool = True) -> tuple[list, float, dict]:
    """One timed point: the outputs, wall seconds and what its steps were
    (``warm``: after an untimed pass of the same workload)."""
    params = SamplingParams(max_tokens=args.max_tokens, temperature=temperature, ignore_eos=True, seed=0)
    if args.warmup and warm:
        # The point's own workload, untimed: under churn the batch sizes a
        # point meets (and so the graphs it captures) depend on when its
        # requests finish, which a shorter warm-up does not reproduce.
        closed_loop(eng, prompts, params, c)
    if getattr(eng, "oracle", None) is not None:
        eng.oracle.stats = OracleStats()
    before, cap = step_counters(eng), captures.snapshot() if captures else None
    with GcWatch() as collections:
        outs, secs = closed_loop(eng, prompts, params, c)
    steps = step_summary(eng, before, secs) | collections.as_dict()
    if captures:
        steps |= captures.since(cap)
    return outs, secs, steps


def median_run(runs: list[tuple]) -> tuple:
    """Of timed runs (outputs, seconds, steps) of one workload, the one of
    median wall time."""
    return sorted(runs, key=lambda r: r[1])[len(runs) // 2]


def freeze_heap(on: bool) -> None:
    """The engines built, what the process holds so far is left out of the
    garbage collector's full collections, as the served engine's loop
    does: without it, one such collection traverses the models' and
    tokenizers' objects mid-point (``GcWatch``)."""
    if on:
        freeze_startup_heap()


def release() -> None:
    """After the last reference to an engine is dropped: its memory back."""
    gc.unfreeze()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sweep(args) -> dict:
    oracle_mode = args.model != "embedded"
    profile = get_profile(args.oracle_acceptance) if oracle_mode else None
    label = profile.name if profile else None
    if oracle_mode and any(t != 0 for t in args.temperatures):
        raise SystemExit(f"--model {args.model}: oracle acceptance is greedy only (T=0); got --temperatures "
                         f"{args.temperatures}")
    if oracle_mode:
        target, drafter = random_checkpoints(Path(args.ckpt_dir), args.model[: -len("-oracle")])
    else:
        from specray.cli import resolve_models

        target, drafter = resolve_models(argparse.Namespace(target=args.target, drafter=args.drafter,
                                                            no_drafter=False))
    # Both engines time their replays on the device (the adaptive policy's does anyway).
    common = dict(device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
                  max_num_seqs=max(args.concurrency), profile_steps=True)
    # Left out: the engine's defaults (on a GPU: CUDA graphs, asynchronous steps).
    spec_settings = (dict(ORACLE_ENGINE_SETTINGS) if profile else {}) | \
        ({"adaptive_speculation": False} if args.policy == "fixed" else {})
    common |= {k: v for k, v in (("cuda_graphs", args.cuda_graphs), ("async_scheduling", args.async_scheduling),
                                 ("gpu_memory_utilization", args.gpu_memory_utilization),
                                 ("admit_into_chain", args.admit_into_chain), ("join_batch", args.join_batch),
                                 ("join_wait_steps", args.join_wait_steps)) if v is not None}
    run = {"model": args.model, "oracle_acceptance": label, "policy": args.policy, "target": target, "drafter": drafter,
           "device": args.device, "max_tokens": args.max_tokens, "rounds": args.rounds, "repeats": args.repeats,
           "concurrency": args.concurrency, "temperatures": args.temperatures,
           "loop": "closed-loop, in-process EngineCore.step", "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    if profile:
        run["oracle_profile_source"] = profile.source
        run["oracle_profile_survival"] = list(profile.survival[:32])
        run["oracle_engine_settings"] = ORACLE_ENGINE_SETTINGS
    run["spec_settings"] = spec_settings
    ar_points: dict[tuple, dict] = {}
    captures = CaptureCounter()
    points: list[dict] = []
    tag = f"[{args.model}" + (f" ORACLE ACCEPTANCE {label}]" if label else "]")

    # The target alone (the AR measurement; in oracle mode it also records
    # the greedy continuations, so it runs first, whole).
    interleave = args.interleave and not oracle_mode
    mem = {"gpu_memory_utilization": args.gpu_memory_utilization or 0.4} if interleave and args.device != "cpu" else {}
    ar = LLM(target, None, **(common | mem))
    vocab = ar.engine.target_spec.vocab_size
    prompts = workload(args, ar.tokenizer, vocab)
    oracle = Oracle(profile, vocab) if profile else None
    run["ar_features"] = ar.engine.features()
    run["gc_freeze"] = args.gc_freeze
    freeze_heap(args.gc_freeze)
    run["order"] = ("interleaved: each point AR then speculative, both engines resident" if interleave else
                    "every AR point, then every speculative point")

    def ar_point(c, temp, outs, secs, steps):
        ar_points[(c, temp)] = {"summary": summarize(outs, secs), "outs": outs, "steps": steps}
        if oracle is not None:
            oracle.record_outputs(outs)
        print(f"{tag} AR c={c} T={temp}: {ar_points[(c, temp)]['summary']['tok_s']:.1f} tok/s", flush=True)

    def spec_point(c, temp, outs, secs, steps, paired=None):
        s, a = summarize(outs, secs), ar_points[(c, temp)]
        point = {"model": args.model, "oracle_acceptance": label, "policy": args.policy, "concurrency": c,
                 "temperature": temp,
                 "spec_tok_s": round(s["tok_s"], 2), "ar_tok_s": round(a["summary"]["tok_s"], 2),
                 "speedup": round(s["tok_s"] / a["summary"]["tok_s"], 3),
                 "mean_acceptance_length": round(s["mean_acceptance_length"], 3)
                 if s["mean_acceptance_length"] else None,
                 "requests": len(outs), "max_tokens": args.max_tokens, "spec_tokens": s["tokens"],
                 "ar_tokens": a["summary"]["tokens"], "spec_s": round(s["seconds"], 4),
                 "ar_s": round(a["summary"]["seconds"], 4), "spec_steps": steps, "ar_steps": a["steps"]}
        if paired:  # repeats, each AR then speculative: the median of their ratios
            ratios = sorted(ar_s / spec_s for ar_s, spec_s, _ in paired)
            point |= {"speedup": round(ratios[len(ratios) // 2], 3), "speedup_runs": [round(r, 3) for r in ratios],
                      "repeats": len(paired),
                      # each run in order: both engines' seconds and what the speculative one's steps were
                      "runs": [{"ar_s": round(ar_s, 4), "spec_s": round(spec_s, 4)}
                               | {k: st[k] for k in RUN_STEP_FIELDS if k in st} for ar_s, spec_s, st in paired]}
        if temp == 0:
            point["identical_outputs"] = sum(x.token_ids == y.token_ids for x, y in zip(outs, a["outs"]))
        if oracle is not None:
            # The profile's expectation with whole blocks; cut-short blocks
            # near max_tokens measure a little lower.
            point["expected_acceptance_length"] = round(expected, 3)
            point["oracle"] = oracle.stats.as_dict()
        points.append(point)
        print(f"{tag} c={c} T={temp}: spec {point['spec_tok_s']:.1f} tok/s vs AR {point['ar_tok_s']:.1f} tok/s "
              f"= {point['speedup']:.2f}x | acceptance {point['mean_acceptance_length']}"
              + (f" (profile {expected:.2f})" if expected else "")
              + (f" | identical {point['identical_outputs']}/{len(outs)}" if temp == 0 else "")
              + f" | steps {steps['steps']} ({steps['wall_ms_per_step']} ms, {steps['async_steps']} async"
              + (f", {steps['speculative_steps']} speculative" if "speculative_steps" in steps else "")
              + f"; {steps.get('graph_captures', 0)} graph captures timed)", flush=True)
        write(args, run, points)

    def build_spec():
        spec = LLM(target, drafter, **(common | mem), **spec_settings)
        if oracle is not None:
            install_oracle(spec.engine, oracle)
        run["block_size"] = spec.engine.block_size
        run["spec_features"] = spec.engine.features()
        freeze_heap(args.gc_freeze)
        return spec

    if not interleave:
        for temp in args.temperatures:
            for c in args.concurrency:
                ar_point(c, temp, *run_point(ar.engine, prompts[c], args, temp, c, captures))
        ar.shutdown()
        del ar  # the speculative engine gets the device's memory
        release()
        if torch.cuda.is_available():  # what the AR engine left allocated (should be ~0)
            run["cuda_allocated_after_ar_gib"] = round(torch.cuda.memory_allocated() / 2**30, 3)
    spec = build_spec()
    expected = profile.expected_length(spec.engine.block_size - 1) if profile else None
    for temp in args.temperatures:
        for c in args.concurrency:
            if not interleave:
                spec_point(c, temp, *run_point(spec.engine, prompts[c], args, temp, c, captures))
                continue
            ar_runs, spec_runs = [], []
            for k in range(args.repeats):
                ar_runs.append(run_point(ar.engine, prompts[c], args, temp, c, captures, warm=k == 0))
                spec_runs.append(run_point(spec.engine, prompts[c], args, temp, c, captures, warm=k == 0))
            ar_point(c, temp, *median_run(ar_runs))
            spec_point(c, temp, *median_run(spec_runs),
                       paired=[(a[1], b[1], b[2]) for a, b in zip(ar_runs, spec_runs)])
    spec.shutdown()
    del spec
    if interleave:
        ar.shutdown()
        del ar
    release()
    return write(args, run, points)


def _point_id(p: dict) -> tuple:
    return p.get("model"), p.get("oracle_acceptance"), policy_of(p), p.get("concurrency"), p.get("temperature")


def write(args, run: dict, points: list[dict]) -> dict:
    """Merge into ``--out``: this run's points replace earlier points of the
    same model, profile, concurrency and temperature (a sweep may be run in
    pieces); every other point stays. The run entry (settings) of this
    model and profile is this run's."""
    path = Path(args.out)
    report = {"points": [], "runs": {}}
    if path.is_file() and not args.fresh:
        report = json.loads(path.read_text())
    mine = {_point_id(p) for p in points}
    report["points"] = [p | {"policy": policy_of(p)} for p in report.get("points", []) if _point_id(p) not in mine]
    report["points"] += points
    report["points"].sort(key=lambda p: (str(p.get("model")), str(p.get("oracle_acceptance")), p["policy"],
                                         p.get("temperature") or 0, p.get("concurrency") or 0))
    key = run["model"] + (f"@{run['oracle_acceptance']}" if run["oracle_acceptance"] else "") + \
        ("#fixed" if run.get("policy") == "fixed" else "")
    report.setdefault("runs", {})[key] = run
    report["description"] = ("spec vs AR tok/s, closed-loop concurrency, in process (bench/concurrency_sweep.py). "
                              "Points with oracle_acceptance set are ORACLE ACCEPTANCE runs: a random-weight "
                              "target verifying its own recorded greedy continuation cut by that profile "
                              "(system throughput at that acceptance, not a drafter's quality).")
    args.fresh = False  # the file is this run's now: later points merge
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    return report


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, choices=MODELS)
    p.add_argument("--oracle-acceptance", default="paper-qwen3-8b-gsm8k",
                   help="*-oracle models: a profile (specray.oracle.PROFILES: paper-qwen3-8b-gsm8k, "
                        "embedded-eval) or const:P")
    p.add_argument("--policy", choices=["adaptive", "fixed"], default="adaptive",
                   help="the speculative engine's: the adaptive policy (the default) or fixed blocks every step")
    p.add_argument("--target", help="embedded: another target directory")
    p.add_argument("--drafter", help="embedded: another drafter directory")
    p.add_argument("--ckpt-dir", default="/tmp/specray-random-checkpoints",
                   help="*-oracle: where random checkpoints are written once and reused (8B: ~17 GB, 32B: ~66 GB)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=4, help="requests a point = rounds x concurrency")
    p.add_argument("--min-requests", type=int,
                   help="requests a point at least (default: embedded, the prompt set's size; oracle models, 8)")
    p.add_argument("--prompt-len", type=int, default=64, help="*-oracle: random prompt length")
    p.add_argument("--prompts", default="data/prompts/eval.jsonl", help="embedded: the prompt set")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="both engines (default: the engine's, on with a GPU; off CUDA: the same padded path)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="both engines (default: the engine's, on with CUDA graphs on a GPU)")
    p.add_argument("--gpu-memory-utilization", type=float,
                   help="both engines (default: the engine's; 0.4 when --interleave keeps both resident)")
    p.add_argument("--admit-into-chain", action=argparse.BooleanOptionalAction, default=None,
                   help="both engines (default: the engine's, on): waiting requests join running chains")
    p.add_argument("--join-batch", type=int, help="both engines: requests that join a chain together (join_batch)")
    p.add_argument("--join-wait-steps", type=int, help="both engines: steps a join waits for them at most")
    p.add_argument("--no-warmup", dest="warmup", action="store_false")
    p.add_argument("--gc-freeze", action=argparse.BooleanOptionalAction, default=True,
                   help="leave the engines' start-up heap out of full garbage collections (as the served "
                        "engine's process does); each point reports the full collections it met")
    p.add_argument("--repeats", type=int, default=3,
                   help="interleaved: timed runs a point, each AR then speculative; a point reports the median "
                        "tok/s of each and the median of the paired ratios (the machine drifts between runs)")
    p.add_argument("--interleave", action=argparse.BooleanOptionalAction, default=True,
                   help="embedded: both engines resident (each at --gpu-memory-utilization, default 0.4), each "
                        "point run AR then speculative back to back, so machine drift falls on both alike "
                        "(oracle models always run every AR point first: they record its outputs)")
    p.add_argument("--fresh", action="store_true", help="overwrite --out instead of merging into it")
    p.add_argument("--out", default="results/concurrency_sweep.json")
    args = p.parse_args(argv)
    if args.model != "embedded":
        get_profile(args.oracle_acceptance)  # a bad name fails before any model loads
    report = sweep(args)
    png = str(Path(args.out).with_suffix(".png"))
    print(f"wrote {args.out}" + (f" and {png}" if plot(report, png) else " (no matplotlib: no plot)"))
    return report


if __name__ == "__main__":
    main()
