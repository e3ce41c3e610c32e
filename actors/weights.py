"""Hugging Face safetensors checkpoints: find every tensor (single file or a
sharded index), read whole tensors or one rank's slice of them, and turn
unreadable files into errors that name the file."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from specray.config import ConfigError


class CheckpointError(ConfigError):
    """A weight file is missing, unreadable, or lacks a tensor."""


class Checkpoint:
    """Lazy, read-only access to the tensors of one checkpoint directory."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._file_of: dict[str, Path] = {}
        self._handles: dict[Path, object] = {}
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from None
            for name, fname in weight_map.items():
                self._file_of[name] = self.path / fname
            missing = sorted({str(f) for f in self._file_of.values() if not f.is_file()})
            if missing:
                raise CheckpointError(f"{index} lists weight files that are missing: {missing}")
        else:
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"no *.safetensors weight files in {str(self.path)!r}")
            for f in files:
                for name in self._open(f).keys():
                    self._file_of[name] = f

    def _open(self, f: Path):
        if f not in self._handles:
            try:
                self._handles[f] = safe_open(str(f), framework="pt", device="cpu")
            except (SafetensorError, OSError, ValueError) as e:
                raise CheckpointError(f"cannot read weight file {str(f)!r}: {e}") from None
        return self._handles[f]

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def names(self) -> list[str]:
        return list(self._file_of)

    def _slice_handle(self, name: str):
        if name not in self._file_of:
            raise CheckpointError(f"tensor {name!r} is missing from checkpoint {str(self.path)!r}")
        f = self._file_of[name]
        try:
            return self._open(f).get_slice(name), f
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"cannot read {name!r} from {str(f)!r}: {e}") from None

    def shape(self, name: str) -> list[int]:
        return list(self._slice_handle(name)[0].get_shape())

    def get(
        self,
        name: str,
        shape: tuple[int, ...] | None = None,
        dim: int | None = None,
        shard: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """Read ``name``; with ``dim`` and ``shard=(start, stop)``, read only
        those rows/columns (each TP rank reads its own slice from disk).
        ``shape`` is the full tensor shape the caller expects."""
        sl, f = self._slice_handle(name)
        full = tuple(sl.get_shape())
        if shape is not None and full != tuple(shape):
            raise CheckpointError(
                f"tensor {name!r} in {str(f)!r} has shape {list(full)}, expected {list(shape)}"
            )
        try:
            if dim is None:
                return sl[:]
            index = [slice(None)] * len(full)
            index[dim] = slice(*shard)
            return sl[tuple(index)]
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"cannot read {name!r} from {str(f)!r}: {e}") from None


def torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
