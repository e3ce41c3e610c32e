"""bench/acceptance_by_confidence.py: step boundaries from acceptance lengths,
and a run on a tiny random target and drafter."""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

from factories import add_tokenizer, make_drafter, make_target

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import acceptance_by_confidence as abc


def test_first_draft_of_each_step():
    # steps of 1, 3, 1, 2 tokens over a 7-token answer: anchors 0, 1, 4, 5
    out = SimpleNamespace(token_ids=list(range(7)), metrics=SimpleNamespace(acceptance_lengths=[1, 3, 1, 2]))
    assert abc.first_draft_outcomes(out) == [(1, False), (2, True), (5, False), (6, True)]
    # a step that starts on the last token drafts nothing that was kept
    out = SimpleNamespace(token_ids=[4, 5], metrics=SimpleNamespace(acceptance_lengths=[1, 1]))
    assert abc.first_draft_outcomes(out) == [(1, False)]


def test_runs_on_a_tiny_model(tmp_path):
    hf = make_target(tmp_path / "t", arch="llama", vocab_size=330, seed=4)
    add_tokenizer(tmp_path / "t", 320)
    make_drafter(tmp_path / "d", hf.config)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": str(i), "messages": [{"role": "user", "content": f"hi {i}"}]}) + "\n"
                               for i in range(3)))
    rep = abc.main(["--target", str(tmp_path / "t"), "--drafter", str(tmp_path / "d"), "--prompts", str(prompts),
                    "--max-tokens", "12", "--out", str(tmp_path / "r.json")])
    rows = rep["by_target_p"]
    assert sum(r["first_drafts"] for r in rows) == rep["first_drafts"] > 0
    assert 0 <= rep["first_draft_accepted"] <= 1 and 0 < rep["mean_target_p"] <= 1
    assert json.loads((tmp_path / "r.json").read_text())["first_drafts"] == rep["first_drafts"]
