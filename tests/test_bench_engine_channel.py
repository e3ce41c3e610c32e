"""bench/engine_channel.py: its comparison of the two transports' runs, its
flags, and the point's count of rank 0's actor calls it relies on."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import engine_channel  # noqa: E402

from specray.bench_serve_report import engine_counters  # noqa: E402


def point(path, tok_s, concurrency=1, temperature=0.0, drafter=True):
    return {"path": path, "output_tok_s": tok_s, "concurrency": concurrency, "temperature": temperature,
            "drafter": drafter}


def test_each_http_point_is_compared_across_transports_and_with_its_own_in_process_run():
    runs = {"channel": [{"points": [point("http", 144.0), point("inprocess", 145.0), point("http", 300.0, 16)]},
                        {"points": [point("http", 100.0), point("inprocess", 100.0)]},
                        {"points": [point("http", 150.0), point("inprocess", 100.0)]}],
            "ray_calls": [{"points": [point("http", 96.0), point("inprocess", 120.0)]}]}
    (row,) = engine_channel.compare(runs)  # c=16 ran over the channel only: not compared
    # medians: 144 / 96 tok/s; each round's ratio against its own in-process run
    assert row == {"drafter": True, "temperature": 0.0, "concurrency": 1, "http_channel_over_ray_calls": 1.5,
                   "http_over_inprocess_channel": 1.0, "http_over_inprocess_ray_calls": 0.8}


def test_out_belongs_to_the_script_not_to_bench_serve(tmp_path):
    with pytest.raises(SystemExit):
        engine_channel.main(["--out", str(tmp_path / "x.json"), "--", "--device", "cpu", "--out", "y.json"])
    with pytest.raises(SystemExit):
        engine_channel.main(["--", "--device", "cpu"])  # no --out


def test_a_points_counters_hold_rank_0s_actor_calls_over_it():
    before = {"num_steps": 10, "num_async_steps": 0, "step_time_s": 1.0, "calls": {"submit": 2, "get_outputs": 5}}
    after = {"num_steps": 20, "num_async_steps": 0, "step_time_s": 2.0, "calls": {"submit": 2, "get_outputs": 9}}
    assert engine_counters(before, after, 4.0)["actor_calls"] == {"submit": 0, "get_outputs": 4}
    in_process = {"num_steps": 20, "num_async_steps": 0, "step_time_s": 2.0}
    assert engine_counters(before, in_process, 4.0)["actor_calls"] is None
