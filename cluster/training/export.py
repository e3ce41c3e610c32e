"""Checkpoints in the DFlash authors' drafter format (config.json +
model.safetensors in bf16, no embedding or lm_head), the one
``specray.config.DrafterSpec`` and ``dflash.model.DFlashDraftModel`` load."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from specray.training.model import Drafter


def load_drafter(path: str, target_dir: str):
    """(config, state dict) of a checkpoint in this format, checked
    against the target with the rule serving applies (DrafterSpec.check_fits)."""
    from safetensors.torch import load_file
    from transformers import Qwen3Config

    from specray.config import ConfigError, DrafterSpec, TargetSpec

    try:
        DrafterSpec.from_dir(path).check_fits(TargetSpec.from_dir(target_dir))
    except ConfigError as e:
        raise SystemExit(f"--init-from: {e}") from None
    return Qwen3Config.from_pretrained(path), load_file(str(Path(path) / "model.safetensors"))


def save_checkpoint(drafter: Drafter, out: Path) -> int:
    """config.json (every Qwen3Config field, not just the diff: DrafterSpec
    reads them explicitly) + model.safetensors in bf16; atomic renames so an
    interrupted run leaves the previous checkpoint intact."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in drafter.state_dict().items()}
    save_file(sd, str(out / "model.safetensors.tmp"), metadata={"format": "pt"})
    os.chmod(out / "model.safetensors.tmp", 0o644)  # safetensors writes 0600; serving workers may be other users
    os.replace(out / "model.safetensors.tmp", out / "model.safetensors")
    drafter.config.to_json_file(str(out / "config.json.tmp"), use_diff=False)
    os.replace(out / "config.json.tmp", out / "config.json")
    return (out / "model.safetensors").stat().st_size

