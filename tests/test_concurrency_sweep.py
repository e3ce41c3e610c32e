"""bench/concurrency_sweep.py: the closed-loop spec vs AR sweep, here on a
tiny random pair in oracle-acceptance mode (the H200 run takes the
Qwen3-8B shape and the embedded pair into the same file)."""

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

POINT_KEYS = {"model", "concurrency", "temperature", "spec_tok_s", "ar_tok_s", "mean_acceptance_length",
              "oracle_acceptance"}


def test_oracle_sweep_writes_labelled_points_and_merges(tmp_path, capsys):
    import concurrency_sweep as mod

    out = tmp_path / "sweep.json"
    # An earlier run's points of another model stay in the file.
    other = {"model": "embedded", "oracle_acceptance": None, "concurrency": 1, "temperature": 0.0,
             "spec_tok_s": 1.0, "ar_tok_s": 1.0, "mean_acceptance_length": 2.0}
    out.write_text(json.dumps({"points": [other], "runs": {"embedded": {"model": "embedded"}}}))
    report = mod.main(["--model", "tiny-oracle", "--oracle-acceptance", "const:1.0", "--device", "cpu",
                       "--ckpt-dir", str(tmp_path / "ckpt"), "--concurrency", "1", "2", "--max-tokens", "12",
                       "--min-requests", "2", "--prompt-len", "8", "--max-model-len", "64", "--no-warmup",
                       # the padded path and asynchronous step graphs, as on a GPU, through LLM's fault guard
                       "--cuda-graphs", "--async-scheduling", "--policy", "fixed", "--out", str(out)])
    assert json.loads(out.read_text()) == report
    mine = [p for p in report["points"] if p["model"] == "tiny-oracle"]
    # a point written before the policy field: the embedded pair ran the adaptive default
    other["policy"] = "adaptive"
    assert other in report["points"] and set(report["runs"]) == {"embedded", "tiny-oracle@const:1.0#fixed"}
    assert all(p["policy"] == "fixed" for p in mine)
    assert [p["concurrency"] for p in mine] == [1, 2]
    for p in mine:
        assert POINT_KEYS <= set(p) and p["oracle_acceptance"] == "const:1.0"
        assert p["spec_tok_s"] > 0 and p["ar_tok_s"] > 0
        assert p["identical_outputs"] == p["requests"]  # lossless
        assert p["oracle"]["diverged_requests"] == 0
        # const:1.0: whole blocks (16 tokens) accepted; 12 tokens = the prefill's + one cut block of 11.
        assert p["mean_acceptance_length"] == 11
        # what the steps were: a prefill and a decode step a request at c=1, asynchronous decode steps
        assert p["spec_steps"]["steps"] >= 2 * p["requests"] // p["concurrency"]
        assert 0 < p["spec_steps"]["async_steps"] < p["spec_steps"]["steps"]
        assert p["ar_steps"]["steps"] > p["spec_steps"]["steps"]
        # every async cycle is counted once, by the step it applied ("<padded>s", "+join" where requests joined)
        for eng in ("spec_steps", "ar_steps"):
            cycles = p[eng]["cycles"]
            assert sum(v["n"] for v in cycles.values()) == p[eng]["async_steps"], cycles
        assert all(k.rstrip("+join")[-1] == "s" for k in p["spec_steps"]["cycles"])
        assert all(k.rstrip("+join")[-1] == "a" for k in p["ar_steps"]["cycles"])
    stdout = capsys.readouterr().out
    assert stdout.count("ORACLE ACCEPTANCE const:1.0") >= 4  # every line of the run says so

    fixed_run = report["runs"]["tiny-oracle@const:1.0#fixed"]
    assert fixed_run["spec_features"]["async_scheduling"]["on"]
    assert not fixed_run["spec_features"]["adaptive_speculation"]["on"]

    # The adaptive policy's points go beside the fixed ones: lossless too.
    report = mod.main(["--model", "tiny-oracle", "--oracle-acceptance", "const:1.0", "--device", "cpu",
                       "--ckpt-dir", str(tmp_path / "ckpt"), "--concurrency", "2", "--max-tokens", "100",
                       "--min-requests", "2", "--prompt-len", "8", "--max-model-len", "128", "--no-warmup",
                       "--cuda-graphs", "--async-scheduling", "--out", str(out)])  # enough steps for timed ones
    adaptive = [p for p in report["points"] if p["model"] == "tiny-oracle" and p["policy"] == "adaptive"]
    assert [p["concurrency"] for p in adaptive] == [2] and adaptive[0]["identical_outputs"] == adaptive[0]["requests"]
    # the steps the policy timed in the point: counts and plain means, by padded size and kind
    measured = adaptive[0]["spec_steps"]["policy_measured"]
    assert set(measured) == {"greedy"}  # the point's rows are greedy: no sampled step was timed
    assert measured["greedy"]
    for key, m in measured["greedy"].items():
        assert re.fullmatch(r"2(a|s\d*)", key) and m["n"] > 0 and m["mean_ms"] > 0
    assert report["runs"]["tiny-oracle@const:1.0"]["spec_features"]["adaptive_speculation"]["on"]
    assert [p for p in report["points"] if p["policy"] == "fixed"] == mine

    # A point of the same model, profile, policy, concurrency and temperature replaces its own; the others stay.
    import argparse

    again = dict(mine[1], spec_tok_s=123.0)
    report = mod.write(argparse.Namespace(out=str(out), fresh=False), dict(fixed_run), [again])
    assert report["points"] == [other] + adaptive + [mine[0], again]
    assert mod.write(argparse.Namespace(out=str(out), fresh=True), {"model": "embedded", "oracle_acceptance": None},
                     [])["points"] == []


