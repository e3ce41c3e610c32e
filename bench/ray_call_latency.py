"""What a Ray actor call costs on its way in, with the actor's process idle
and with another of its threads running Python (as rank 0's step thread
does between launches), at CPython's GIL switch interval and at a shorter
one: the p50 of the round trip and of the leg from the caller to the
method's first line (one host, one clock).

    python bench/ray_call_latency.py --out results/cpu_ray_call_latency.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_report  # noqa: E402


def actor_class(ray):
    @ray.remote(max_concurrency=4)
    class Probe:
        def ping(self) -> float:
            return time.monotonic()

        def switch_interval(self, seconds: float) -> None:
            sys.setswitchinterval(seconds)

        def busy(self, seconds: float) -> None:
            """A thread that holds the GIL but for the interpreter's switches."""
            def spin():
                end = time.monotonic() + seconds
                while time.monotonic() < end:
                    sum(range(200))
            threading.Thread(target=spin, daemon=True).start()

    return Probe


def legs(ray, probe, calls: int) -> dict:
    rtt, inbound = [], []
    for _ in range(calls):
        t = time.monotonic()
        arrived = ray.get(probe.ping.remote())
        rtt.append(time.monotonic() - t)
        inbound.append(arrived - t)
    return {"rtt_ms": round(1000 * statistics.median(rtt), 3), "inbound_ms": round(1000 * statistics.median(inbound), 3)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--short-interval-us", type=int, default=200)
    p.add_argument("--out")
    args = p.parse_args(argv)
    from specray.placement import ensure_ray

    ray = ensure_ray()
    try:
        probe = actor_class(ray).remote()
        ray.get(probe.ping.remote())
        points = {"idle": legs(ray, probe, args.calls)}
        ray.get(probe.busy.remote(600.0))
        time.sleep(0.2)
        points["busy_thread_5000us"] = legs(ray, probe, args.calls)
        ray.get(probe.switch_interval.remote(args.short_interval_us / 1e6))
        points[f"busy_thread_{args.short_interval_us}us"] = legs(ray, probe, args.calls)
    finally:
        ray.shutdown()
    report = {"command": "python bench/ray_call_latency.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "calls": args.calls, "points": points}
    for name, leg in points.items():
        print(f"{name}: round trip {leg['rtt_ms']:.2f} ms, in {leg['inbound_ms']:.2f} ms", flush=True)
    write_report(args.out, report)
    return report


if __name__ == "__main__":
    main()
