"""The training state a run saves as it goes (OUT/train_state.pt) and
``--resume`` continues from: the drafter's fp32 weights and config, the
optimizer, the learning-rate schedule's clock, the batch stream's position,
the RNG states, the best validation so far and the log history. The
exported checkpoint beside it is bf16 and holds no optimizer: it cannot
resume a run bit for bit."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

STATE_FILE = "train_state.pt"


def save_state(out: Path, *, drafter, optimizer, stream, step: int, train_s: float, planned_s: float,
               best: dict, history: list, init: dict, args: dict) -> None:
    """Written to a temporary name and renamed: a run killed mid-save keeps
    its previous state."""
    state = {
        "step": step,
        "model": {k: v.detach().cpu() for k, v in drafter.state_dict().items()},
        "config": drafter.config.to_json_string(use_diff=False),
        "optimizer": optimizer.state_dict(),
        "stream": stream.state_dict(),
        "rng": {"torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []},
        "train_s": train_s,
        "planned_s": planned_s,
        "best": best,
        "history": history,
        "init": init,
        # JSON: the state loads with torch.load(weights_only=True), which takes plain containers only.
        "args": json.dumps(args),
    }
    tmp = out / (STATE_FILE + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, out / STATE_FILE)


def _load(out: Path, mmap: bool) -> dict:
    path = out / STATE_FILE
    if not path.is_file():
        raise SystemExit(f"--resume: no training state {path} (a run saves one every --save-every-s / "
                         f"--save-every-steps and at its end)")
    state = torch.load(path, weights_only=True, mmap=mmap)
    state["args"] = json.loads(state["args"])
    return state


def load_state(out: Path) -> dict:
    return _load(out, mmap=False)


def saved_args(out: Path) -> dict:
    # Mapped, not read: the arguments are a few bytes of a file of weights.
    return _load(out, mmap=True)["args"]


def drafter_config(state: dict):
    from transformers import Qwen3Config

    return Qwen3Config.from_dict(json.loads(state["config"]))


def restore_rng(state: dict) -> None:
    torch.set_rng_state(state["rng"]["torch"])
    if state["rng"]["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
