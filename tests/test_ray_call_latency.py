"""bench/ray_call_latency.py: each point's round trip holds its inbound leg."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))


@pytest.mark.slow
def test_ray_call_latency_points(monkeypatch):
    pytest.importorskip("ray")
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    from ray_call_latency import main

    report = main(["--calls", "20", "--short-interval-us", "500"])
    assert list(report["points"]) == ["idle", "busy_thread_5000us", "busy_thread_500us"]
    for leg in report["points"].values():
        assert 0 < leg["inbound_ms"] <= leg["rtt_ms"], leg
