#!/usr/bin/env python
"""Train a DFlash drafter for the embedded default target (SmolLM2-135M-
Instruct) with ``specray.training``, then answer one prompt with it and
print its acceptance. Any ``specray train-drafter`` flag passes through.

    python examples/train_drafter.py --out runs/drafter --device cuda
    python examples/train_drafter.py --out runs/drafter --device cuda --resume   # after an interruption

It is meant for a GPU: on a CPU the target runs in fp32 (on a busy 2-core
machine a batch of 32 answers came at ~3 tok/s in all), so a smoke run
there stays tiny and gets a generous time budget:

    python examples/train_drafter.py --out runs/tiny --device cpu --num-prompts 16 --magpie 0 \\
        --sampled-answers 0 --max-new-tokens 32 --gen-batch-size 16 --batch-seqs 4 --anchors 8 \\
        --max-steps 20 --log-every 5 --time-budget-s 7200
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
