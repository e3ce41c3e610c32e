"""TargetWorker: one tensor-parallel rank of the target model and its paged
KV cache. It runs whatever TargetBatch it is handed; rank 0 also returns
logits and keeps the tapped hidden states of its last forward for the
drafter."""

from __future__ import annotations

import torch

from specray.actors.graphs import DecodeGraphs
from specray.actors.kv_cache import allocate_kv_cache
from specray.actors.models.layers import TPContext
from specray.actors.models.qwen3 import TargetModel
from specray.actors.weights import Checkpoint, torch_dtype
from specray.config import EngineConfig, TargetSpec
from specray.kernels import ops
from specray.plan import AttentionMetadata, TargetBatch

# At most this many prompts of a step are prefilled one graph replay each
# (``TargetWorker._prefill_each``); a step of more runs eagerly.
PREFILL_EACH_MAX = 8
from specray.staging import host_to_device


def free_memory_bytes(
    device: torch.device, gpu_memory_utilization: float, cpu_bytes: float, own_bytes: int = 0
) -> float:
    """Bytes an engine may still take for KV caches on its device.

    ``gpu_memory_utilization`` is the share of the device this engine may
    use in all, its weights (``own_bytes``) included, as in vLLM: two
    engines at 0.4 each fit one device. What is actually free caps it, less
    a reserve for activations."""
    if device.type != "cuda":
        return cpu_bytes
    free, total = torch.cuda.mem_get_info(device)
    reserve = min(2**30, 0.02 * total)
    return min(free, total * gpu_memory_utilization - own_bytes) - reserve


