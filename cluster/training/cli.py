"""``specray train-drafter``: train a DFlash drafter (arXiv 2602.06036) for
a Hugging Face target by self-distillation.

    specray train-drafter --target DIR --out runs/drafter --device cuda --gen-only
    specray train-drafter --target DIR --out runs/drafter --device cuda
    specray train-drafter --out runs/drafter --resume    # continue an interrupted run

Stage 1 (data, specray.training.selfdistill): the target answers the prompt
files, its own Magpie user messages and sampled answers to
--sampled-prompts, on specray's static-batch, CUDA-graphed generator. The
token sequences are cached in OUT/data.pt, so a rerun skips this stage.

Stage 2 (train, specray.training.trainer): the frozen target runs once over
every sequence and the tapped hidden states stay on the device (bf16, ~5.8
KB a token for five taps of 576). Each step takes a batch of sequences and
many anchors per sequence; anchor ``a`` (a response position) gives the
block ``[tok_a, MASK x (B-1)]`` at positions ``a .. a+B-1`` that sees the
context features of positions ``< a`` and its own rows (non-causal). Loss:
cross-entropy of rows 1..B-1 through the target's lm_head, weighted by
exp(-(k-1)/gamma).

The defaults are the first stage of the shipped drafter's recipe: 4 layers,
14 M tokens, a 750 s budget for features + training on the cached data
(~165 s of data generation before it, in its own run). It was then
continued five times with ``--init-from`` and ``--warmup-steps 50``: twice
on the same data (``--lr 3e-4`` for 760 s, ``--lr 2e-4`` for 380 s), then
three times on fresh data weighted toward the hand-written prompts
(``--magpie 20000 --sampled-answers 12`` with ``--seed`` 0, 1, 2; ``--lr``
3e-4, 2e-4, 3e-4; ~450, 320, 470 s of training; the last one after the
hand-written prompts doubled). Each stage's training.json lists every
argument (the last stage's beside the checkpoint, the others in
``earlier_stages/``).

OUT/ ends up a drafter in the DFlash authors' format (config.json +
model.safetensors in bf16) that ``specray serve --drafter OUT`` and
``dflash.model.DFlashDraftModel`` load, plus train_log.jsonl,
training.json and train_state.pt (what --resume continues from: saved
every --save-every-s / --save-every-steps and at the end).
"""

from __future__ import annotations

import argparse
from pathlib import Path
import sys

from specray.training.prompts import prompts_dir


