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
