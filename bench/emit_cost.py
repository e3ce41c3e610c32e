"""What the host pays per emitted token to append it to a request: stop
rules, detokenization, its text. The token-by-token append with the
tokenizer's own ``decode`` (what every row paid before runs were decoded
at once) against the run append with ``text_decoder``, on the default
target's tokenizer and the eval set's text, at 1 token a row a step (an
autoregressive step) and at 3 (a speculative one at acceptance ~3).

    python bench/emit_cost.py --out results/cpu_emit_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
import types

from specray import SamplingParams
from specray.bench import save_report
from specray.detokenizer import decodes_in_runs, init_detokenizer, text_decoder
from specray.engine import EngineCore
from specray.request import Request, Status

# A stop string that never occurs: it keeps the token-by-token append.
_NEVER = "\x00never\x00"


class _Scheduler:
    def finish(self, r, reason):
        r.status, r.finish_reason = Status.FINISHED, reason


def us_per_token(tokenizer, ids: list[int], decode, runs: bool, per_step: int, stop, requests: int,
                 repeats: int) -> float:
    """The best of ``repeats`` passes: microseconds a token to append
    ``requests`` requests' 128 tokens, ``per_step`` tokens a call."""
    core = types.SimpleNamespace(scheduler=_Scheduler(), tokenizer_lock=threading.Lock(), _decode=decode,
                                 _decode_runs=runs, max_model_len=1 << 20)
    core._append_run = types.MethodType(EngineCore._append_run, core)
    prompt, best = ids[:300], float("inf")
    for _ in range(repeats):
        t, n = time.perf_counter(), 0
        for j in range(requests):
            r = Request("r", None, prompt, SamplingParams(max_tokens=128, ignore_eos=True, stop=stop), 0, (2,))
            init_detokenizer(r)
            out = ids[300 + j * 128 : 300 + (j + 1) * 128]
            for i in range(0, len(out), per_step):
                n += EngineCore._append(core, r, out[i : i + per_step])
        best = min(best, (time.perf_counter() - t) / n * 1e6)
    return best


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", default="data/prompts/eval.jsonl")
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out")
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    from specray.default_model import ensure_default_target

    tokenizer = AutoTokenizer.from_pretrained(str(ensure_default_target()), local_files_only=True)
    with open(args.prompts) as f:
        text = " ".join(json.dumps(json.loads(line)) for line in f)
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < 300 + 128 * args.requests:
        p.error(f"--prompts {args.prompts}: too little text for --requests {args.requests}")

    def wrapped(token_ids, skip):
        return tokenizer.decode(token_ids, skip_special_tokens=skip)

    fast, runs = text_decoder(tokenizer), decodes_in_runs(tokenizer)
    report = {"command": "python bench/emit_cost.py" + (f" --out {args.out}" if args.out else ""),
              "tokenizer": "SmolLM2-135M-Instruct (the default target)", "byte_level_runs": runs,
              "load_average": [round(x, 2) for x in os.getloadavg()], "requests": args.requests, "tokens_per_request": 128, "unit": "us per emitted token, best pass",
              "points": []}
    for per_step in (1, 3):
        before = us_per_token(tokenizer, ids, wrapped, False, per_step, [_NEVER], args.requests, args.repeats)
        after = us_per_token(tokenizer, ids, fast, runs, per_step, None, args.requests, args.repeats)
        report["points"].append({"tokens_per_step": per_step, "token_by_token_hf_decode_us": round(before, 2),
                                 "run_append_fast_decode_us": round(after, 2), "ratio": round(before / after, 2)})
        print(f"{per_step} token(s) a row a step: {before:.2f} -> {after:.2f} us a token ({before / after:.2f}x)")
    return save_report(report, args.out)


if __name__ == "__main__":
    main()
