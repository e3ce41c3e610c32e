"""bench/row_invariance.py on a tiny random target (CPU, fp32): its
teacher-forced block and single-step passes compute the same logits up to
rounding, so the bitwise counts it reports on a GPU mean what they say."""

import json
import sys
from pathlib import Path

from factories import add_tokenizer, make_target

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import row_invariance  # noqa: E402


def test_blocks_and_steps_agree_up_to_rounding(tmp_path):
    hf = make_target(tmp_path / "t", seed=4)
    add_tokenizer(tmp_path / "t", hf.config.vocab_size)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ("The capital of France is", "Once upon")))
    r = row_invariance.main(["--target", str(tmp_path / "t"), "--prompts", str(prompts), "--device", "cpu",
                             "--dtype", "float32", "--block", "4", "--positions", "12", "--max-model-len", "128",
                             "--out", str(tmp_path / "r.json")])
    assert len(r["prompts"]) == 2 and r["total"]["positions"] == 24
    for row in r["prompts"].values():
        assert row["max_abs_diff"] < 1e-4, row
        assert row["argmax_differ_block_4"] == 0
    assert json.loads((tmp_path / "r.json").read_text())["total"] == r["total"]
