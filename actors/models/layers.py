"""Pieces shared by the target and the drafter: rotary tables and the
tensor-parallel context (the norms and RoPE itself are ``kernels.ops``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from specray.config import RopeSpec
from specray.kernels.fused import RopeRows
from specray.plan import AttentionMetadata  # noqa: F401  (re-exported for models)


def rope_inv_freq(rope: RopeSpec, head_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.kind == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.kind == "llama3":
        low_wavelen = rope.original_max_position / rope.low_freq_factor
        high_wavelen = rope.original_max_position / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


class Rotary:
    """cos/sin tables for positions ``0 .. max_positions-1`` (fp32), indexed
    per token; rotate-half (NeoX) convention as in HF Llama/Qwen3."""

    def __init__(self, rope: RopeSpec, head_dim: int, max_positions: int, device):
        inv_freq = rope_inv_freq(rope, head_dim)
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().to(device)
        self.sin = emb.sin().to(device)
        self.max_positions = max_positions

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeRows:
        """The angles of ``positions`` ``[N]``, for every layer of a forward."""
        return RopeRows(self.cos, self.sin, positions, dtype)


@dataclass
class TPContext:
    """Where this worker sits in its tensor-parallel group."""

    rank: int = 0
    size: int = 1
    group: object | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def split(self, n: int, what: str) -> tuple[int, int]:
        """This rank's ``[start, stop)`` of ``n`` units split evenly."""
        if n % self.size:
            raise ValueError(f"{what} ({n}) is not divisible by tensor_parallel_size ({self.size})")
        per = n // self.size
        return self.rank * per, (self.rank + 1) * per