def build_parser() -> argparse.ArgumentParser:
    prompts = prompts_dir()
    p = argparse.ArgumentParser(prog="specray train-drafter", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--target", help="HF directory of the target (safetensors); required unless --resume")
    a("--prompts", nargs="+", default=[str(prompts / "train.jsonl"), str(prompts / "curated.jsonl")],
      help="JSONL files of {'messages': [...]} chat prompts, answered greedily")
    a("--out", required=True, help="output directory (drafter checkpoint, data.pt, logs, training state)")
    a("--resume", action="store_true",
      help="continue the run in --out from its last saved training state, with its arguments (flags given "
           "here replace them)")
    a("--device", help="default: cuda when available, else cpu")
    a("--seed", type=int, default=0)
    a("--time-budget-s", type=float, default=750.0,
      help="wall budget from start for generation + features + training (training stops --reserve-s before it)")
    a("--reserve-s", type=float, default=8.0, help="kept for the final save and summary")
    g = p.add_argument_group("stage 1: self-distillation data").add_argument
    g("--num-prompts", type=int, default=0, help="use the first N prompts (0 = all)")
    g("--max-new-tokens", type=int, default=256)
    g("--gen-batch-size", type=int, default=1024, help="sequences per static generation batch")
    g("--magpie", type=int, default=60000, help="user messages the target writes itself, added to the prompts")
    g("--magpie-max-tokens", type=int, default=128)
    g("--magpie-temperature", type=float, default=1.0)
    g("--magpie-top-p", type=float, default=1.0)
    g("--magpie-systems", default=str(prompts / "magpie_systems.txt"),
      help="file of system prompts (one a line) that steer the self-written messages; '' = the template's default")
    g("--magpie-budget-frac", type=float, default=0.3, help="share of --gen-time-budget-s for writing prompts")
    g("--exclude-prompts", nargs="*", default=[str(prompts / "eval.jsonl"), str(prompts / "dev.jsonl")],
      help="drop self-written messages that near-duplicate the prompts of these files (none given = keep all)")
    g("--max-train-tokens", type=int, default=14_000_000,
      help="use sequences up to this many tokens in all (their features stay on the device); 0 = all")
    g("--gen-time-budget-s", type=float, default=270.0, help="no new generation batch after this")
    g("--temperature", type=float, default=0.0, help="0 = greedy self-distillation")
    g("--top-p", type=float, default=1.0)
    g("--sampled-prompts", nargs="*", default=[str(prompts / "curated.jsonl")],
      help="JSONL prompt files that also get sampled answers")
    g("--sampled-answers", type=int, default=4, help="sampled answers per --sampled-prompts prompt")
    g("--sampled-temperature", type=float, default=0.8)
    g("--sampled-top-p", type=float, default=0.95)
    g("--regen", action="store_true", help="ignore a cached OUT/data.pt")
    g("--gen-only", action="store_true", help="stop after stage 1 (OUT/data.pt)")
    m = p.add_argument_group("drafter").add_argument
    m("--draft-layers", type=int, default=None,
      help="default 4; with --init-from, more than the checkpoint's layers grows it (new layers added last)")
    m("--intermediate-size", type=int, default=0, help="0 = the target's")
    m("--target-layer-ids", default="", help="comma list; default: 5 taps spaced as build_target_layer_ids(L, 5)")
    m("--block-size", type=int, default=None, help="default 16")
    m("--mask-token-id", type=int, default=None)
    m("--init", choices=("target", "random"), default="target",
      help="how new layers start (with --init-from: only the layers growing adds)")
    m("--init-from", default="", help="continue training this drafter checkpoint (its config sets the "
      "architecture; the learning-rate schedule starts afresh); architecture flags given with it must agree with it")
    m("--max-ckpt-mb", type=float, default=32.0)
    t = p.add_argument_group("stage 2: training").add_argument
    t("--batch-seqs", type=int, default=96, help="sequences per step")
    t("--anchors", type=int, default=24, help="blocks per sequence per step")
    t("--lr", type=float, default=6e-4)
    t("--min-lr-ratio", type=float, default=0.1)
    t("--warmup-steps", type=int, default=200)
    t("--weight-decay", type=float, default=0.01)
    t("--clip", type=float, default=1.0)
    t("--soft-top-k", type=int, default=0,
      help="keep the target's top-k next-token log-probs and train on them too (0 = the data's tokens only)")
    t("--soft-weight", type=float, default=0.5, help="share of the soft-target loss when --soft-top-k > 0")
    t("--gamma", type=float, default=7.0, help="loss weight exp(-(k-1)/gamma) of block row k")
    t("--max-steps", type=int, default=0, help="0 = until the time budget")
    t("--log-every", type=int, default=100)
    t("--save-every-s", type=float, default=30.0,
      help="save the training state (and, without a validation set, the checkpoint) this often")
    t("--save-every-steps", type=int, default=0, help="... and every this many steps (0 = by time only)")
    t("--val-frac", type=float, default=0.02)
    t("--max-seq-len", type=int, default=2048)
    t("--feat-batch-tokens", type=int, default=65536)
    e = p.add_argument_group("optional evaluation through specray").add_argument
    e("--eval-prompts", default="")
    e("--eval-n", type=int, default=0)
    e("--eval-max-tokens", type=int, default=128)
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.resume:
        from specray.training.resume import saved_args

        # argparse leaves attributes already in the namespace alone unless
        # the flag is given: the saved arguments, overridden by this command line.
        args = p.parse_args(argv, namespace=argparse.Namespace(**saved_args(Path(args.out))))
        # The run goes on with the data it trained on.
        args.resume, args.regen, args.gen_only = True, False, False
    if not args.target:
        p.error("--target is required")
    return args


def train_drafter(argv=None) -> dict:
    """Runs both stages; returns the summary written to OUT/training.json
    (``--gen-only``: the data's metadata)."""
    from specray.training.run import run

    return run(parse_args(argv))


def main(argv=None) -> int:
    train_drafter(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