def kv_capacity(config: EngineConfig, workers: list, beside: tuple[int, int] | None = None) -> int:
    """KV blocks that fit beside ``workers`` (sharing one device) when each
    of them keeps one pool of that many blocks; may be < 2 (callers say
    what to do about it). ``beside``: ``(weight_bytes, bytes_per_block)``
    of a drafter in another process on the same device (loaded already),
    whose pool is that many blocks too."""
    extra_weights, extra_per_block = beside or (0, 0)
    own = sum(w.weight_bytes for w in workers) + extra_weights
    budget = free_memory_bytes(workers[0].device, config.gpu_memory_utilization, config.cpu_kv_cache_gb * 2**30, own)
    return int(budget // (sum(w.bytes_per_block(config.kv_block_size) for w in workers) + extra_per_block))


def allocated_bytes(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def resolve_device(device: str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def chunk_padding(bufs: dict[str, torch.Tensor]) -> dict:
    """The padding of a graph of one sequence's chunk (``_static_forward``
    with ``max_seqs=1``), which its capture's warm-ups run on: a chunk of
    its own rows, causal over them (its length), at position 0 for the
    rotary tables (a graph may hold more rows than the model has
    positions), its K/V into the reserved slot 0."""
    return dict.fromkeys(bufs, 0) | {"seq_lens": bufs["positions"].shape[0]}


class TargetWorker:
    # Tests turn on several prompts prefilled one graph replay each on the
    # CPU's padded path, where it only adds compute otherwise.
    prefill_each_off_cuda = False

    def __init__(
        self,
        spec: TargetSpec,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        max_model_len: int,
        tap_layer_ids: tuple[int, ...] = (),
        tp: TPContext | None = None,
        block_size: int = 1,
    ):
        self.spec = spec
        self.tp = tp or TPContext()
        self.device = resolve_device(device)
        self.dtype = torch_dtype(dtype)
        self.tap_layer_ids = tuple(tap_layer_ids)
        before = allocated_bytes(self.device)
        # A verify block (``block_size`` rows) that starts near
        # max_model_len runs its rows past it; the RoPE kernel reads its
        # table without a bounds check.
        self.model = TargetModel(spec, self.tp, self.dtype, self.device,
                                 max_positions=max_model_len + max(64, 2 * block_size))
        self.max_model_len = max_model_len
        self.model.load(Checkpoint(spec.path))
        self.weight_bytes = allocated_bytes(self.device) - before
        self.kv_cache: torch.Tensor | None = None
        self.last_hidden: torch.Tensor | None = None
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: dict[int, DecodeGraphs] = {}

    def bytes_per_block(self, block_size: int) -> int:
        m = self.model
        return self.spec.num_layers * 2 * block_size * m.num_kv_heads * m.head_dim * self.dtype.itemsize

    def init_cache(self, num_blocks: int, block_size: int) -> None:
        m = self.model
        self.kv_cache = allocate_kv_cache(
            self.spec.num_layers, num_blocks, block_size, m.num_kv_heads, m.head_dim, self.dtype, self.device
        )

    def _static_forward(self, q_len: int, max_seqs: int, block_size: int, want_hidden: bool,
                        one_logits_row: bool, tree: bool = False):
        """Static buffers for ``max_seqs`` sequences of ``q_len`` rows each
        and the forward over the first ``n`` of them: logits for every row,
        or with ``one_logits_row`` for the row of each sequence that its
        ``logits_index`` names. Returns ``(buffers, rows_per_seq, forward)``."""
        dev = self.device
        rows = max_seqs * q_len
        width = -(-(self.max_model_len + q_len) // block_size)
        bufs = {
            "input_ids": torch.zeros(rows, dtype=torch.int64, device=dev),
            "positions": torch.zeros(rows, dtype=torch.int64, device=dev),
            "slot_mapping": torch.zeros(rows, dtype=torch.int64, device=dev),
            "seq_lens": torch.zeros(max_seqs, dtype=torch.int64, device=dev),
            "block_tables": torch.zeros(max_seqs, width, dtype=torch.int32, device=dev),
        }
        per_seq = {"input_ids": q_len, "positions": q_len, "slot_mapping": q_len, "seq_lens": 1, "block_tables": 1}
        if one_logits_row:
            bufs["logits_index"] = torch.zeros(max_seqs, dtype=torch.int64, device=dev)
            per_seq["logits_index"] = 1
        if tree:
            bufs["tree_mask"] = torch.full((rows,), -1, dtype=torch.int32, device=dev)
            per_seq["tree_mask"] = q_len
        query_start_loc = torch.arange(0, rows + 1, q_len, dtype=torch.int64, device=dev)
        taps = self.tap_layer_ids if (want_hidden and self.is_driver) else ()

        def forward(n: int):
            attn = AttentionMetadata(
                bufs["positions"][: n * q_len], bufs["slot_mapping"][: n * q_len], query_start_loc[: n + 1],
                bufs["seq_lens"][:n], bufs["block_tables"][:n], q_len, self.max_model_len + q_len,
                bufs["tree_mask"][: n * q_len] if tree else None,
            )
            logits_rows = bufs["logits_index"][:n] if one_logits_row else slice(None)
            return self.model.forward(bufs["input_ids"][: n * q_len], attn, self.kv_cache,
                                      logits_indices=logits_rows if self.is_driver else None,
                                      tap_layer_ids=taps)

        return bufs, per_seq, forward

    def enable_decode_graphs(self, q_len: int, max_seqs: int, block_size: int, want_hidden: bool,
                             tree: bool = False) -> None:
        """Capture decode steps of ``q_len`` rows per sequence (the verify
        block) in CUDA graphs, for up to ``max_seqs`` sequences; with
        ``tree``, blocks may hold draft trees (``attn.tree_mask``)."""
        dev = self.device
        bufs, per_seq, forward = self._static_forward(q_len, max_seqs, block_size, want_hidden, one_logits_row=False,
                                                      tree=tree)
        # Dummy sequences: q_len rows at positions 0.., writing into block 0.
        pad = {"input_ids": 0, "positions": torch.arange(q_len, device=dev).repeat(max_seqs),
               "slot_mapping": 0, "seq_lens": q_len, "block_tables": 0, "tree_mask": -1}
        self.graphs = DecodeGraphs(forward, bufs, per_seq, pad, max_seqs, dev)
        self.graph_q_len = q_len

    def enable_prefill_graphs(self, block_size: int, max_tokens: int, want_hidden: bool) -> None:
        """Capture a lone prompt chunk's forward, padded to the next of a few
        lengths up to ``max_tokens`` (at most 512). Launched eagerly, a short
        prompt's forward cost the host ~12 ms for ~1 ms of GPU work (300
        kernels; H200, 30 layers): at batch 1 that was a tenth of a request."""
        self.prefill_graphs = {}
        for rows in (16, 32, 64, 128, 256, 512):
            if rows >= 2 * max_tokens:  # the previous length already holds any chunk
                break
            bufs, per_seq, forward = self._static_forward(rows, 1, block_size, want_hidden, one_logits_row=True)
            self.prefill_graphs[rows] = DecodeGraphs(forward, bufs, per_seq, chunk_padding(bufs), 1, self.device)

    def _prefill_rows(self, batch: TargetBatch) -> int | None:
        """The padded length a captured prefill runs ``batch`` at, or None:
        one sequence's chunk (host tensors), at most one logits row, and
        padding rows that stay inside the model's positions."""
        a = batch.attn
        if not self.prefill_graphs or batch.uniform_rows or a.seq_lens.shape[0] != 1 or \
                a.seq_lens.device.type != "cpu" or batch.logits_indices.shape[0] > 1:
            return None
        n = batch.input_ids.shape[0]
        rows = next((r for r in self.prefill_graphs if r >= n), None)
        if rows is None or int(a.seq_lens[0]) - n + rows > self.max_model_len:
            return None
        return rows

    def _execute_prefill_graph(self, batch: TargetBatch, rows: int) -> torch.Tensor | None:
        # Padding rows continue the positions (so the real rows keep theirs:
        # a row's position is seq_len - q_len + its index), write their K/V
        # into the reserved slot 0 and are never read by a real row.
        a, n = batch.attn, batch.input_ids.shape[0]
        pad = rows - n
        start = int(a.seq_lens[0]) - n
        zeros = torch.zeros(pad, dtype=torch.int64)
        inputs = {
            "input_ids": torch.cat([batch.input_ids.long(), zeros]),
            "positions": torch.arange(start, start + rows),
            "slot_mapping": torch.cat([a.slot_mapping.long(), zeros]),
            "seq_lens": torch.tensor([start + rows]),
            "block_tables": a.block_tables,
            "logits_index": batch.logits_indices[:1] if batch.logits_indices.shape[0] else torch.zeros(1, dtype=torch.int64),
        }
        logits, hidden = self.prefill_graphs[rows].run(1, inputs)
        self.last_hidden = hidden[:n] if hidden is not None else None
        return logits[: batch.logits_indices.shape[0]] if logits is not None else None

    def _prefill_each(self, batch: TargetBatch) -> tuple[bool, torch.Tensor | None]:
        """Several prompts' chunks, each through its captured prefill graph
        in turn (an eager step of several prompts cost the H200's host
        17-50 ms): (False, None) where one of them has no graph, else (True,
        the logits of the rows ``logits_indices`` names, each a chunk's last
        row), the tapped states of every row left in ``last_hidden`` in the
        batch's order."""
        a = batch.attn
        if a.seq_lens.device.type != "cpu" or a.tree_mask is not None or a.seq_lens.shape[0] > PREFILL_EACH_MAX or \
                (self.device.type != "cuda" and not self.prefill_each_off_cuda):
            return False, None
        bounds = a.query_start_loc.tolist()
        wanted = batch.logits_indices.tolist()
        if wanted != sorted(wanted) or any(i + 1 not in bounds[1:] for i in wanted):
            return False, None
        parts = []
        for s in range(len(bounds) - 1):
            q0, q1 = bounds[s], bounds[s + 1]
            one = TargetBatch(batch.input_ids[q0:q1], AttentionMetadata(
                a.positions[q0:q1], a.slot_mapping[q0:q1], torch.tensor([0, q1 - q0]), a.seq_lens[s : s + 1],
                a.block_tables[s : s + 1], q1 - q0, int(a.seq_lens[s])),
                torch.tensor([q1 - q0 - 1] if q1 - 1 in wanted else [], dtype=torch.int64), batch.want_hidden)
            rows = self._prefill_rows(one)
            if rows is None:
                return False, None
            parts.append((one, rows))
        logits, hidden = [], []
        for one, rows in parts:  # a graph's outputs are its buffers: each replay's are copied out
            out = self._execute_prefill_graph(one, rows)
            if out is not None:
                logits.append(out.clone())
            if self.last_hidden is not None:
                hidden.append(self.last_hidden.clone())
        self.last_hidden = torch.cat(hidden) if hidden else None
        return True, torch.cat(logits) if logits else None

    @property
    def local_model(self) -> bool:
        """The whole model and its cache live in this process (TP 1), so a
        step graph (step_graph.py) may run it directly."""
        return self.tp.size == 1

    @property
    def runs_step_graphs(self) -> bool:
        return self.local_model

    @property
    def is_driver(self) -> bool:
        return self.tp.rank == 0

    @torch.inference_mode()
    def execute(self, batch: TargetBatch) -> torch.Tensor | None:
        """Logits ``[len(batch.logits_indices), vocab]`` (model dtype, on this
        worker's device) on rank 0, None elsewhere."""
        if self.graphs is not None and batch.uniform_rows == self.graph_q_len and \
                batch.attn.seq_lens.shape[0] <= self.graphs.max_seqs:
            return self._execute_graph(batch)
        rows = self._prefill_rows(batch)
        if rows is not None:
            return self._execute_prefill_graph(batch, rows)
        if self.prefill_graphs and not batch.uniform_rows and batch.attn.seq_lens.shape[0] > 1:
            ran, logits = self._prefill_each(batch)
            if ran:
                return logits
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

    @torch.inference_mode()
    def tapped_hidden(self, input_ids: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        """The tapped hidden states ``[num_tokens, k*H]`` of one eager forward
        without logits, its K/V written at ``attn.slot_mapping`` (a resting
        drafter's refill, drafter_rest.py: rare, of any shape, so no graph)."""
        _, hidden_tapped = self.model.forward(input_ids.to(self.device), attn.to(self.device), self.kv_cache,
                                              logits_indices=None, tap_layer_ids=self.tap_layer_ids)
        return hidden_tapped

    def _execute_graph(self, batch: TargetBatch) -> torch.Tensor | None:
        a = batch.attn
        n = a.seq_lens.shape[0]
        inputs = {"input_ids": batch.input_ids, "positions": a.positions, "slot_mapping": a.slot_mapping,
                  "seq_lens": a.seq_lens, "block_tables": a.block_tables}
        if "tree_mask" in self.graphs.buffers:  # no rows given: all padding (-1, causal)
            inputs["tree_mask"] = a.tree_mask if a.tree_mask is not None else self._no_tree
        elif a.tree_mask is not None:
            raise ValueError("a draft tree reached decode graphs captured without tree masks")
        logits, hidden = self.graphs.run(n, inputs)
        rows = n * self.graph_q_len
        self.last_hidden = hidden[:rows] if hidden is not None else None
        return logits[:rows] if logits is not None else None

    _no_tree = torch.zeros(0, dtype=torch.int32)

    def move_kv(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Copy the cache's K/V at ``src_slots`` to ``dst_slots`` in every
        layer (a draft tree's accepted nodes to their positions' slots)."""
        ops.move_kv(self.kv_cache, host_to_device(src_slots, self.device), host_to_device(dst_slots, self.device))

    def hidden_rows(self, rows: torch.Tensor | None) -> torch.Tensor:
        """Tapped hidden states ``[n, k*H]`` of the given rows of the last
        forward (all of them for None)."""
        assert self.last_hidden is not None, "the last forward tapped no hidden states"
        if rows is None:
            return self.last_hidden
        return self.last_hidden.index_select(0, host_to_device(rows, self.device))
