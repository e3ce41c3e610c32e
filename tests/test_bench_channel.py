"""bench/bench_channel.py: one step's exchange between rank 0 and a drafter
process, timed; on the CPU through gloo (the multi-GPU issue runs it over
NCCL)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_channel_bench_runs_a_step_exchange_over_gloo(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))  # spawned ends import it by name
    import bench_channel as mod

    out = tmp_path / "c.json"
    report = mod.main(["--channel", "gloo", "--batch", "1", "3", "--hidden", "64", "--iters", "4", "--warmup", "1",
                       "--out", str(out)])
    assert out.is_file() and set(report["by_batch"]) == {"1", "3"}
    for S, r in report["by_batch"].items():
        assert r["median_us"] > 0 and r["p90_us"] >= r["median_us"]
        assert r["context_bytes"] == int(S) * 16 * (5 * 64 * 2 + 8 + 8)


def test_plan_broadcast_bench_runs_over_gloo(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    import bench_plan_broadcast as mod

    report = mod.main(["--batch", "1", "4", "--iters", "3", "--warmup", "1", "--out", str(tmp_path / "p.json")])
    assert set(report["by_batch"]) == {"1", "4"} and all(r["median_us"] > 0 for r in report["by_batch"].values())


def test_placement_parity_names_the_requests_that_differ(tmp_path):
    """bench/placement_parity.py on the CPU: two in-process engines in fixed
    policy turns agree on every request, and the report says so."""
    sys.path.insert(0, str(ROOT / "bench"))
    import placement_parity as mod
    from factories import make_models

    root = make_models(tmp_path / "m", block_size=8)
    out = tmp_path / "parity.json"
    report = mod.main(["--device", "cpu", "--target", str(root / "t"), "--drafter", str(root / "d"), "--engines",
                       "inprocess", "inprocess_again", "--prompt-lengths", "5", "20", "--max-tokens", "12",
                       "--turns", "7", "3", "0", "--max-model-len", "128", "--out", str(out)])
    assert out.is_file()
    assert report["differing_requests"]["inprocess_again"] == {"greedy": [], "greedy_acceptance": [], "sampled": [],
                                                               "sampled_acceptance": []}
    assert len(report["runs"]["inprocess"]["sampled"][1]) == 12
