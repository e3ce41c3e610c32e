"""The committed prompt sets stay apart from the evaluation set."""

import importlib.util
import json
from collections import Counter
from pathlib import Path

PROMPTS = Path(__file__).resolve().parents[1] / "data" / "prompts"


def _module(name):
    spec = importlib.util.spec_from_file_location(name, PROMPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rows(name):
    return [json.loads(line) for line in (PROMPTS / name).read_text().splitlines() if line.strip()]


def test_curated_and_dev_are_what_the_split_makes_and_never_near_eval():
    split, mtp = _module("split_curated"), _module("make_train_prompts")
    train, dev, _ = split.build(PROMPTS / "curated")
    assert _rows("curated.jsonl") == train and _rows("dev.jsonl") == dev
    assert Counter(r["category"] for r in dev) == {c: split.DEV_PER_CATEGORY for c in
                                                   ("chat", "math", "code", "summarization")}
    index = mtp.EvalIndex(mtp.load_eval(PROMPTS / "eval.jsonl"))
    dev_keys = {mtp.normalize(mtp.prompt_text(r["messages"])) for r in dev}
    for row in train + dev:
        text = mtp.prompt_text(row["messages"])
        assert not index.near(text), row["id"]
        assert not any(p in text.lower() for p in mtp.EVAL_ONLY_PHRASES), row["id"]
    assert not dev_keys & {mtp.normalize(mtp.prompt_text(r["messages"])) for r in train}
    later = tuple(f"cur-{n.replace('_', '-')}-" for n in split.TRAIN_ONLY_SOURCES)
    dev_index = mtp.EvalIndex([mtp.prompt_text(r["messages"]) for r in dev])
    later_rows = [r for r in train if r["id"].startswith(later)]
    assert later_rows
    for row in later_rows:
        assert not dev_index.near(mtp.prompt_text(row["messages"])), row["id"]
