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
