"""TargetWorker: one tensor-parallel rank of the target model and its paged
KV cache. It runs whatever TargetBatch it is handed; rank 0 also returns
logits and keeps the tapped hidden states of its last forward for the
drafter."""

from __future__ import annotations

import torch

from specray.actors.kv_cache import allocate_kv_cache
from specray.actors.models.layers import TPContext
from specray.actors.models.qwen3 import TargetModel
from specray.actors.weights import Checkpoint, torch_dtype
from specray.config import TargetSpec
from specray.plan import TargetBatch


def free_memory_bytes(device: torch.device, gpu_memory_utilization: float, cpu_bytes: float) -> float:
    """Bytes a worker may still take for KV caches on its device."""
    if device.type != "cuda":
        return cpu_bytes
    free, total = torch.cuda.mem_get_info(device)
    return total * gpu_memory_utilization - (total - free)


def resolve_device(device: str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


class TargetWorker:
    def __init__(
        self,
        spec: TargetSpec,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        max_model_len: int,
        tap_layer_ids: tuple[int, ...] = (),
        tp: TPContext | None = None,
    ):
        self.spec = spec
        self.tp = tp or TPContext()
        self.device = resolve_device(device)
        self.dtype = torch_dtype(dtype)
        self.tap_layer_ids = tuple(tap_layer_ids)
        self.model = TargetModel(spec, self.tp, self.dtype, self.device, max_positions=max_model_len)
        self.model.load(Checkpoint(spec.path))
        self.kv_cache: torch.Tensor | None = None
        self.last_hidden: torch.Tensor | None = None

    def bytes_per_block(self, block_size: int) -> int:
        m = self.model
        return self.spec.num_layers * 2 * block_size * m.num_kv_heads * m.head_dim * self.dtype.itemsize

    def init_cache(self, num_blocks: int, block_size: int) -> None:
        m = self.model
        self.kv_cache = allocate_kv_cache(
            self.spec.num_layers, num_blocks, block_size, m.num_kv_heads, m.head_dim, self.dtype, self.device
        )

    @property
    def is_driver(self) -> bool:
        return self.tp.rank == 0

    @torch.inference_mode()
    def execute(self, batch: TargetBatch) -> torch.Tensor | None:
        """Logits ``[len(batch.logits_indices), vocab]`` (fp32, on this
        worker's device) on rank 0, None elsewhere."""
        attn = batch.attn.to(self.device)
        input_ids = batch.input_ids.to(self.device, non_blocking=True)
        driver = self.is_driver
        logits, hidden = self.model.forward(
            input_ids,
            attn,
            self.kv_cache,
            logits_indices=batch.logits_indices.to(self.device, non_blocking=True) if driver else None,
            tap_layer_ids=self.tap_layer_ids if (driver and batch.want_hidden) else (),
        )
        self.last_hidden = hidden
        return logits

    def hidden_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Tapped hidden states ``[n, k*H]`` of the given rows of the last
        forward."""
        assert self.last_hidden is not None, "the last forward tapped no hidden states"
        return self.last_hidden.index_select(0, rows.to(self.device, non_blocking=True))
