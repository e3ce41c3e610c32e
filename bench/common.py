"""What the engine benchmarks under bench/ share: the model flags and the
JSON report (scripts run as ``python bench/NAME.py``, so this imports as
``common``)."""

from __future__ import annotations

import argparse
import json


def add_model_args(p: argparse.ArgumentParser, device: str) -> None:
    p.add_argument("--target", help="target checkpoint directory (default: the embedded target)")
    p.add_argument("--drafter", help="DFlash drafter directory (default: the embedded drafter)")
    p.add_argument("--no-drafter", action="store_true", help="decode autoregressively")
    p.add_argument("--device", default=device)


def write_report(path: str | None, report: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=2)


class CaptureCounter:
    """Counts the CUDA graph captures (``DecodeGraphs._capture``: two eager
    warm-up runs and the capture, tens of milliseconds for a whole step)
    and their seconds, so a timed point can show it paid none."""

    def __init__(self):
        from specray.actors.graphs import DecodeGraphs

        self.count, self.seconds = 0, 0.0
        inner = DecodeGraphs._capture

        def capture(graphs, size):
            import time

            t = time.perf_counter()
            try:
                return inner(graphs, size)
            finally:
                self.count += 1
                self.seconds += time.perf_counter() - t

        DecodeGraphs._capture = capture

    def snapshot(self) -> tuple[int, float]:
        return self.count, self.seconds

    def since(self, before: tuple[int, float]) -> dict:
        return {"graph_captures": self.count - before[0], "capture_s": round(self.seconds - before[1], 4)}
