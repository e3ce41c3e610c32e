#!/usr/bin/env python
"""Train a DFlash drafter for the embedded default target (SmolLM2-135M-
Instruct) with ``specray.training``, then answer one prompt with it and
print its acceptance. Any ``specray train-drafter`` flag passes through.

    python examples/train_drafter.py --out runs/drafter --device cuda
    python examples/train_drafter.py --out runs/drafter --device cuda --resume   # after an interruption

On a CPU, a run small enough to watch (a few minutes; the drafter it
leaves is far from the shipped one):

    python examples/train_drafter.py --out runs/tiny --device cpu --num-prompts 64 --magpie 0 \\
        --sampled-answers 0 --max-new-tokens 48 --gen-batch-size 32 --batch-seqs 8 --anchors 8 \\
        --max-steps 40 --log-every 10 --time-budget-s 600
"""

import sys

from specray import LLM, SamplingParams
from specray.default_model import ensure_default_target
from specray.detokenizer import chat_prompt_ids
from specray.training.cli import train_drafter


def main(argv: list[str]) -> None:
    target = str(ensure_default_target())
    summary = train_drafter(["--target", target, *argv])
    if "architecture" not in summary:  # --gen-only: data only
        return
    out = summary["args"]["out"]
    llm = LLM(target, out, device=summary["args"]["device"])
    prompt = chat_prompt_ids(llm.tokenizer, [{"role": "user", "content": "Why is the sky blue?"}])
    result = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=96))[0]
    print(result.text)
    print(f"-- drafter {out}: {summary['steps']} steps, mean acceptance length "
          f"{result.metrics.mean_acceptance_length:.2f} over {len(result.metrics.acceptance_lengths)} steps")


if __name__ == "__main__":
    main(sys.argv[1:])
