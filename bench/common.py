"""What the engine benchmarks under bench/ share: the model flags, a
random target of a real shape, the device's copy bandwidth and the JSON
report (scripts run as ``python bench/NAME.py``, so this imports as
``common``)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def add_model_args(p: argparse.ArgumentParser, device: str) -> None:
    p.add_argument("--target", help="target checkpoint directory (default: the embedded target)")
    p.add_argument("--drafter", help="DFlash drafter directory (default: the embedded drafter)")
    p.add_argument("--no-drafter", action="store_true", help="decode autoregressively")
    p.add_argument("--device", default=device)


def add_target_args(p: argparse.ArgumentParser) -> None:
    """A target directory, or a random Qwen3 target of a named shape."""
    p.add_argument("--target")
    p.add_argument("--random-shape", help="write (once) and use a random Qwen3 target of this shape "
                                          "(examples/scaling_sweep.py SHAPES)")
    p.add_argument("--ckpt-dir", default="runs/random-checkpoints")


def resolve_target(args: argparse.Namespace) -> str:
    """The target directory ``add_target_args``' flags name."""
    if args.random_shape:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
        from scaling_sweep import random_checkpoints

        return random_checkpoints(Path(args.ckpt_dir), args.random_shape)[0]
    if not args.target:
        raise SystemExit("give --target DIR or --random-shape NAME")
    return args.target


def sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device="cuda", nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write)."""
    import torch

    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    sync(device)
    t = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    sync(device)
    return 2 * nbytes * 10 / (time.perf_counter() - t)


def ar_decode_s(llm, steps: int, warmup: int = 16) -> float:
    """Wall seconds per token of an engine's autoregressive decode at batch
    1, after ``warmup`` steps (prefill, graph captures, the chain under way)."""
    from specray import SamplingParams

    core = llm.engine
    rid = core.add_request(list(range(100, 164)), SamplingParams(temperature=0, max_tokens=steps + warmup + 64,
                                                                 ignore_eos=True))
    for _ in range(warmup):
        core.step()
    sync(core.device)
    before = len(core.requests[rid].output_token_ids)
    t = time.perf_counter()
    for _ in range(steps):
        core.step()
    sync(core.device)
    dt = time.perf_counter() - t
    tokens = len(core.requests[rid].output_token_ids) - before
    core.abort_request(rid)
    return dt / tokens


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


class GcWatch:
    """Counts the garbage collector's full (oldest-generation) collections
    while it is entered, and their milliseconds: one traverses every object
    the process holds (~300k after loading the embedded pair: ~100 ms on a
    2-core CPU), a pause as long as dozens of steps."""

    def __init__(self):
        self.count, self.ms, self._t = 0, 0.0, None

    def _callback(self, phase: str, info: dict) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._t = time.perf_counter()
        elif self._t is not None:
            self.count += 1
            self.ms += 1000 * (time.perf_counter() - self._t)
            self._t = None

    def __enter__(self):
        import gc

        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc):
        import gc

        gc.callbacks.remove(self._callback)

    def as_dict(self) -> dict:
        return {"gc_full_collections": self.count, "gc_full_ms": round(self.ms, 2)}
