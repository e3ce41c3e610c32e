"""bench/ar_step_cost.py on a tiny random pair (CPU, the async path run
eagerly): three engines, the policy held to autoregressive steps, and the
speculative one whose drafter rests really rests."""

import json
import sys
from pathlib import Path

from factories import make_models

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))


def test_ar_step_cost_report(tmp_path, capsys):
    import ar_step_cost

    root = make_models(tmp_path, seed=4, drafter_seed=14, block_size=6, vocab_size=320)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["one two", "three four five", "six"]))
    out = tmp_path / "cost.json"
    report = ar_step_cost.main(["--target", str(root / "t"), "--drafter", str(root / "d"), "--device", "cpu",
                                "--concurrency", "2", "--max-tokens", "24", "--prompts", str(prompts),
                                "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    engines = report["engines"]
    assert set(engines) == {"ar", "spec_rest", "spec_fed"}
    assert engines["spec_rest"]["2"]["drafter_rest"]["rests"] >= 1
    assert engines["spec_fed"]["2"]["drafter_rest"]["rests"] == 0
    for name in engines:  # every cycle autoregressive
        assert engines[name]["2"]["cycles"] and all(k.removesuffix("+join").endswith("a") for k in engines[name]["2"]["cycles"])
    assert set(report["ratios"]) == {"spec_rest", "spec_fed"}
    assert "spec_rest / ar tok/s: c=2" in capsys.readouterr().out
