"""Paged KV bookkeeping: a block allocator, per-sequence block tables, slot
mapping, rollback, and the cache tensors themselves.

The bookkeeping half is plain Python (it runs in the scheduler, on rank 0);
the workers only ever see block tables and slot mappings as tensors. The
target's KV and the drafter's context KV each have their own pool.

Block 0 of every pool is reserved: padded rows of a batch (and padded entries
of a block table) point there, so kernels never need a "skip this row" branch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


class OutOfBlocks(Exception):
    """The pool cannot serve an allocation; the scheduler preempts."""


class BlockAllocator:
    """Free list over blocks ``1 .. num_blocks-1`` of one pool."""

    def __init__(self, num_blocks: int, block_size: int, name: str = "kv"):
        if num_blocks < 2:
            raise ValueError(f"{name} pool needs at least 2 blocks, got {num_blocks}")
        self.name = name
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Pop from the end: low block ids are handed out first.
        self._free = list(range(num_blocks - 1, 0, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        """Blocks a sequence could ever hold (all but the reserved one)."""
        return self.num_blocks - 1

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"{self.name}: need {n} blocks, {len(self._free)} free")
        out = self._free[-n:] if n else []
        del self._free[len(self._free) - n :]
        return out[::-1]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))

    def blocks_for(self, num_positions: int) -> int:
        return -(-num_positions // self.block_size)


@dataclass
class BlockTable:
    """The blocks of one sequence in one pool. Holds room for ``reserved``
    positions; the first ``length`` of them are valid."""

    allocator: BlockAllocator
    blocks: list[int] = field(default_factory=list)

    def can_reserve(self, num_positions: int) -> bool:
        need = self.allocator.blocks_for(num_positions) - len(self.blocks)
        return need <= self.allocator.num_free

    def reserve(self, num_positions: int) -> None:
        """Make room for positions ``0 .. num_positions-1``."""
        need = self.allocator.blocks_for(num_positions) - len(self.blocks)
        if need > 0:
            self.blocks.extend(self.allocator.allocate(need))

    def trim(self, num_positions: int) -> None:
        """Roll back to ``num_positions`` valid positions: blocks wholly past
        them return to the pool (rejected draft rows live there)."""
        keep = self.allocator.blocks_for(num_positions)
        if keep < len(self.blocks):
            self.allocator.free(self.blocks[keep:])
            del self.blocks[keep:]

    def free(self) -> None:
        self.allocator.free(self.blocks)
        self.blocks = []

    def slots(self, start: int, end: int) -> list[int]:
        """Slot of each position in ``start .. end-1``: a run of slots a
        block (a prompt's 300 positions in 10 us where a position at a time
        took 23 on the CI's CPU; a prefill and a join take them twice, the
        target's and the drafter's)."""
        bs = self.allocator.block_size
        out, p = [], start
        while p < end:
            b, off = divmod(p, bs)
            n = min(bs - off, end - p)
            base = self.blocks[b] * bs + off
            out.extend(range(base, base + n))
            p += n
        return out


def block_table_tensor(tables: list[list[int]], width: int | None = None) -> torch.Tensor:
    """Pad block tables with the reserved block 0 into ``[num_seqs, width]``."""
    width = max([len(t) for t in tables] + [1]) if width is None else width
    # Filled in numpy: a tensor per row cost ~11 us a row, and a step at
    # batch 64 builds two tables whenever a row crosses into a new block.
    out = np.zeros((len(tables), width), dtype=np.int32)
    for i, t in enumerate(tables):
        out[i, : len(t)] = t
    return torch.from_numpy(out)


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """``[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]``: K then V."""
    return torch.zeros(
        num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device
    )

