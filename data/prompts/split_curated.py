"""Screen the hand-written prompt batches in curated/ and split them into a
training set (curated.jsonl) and a held-out development set (dev.jsonl).

A prompt is dropped when it near-duplicates an eval prompt (the rule of
make_train_prompts.py: normalized equality or word-trigram Jaccard >= 0.5),
touches an eval-only subject, or repeats an earlier prompt. The development
set takes DEV_PER_CATEGORY prompts of each category at random (fixed seed);
it picks between drafters so that the eval set is never looked at for that.
The batches of TRAIN_ONLY_SOURCES, written after the development set was
drawn, go to training only, and are also dropped when near a dev prompt.

    python data/prompts/split_curated.py           # writes curated.jsonl, dev.jsonl
    python data/prompts/split_curated.py --check   # exit 1 if they differ
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import random
import sys

HERE = pathlib.Path(__file__).resolve().parent
SOURCES = ["chat", "math", "code", "summ_a", "summ_b"]
# Written later: screened the same way, training only, so that dev.jsonl stays
# the set every earlier drafter was chosen on.
TRAIN_ONLY_SOURCES = ["chat_b", "chat_c", "math_b", "code_b", "code_c", "summ_c", "summ_d", "summ_e"]
DEV_PER_CATEGORY = 12
SEED = 20261129


def rules():
    spec = importlib.util.spec_from_file_location("make_train_prompts", HERE / "make_train_prompts.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build(src_dir: pathlib.Path) -> tuple[list[dict], list[dict], dict]:
    mtp = rules()
    index = mtp.EvalIndex(mtp.load_eval(HERE / "eval.jsonl"))
    seen, dropped = set(), {"near_eval": [], "eval_subject": [], "repeat": 0, "near_dev": []}

    def screen(names: list[str], dev_index=None) -> list[dict]:
        kept = []
        for name in names:
            for line in (src_dir / f"{name}.jsonl").read_text().splitlines():
                if not line.strip():
                    continue
                row = json.loads(line)
                text = mtp.prompt_text(row["messages"])
                key = mtp.normalize(text)
                if key in seen:
                    dropped["repeat"] += 1
                elif index.near(text):
                    dropped["near_eval"].append(row["id"])
                elif any(p in text.lower() for p in mtp.EVAL_ONLY_PHRASES):
                    dropped["eval_subject"].append(row["id"])
                elif dev_index is not None and dev_index.near(text):
                    dropped["near_dev"].append(row["id"])
                else:
                    seen.add(key)
                    kept.append(row)
        return kept

    kept = screen(SOURCES)
    rng = random.Random(SEED)
    dev_ids = set()
    for cat in sorted({r["category"] for r in kept}):
        ids = [r["id"] for r in kept if r["category"] == cat]
        dev_ids.update(rng.sample(ids, DEV_PER_CATEGORY))
    dev = [r for r in kept if r["id"] in dev_ids]
    # The later batches were written after dev was drawn: they are also kept
    # away from it, by the rule that keeps everything away from eval.
    dev_index = mtp.EvalIndex([mtp.prompt_text(r["messages"]) for r in dev])
    train = [r for r in kept if r["id"] not in dev_ids] + screen(TRAIN_ONLY_SOURCES, dev_index)
    return train, dev, dropped


def dump(rows: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", type=pathlib.Path, default=HERE / "curated")
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    train, dev, dropped = build(args.src)
    outs = {HERE / "curated.jsonl": dump(train), HERE / "dev.jsonl": dump(dev)}
    if args.check:
        stale = [p.name for p, text in outs.items() if not p.is_file() or p.read_text() != text]
        if stale:
            sys.exit(f"differs from the sources: {', '.join(stale)}")
        print("curated.jsonl and dev.jsonl match the sources")
        return
    for path, text in outs.items():
        path.write_text(text)
    print(f"train {len(train)}, dev {len(dev)}; dropped: {len(dropped['near_eval'])} near an eval prompt "
          f"{dropped['near_eval']}, {len(dropped['eval_subject'])} on an eval-only subject {dropped['eval_subject']}, "
          f"{dropped['repeat']} repeats, {len(dropped['near_dev'])} later-batch prompts near a dev prompt "
          f"{dropped['near_dev']}")


if __name__ == "__main__":
    main()
