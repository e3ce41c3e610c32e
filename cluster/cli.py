"""``specray`` command line: generate | serve | batch | bench | train-drafter."""

from __future__ import annotations

import argparse
import json
import sys
import time


def add_model_args(p, prompt_lookup: bool = True) -> None:
    """The model flags every command shares (a parser or an argument group);
    ``resolve_models`` turns them into checkpoint directories. A command that
    sets prompt lookup itself leaves out its flag (``prompt_lookup=False``)."""
    p.add_argument("--target", help="target checkpoint directory (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--drafter", help="DFlash drafter directory (default: the embedded drafter for the default target)")
    p.add_argument("--no-drafter", action="store_true", help="decode autoregressively (the baseline)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--num-speculative-tokens", type=int,
                   help="drafts per step (default: the drafter's block size - 1; fewer: it drafts a shorter block)")
    if prompt_lookup:
        p.add_argument("--prompt-lookup-min", type=int,
                       help="draft from the request's own earlier text when its last N+ tokens occurred before "
                            "(shortest match; 0: drafter only; default: 1 when lookups must agree with the "
                            "drafter, else 2)")
        p.add_argument("--prompt-lookup-agree", action=argparse.BooleanOptionalAction, default=None,
                       help="take a greedy request's lookup draft only where it opens with the drafter's first "
                            "draft token (the drafter then runs every step; default: on with async scheduling)")
        p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                       help="launch each decode step before the previous one is read (default: on with CUDA "
                            "graphs on a GPU)")
        p.add_argument("--draft-tree", action=argparse.BooleanOptionalAction, default=None,
                       help="requests verify a tree of the drafter's likeliest continuations instead of one "
                            "chain (default: on where the target and drafter share a process)")


def drafting_args(args) -> dict:
    """The engine settings of the drafting flags (prompt lookup, draft
    trees; a flag left out keeps the engine's default)."""
    return {name: getattr(args, name) for name in ("prompt_lookup_min", "prompt_lookup_agree", "draft_tree")
            if getattr(args, name, None) is not None}


def resolve_models(args) -> tuple[str, str | None]:
    """Explicit directories, or the embedded default pair."""
    target, drafter = args.target, args.drafter
    if target is None:
        from specray.default_model import default_drafter_dir, ensure_default_target

        target = str(ensure_default_target())
        if drafter is None and not args.no_drafter:
            drafter = default_drafter_dir()
    if args.no_drafter:
        drafter = None
    return target, drafter


def _sampling(args):
    from specray import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
        min_tokens=args.min_tokens,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
    )


def cmd_generate(args) -> int:
    from specray import LLM

    target, drafter = resolve_models(args)
    t = time.perf_counter()
    llm = LLM(target, drafter, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
              num_speculative_tokens=args.num_speculative_tokens, async_scheduling=args.async_scheduling,
              **drafting_args(args))
    load_s = time.perf_counter() - t
    prompt = args.prompt
    if args.chat and llm.tokenizer is not None:
        from specray.detokenizer import chat_prompt_ids

        prompt = chat_prompt_ids(llm.tokenizer, [{"role": "user", "content": prompt}])
    t = time.perf_counter()
    out = llm.generate(prompt, _sampling(args))[0]
    gen_s = time.perf_counter() - t
    m = out.metrics
    stats = {
        "tokens": len(out.token_ids),
        "finish_reason": out.finish_reason,
        "decode_steps": len(m.acceptance_lengths),
        "mean_acceptance_length": round(m.mean_acceptance_length, 3),
        "acceptance_lengths": m.acceptance_lengths,
        "tokens_per_s": round(len(out.token_ids) / gen_s, 2),
        "load_s": round(load_s, 2),
        "drafter": drafter,
    }
    print(out.text)
    print(json.dumps(stats) if args.json else "\n-- " + ", ".join(f"{k}={v}" for k, v in stats.items() if k != "acceptance_lengths"))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specray", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt and print acceptance stats")
    add_model_args(g)
    g.add_argument("prompt")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int)
    g.add_argument("--stop", action="append")
    g.add_argument("--min-tokens", type=int, default=0, help="no stop ends the output before this many tokens")
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--json", action="store_true", help="print the stats as one JSON line")
    g.set_defaults(func=cmd_generate)

    # Each remaining command lives beside the code it drives and
    # configures its own arguments.
    for name, module, help_ in (
        ("serve", "specray.serve.cli", "run the OpenAI-compatible HTTP + gRPC server on Ray Serve"),
        ("batch", "specray.batch", "batch generation over JSONL / Parquet (also a `ray job submit` entry point)"),
        ("bench", "specray.bench", "speculative vs autoregressive throughput on the evaluation set "
                                    "(`bench serve`: load on the HTTP server)"),
        ("train-drafter", "specray.training.cli", "train a DFlash drafter for a target by self-distillation"),
    ):
        # add_help=False: --help reaches the module's own parser.
        p = sub.add_parser(name, help=help_, add_help=False)
        p.set_defaults(module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    from specray.config import ConfigError

    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if getattr(args, "module", None):
        import importlib

        return importlib.import_module(args.module).main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return args.func(args)
    except (ConfigError, ValueError, FileNotFoundError, MemoryError) as e:
        print(f"specray: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