def test_oracle_sweep_refuses_sampling(tmp_path):
    import concurrency_sweep as mod

    with pytest.raises(SystemExit, match="greedy only"):
        mod.main(["--model", "tiny-oracle", "--temperatures", "0", "1", "--ckpt-dir", str(tmp_path),
                  "--out", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()


def test_oracle_rows_join_running_chains(tmp_path):
    """Requests joining a running chain (chain_admit.py) get their recorded
    continuation written with their row: outputs stay the AR engine's and
    the acceptance the profile's."""
    import concurrency_sweep as mod

    report = mod.main(["--model", "tiny-oracle", "--oracle-acceptance", "const:0.8", "--device", "cpu",
                       "--ckpt-dir", str(tmp_path / "ckpt"), "--concurrency", "3", "--max-tokens", "40",
                       "--rounds", "4", "--prompt-len", "8", "--max-model-len", "96", "--no-warmup",
                       # every step speculates: the acceptance is the profile's (the adaptive policy's
                       # AR steps, chosen by this machine's timings, would lower it)
                       "--policy", "fixed", "--cuda-graphs", "--async-scheduling", "--out", str(tmp_path / "sweep.json")])
    (p,) = report["points"]
    assert p["spec_steps"]["chain_joins"] > 0
    assert p["identical_outputs"] == p["requests"] and p["oracle"]["diverged_requests"] == 0
    assert abs(p["mean_acceptance_length"] - p["expected_acceptance_length"]) < 0.25, p


def test_an_adaptive_point_records_what_the_policy_expected_at_its_end(tmp_path):
    """The policy's recent and settled tokens a row and the rest's state at
    a point's end: what tells a drafter asleep for good from one that loses."""
    import concurrency_sweep as mod

    report = mod.main(["--model", "tiny-oracle", "--oracle-acceptance", "const:1.0", "--device", "cpu",
                       "--ckpt-dir", str(tmp_path / "ckpt"), "--concurrency", "1", "--max-tokens", "24",
                       "--min-requests", "2", "--prompt-len", "8", "--max-model-len", "64", "--no-warmup",
                       "--cuda-graphs", "--async-scheduling", "--out", str(tmp_path / "sweep.json")])
    (p,) = report["points"]
    steps = p["spec_steps"]
    assert p["policy"] == "adaptive" and steps["speculative_steps"] > 0
    # const:1.0 accepts every draft: both means see whole blocks accepted
    assert steps["policy_settled_tokens_per_row"]["greedy/chain"] > 2
    assert steps["policy_tokens_per_row"]["greedy"] > 2
    assert set(steps["drafter_rest"]) == {"resting", "trials", "trial_after"}
