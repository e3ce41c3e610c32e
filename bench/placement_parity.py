"""Do the drafter's placements give the in-process engine's tokens and
acceptance lengths? Each engine generates the same prompts greedy and then
seeded-sampled, with the adaptive policy's kinds taken in fixed turns
(``--turns``) so that every engine runs the same kind of step at the same
point; it prints and writes the requests whose tokens or acceptance
lengths differ from the first in-process engine's (a second in-process
engine shows what the device itself repeats).

Greedy tokens are the target's whatever the drafts; acceptance lengths and
sampled tokens follow the drafts, so they are what shows a drafter that
proposed differently.

    python bench/placement_parity.py --device cuda --target T --drafter D --out parity.json
"""

from __future__ import annotations

import argparse
import json
import sys

from common import add_model_args, write_report
from specray import LLM, SamplingParams
from specray.cli import resolve_models

ENGINES = {
    "inprocess": {},
    "inprocess_again": {},
    "ray_colocated": dict(backend="ray", drafter_placement="colocated"),
    "ray_separate": dict(backend="ray", drafter_placement="separate", remote_step_graphs=True),
    "ray_separate_same_gpu": dict(backend="ray", drafter_placement="separate_same_gpu"),
}


def run(target: str, drafter: str, prompts: list[list[int]], args, **engine) -> dict:
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    sampled = [SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=11 + i, ignore_eos=True)
               for i in range(len(prompts))]
    extra = {"policy_turns": args.turns} if args.turns else None
    with LLM(target, drafter, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len, extra=extra,
             **engine) as llm:
        out = {}
        for name, params in (("greedy", greedy), ("sampled", sampled)):
            got = llm.generate(prompts, params)
            out[name] = [o.token_ids for o in got]
            out[name + "_acceptance"] = [o.metrics.acceptance_lengths for o in got]
        return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, "cuda")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--engines", nargs="+", choices=list(ENGINES), default=["inprocess", "inprocess_again",
                                                                          "ray_colocated", "ray_separate_same_gpu"])
    p.add_argument("--prompt-lengths", type=int, nargs="+", default=[7, 2, 198, 40, 90],
                   help="token-id prompts of these lengths (ids 2..)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--turns", type=int, nargs="*", default=[15, 7, 3, 0],
                   help="draft counts the policy takes in turn (none: the adaptive policy, timing-dependent)")
    p.add_argument("--out")
    args = p.parse_args(argv)
    target, drafter = resolve_models(args)
    if drafter is None:
        raise SystemExit("placement parity needs a drafter")
    if args.engines[0] != "inprocess":
        raise SystemExit("the first engine is the reference: inprocess")
    prompts = [[2 + (7 * i + j) % 97 for j in range(n)] for i, n in enumerate(args.prompt_lengths)]
    if any(e.startswith("ray") for e in args.engines):
        from specray.placement import ensure_ray

        ensure_ray()
    runs, differ = {}, {}
    for name in args.engines:
        try:
            runs[name] = run(target, drafter, prompts, args, **ENGINES[name])
        except Exception as e:  # a placement that cannot run here says why and the others still run
            runs[name] = {"error": repr(e)}
        ref, got = runs["inprocess"], runs[name]
        differ[name] = got if "error" in got else \
            {k: [i for i, (a, b) in enumerate(zip(ref[k], got[k])) if a != b] for k in ref}
        print(name, json.dumps(differ[name]), flush=True)
    report = {"command": " ".join(sys.argv), "prompt_lengths": args.prompt_lengths, "turns": args.turns,
              "differing_requests": differ, "runs": runs}
    write_report(args.out, report)
    return report


if __name__ == "__main__":
    main()
