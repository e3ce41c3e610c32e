"""DrafterWorker: the DFlash drafter, its paged per-request context KV, and
batched propose. It owns no bookkeeping: the scheduler hands it slots and
block tables for the context pool."""

from __future__ import annotations

import torch

from specray.actors.graphs import DecodeGraphs
from specray.actors.kv_cache import allocate_kv_cache
from specray.actors.models.dflash import DFlashDrafter
from specray.actors.target import allocated_bytes, resolve_device
from specray.actors.weights import Checkpoint, CheckpointError, torch_dtype
from specray.config import DrafterSpec, TargetSpec
from specray.kernels import ops
from specray.plan import DraftBatch, DraftOutput
from specray.draft_tree import DraftTree, TreeUniverse, build, lookup_nodes
from specray.sampling import sample_draft_tokens


def draft_tree_of(logits: torch.Tensor, universe: TreeUniverse, lookup: torch.Tensor | None = None,
                  has_lookup: torch.Tensor | None = None,
                  temperature: torch.Tensor | None = None) -> tuple[torch.Tensor, DraftTree]:
    """A tree of ``G`` nodes per row from the drafter's logits ``[S, G, V]``
    (and prompt-lookup drafts ``[S, >= L]`` where ``has_lookup``:
    ``draft_tree.build``). ``temperature`` ``[S]`` (sampled rows): paths
    are scored at the row's temperature, the drafter's estimate of the
    probability that the target's samples take them (0: greedy, as 1)."""
    if temperature is not None:
        logits = logits.float() / torch.where(temperature > 0, temperature, 1.0)[:, None, None]
    top_logprobs, top_ids = ops.top_logprobs(logits, universe.top_k)
    G = logits.shape[1]
    if lookup is not None:
        lookup = lookup[:, : lookup_nodes(G)]
    return build(top_logprobs, top_ids, universe, G, lookup, has_lookup)


def pos_slots_input(positions: torch.Tensor, slots: torch.Tensor, rows: int) -> torch.Tensor:
    """``[2 * rows]``: ``positions`` then ``slots``, each padded to ``rows``
    with position 0 in the reserved slot 0 (a context graph's one input of
    them, built where they are: a store from the host uploads once, where
    two inputs and their padding cost six launches)."""
    out = torch.zeros(2 * rows, dtype=torch.int64, device=positions.device)
    out[: positions.shape[0]] = positions
    out[rows : rows + slots.shape[0]] = slots.to(positions.device)
    return out


def load_shared_head(target: TargetSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's ``embed_tokens`` and ``lm_head`` (the drafter's are the
    target's own)."""
    ckpt = Checkpoint(target.path)
    shape = (target.vocab_size, target.hidden_size)
    embed = ckpt.get("model.embed_tokens.weight", shape)
    if target.tie_word_embeddings:
        return embed, embed
    if "lm_head.weight" not in ckpt:
        raise CheckpointError(f"checkpoint {target.path!r} has no lm_head.weight and tie_word_embeddings is false")
    return embed, ckpt.get("lm_head.weight", shape)


class DrafterWorker:
    def __init__(
        self,
        spec: DrafterSpec,
        target_spec: TargetSpec,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        max_model_len: int,
        draft_top_k: int = 64,
    ):
        spec.check_fits(target_spec)
        self.spec = spec
        self.device = resolve_device(device)
        self.dtype = torch_dtype(dtype)
        self.draft_top_k = draft_top_k
        # Block rows reach max_model_len - 1 + B - 1 when a block is cut short.
        before = allocated_bytes(self.device)
        self.model = DFlashDrafter(spec, self.dtype, self.device, max_positions=max_model_len + spec.block_size)
        embed, lm_head = load_shared_head(target_spec)
        self.model.load(Checkpoint(spec.path), embed, lm_head)
        self.weight_bytes = allocated_bytes(self.device) - before
        self.kv_cache: torch.Tensor | None = None
        self.graphs: DecodeGraphs | None = None
        self.context_graphs: DecodeGraphs | None = None
        self.draft_block = spec.block_size
        self.max_model_len = max_model_len
        self.tree: TreeUniverse | None = None  # set where blocks may hold draft trees

    def enable_decode_graphs(self, max_seqs: int, block_size: int, draft_block: int) -> None:
        """Capture batched propose (up to the draft logits) of blocks of
        ``draft_block`` rows (the anchor and its drafts: the engine's, at
        most the drafter's block size) in CUDA graphs for up to ``max_seqs``
        requests; sampling stays outside."""
        dev, B = self.device, draft_block
        self.draft_block = B
        width = -(-(self.max_model_len + B) // block_size)
        bufs = {
            "block_ids": torch.full((max_seqs, B), self.spec.mask_token_id, dtype=torch.int64, device=dev),
            "ctx_lens": torch.zeros(max_seqs, dtype=torch.int64, device=dev),
            "block_lens": torch.ones(max_seqs, dtype=torch.int64, device=dev),
            "block_tables": torch.zeros(max_seqs, width, dtype=torch.int32, device=dev),
        }
        pad_ids = torch.full((max_seqs, B), self.spec.mask_token_id, dtype=torch.int64, device=dev)
        pad = {"block_ids": pad_ids, "ctx_lens": 0, "block_lens": 1, "block_tables": 0}

        def forward(n: int):
            hidden = self.model.propose_hidden(
                bufs["block_ids"][:n], bufs["ctx_lens"][:n], bufs["block_lens"][:n], bufs["block_tables"][:n],
                self.max_model_len, self.kv_cache,
            )
            return (self.model.logits(hidden[:, 1:]),)

        self.graphs = DecodeGraphs(forward, bufs, dict.fromkeys(bufs, 1), pad, max_seqs, dev)

        # Context of a graphed decode step: all B verify rows of each
        # sequence, the rejected ones pointed at the reserved slot 0, so the
        # shapes depend on the batch size alone. ``pos_slots`` holds a
        # store's positions, then its slots (``pos_slots_input``): one upload.
        ctx = {
            "hidden": torch.zeros(max_seqs * B, self.model.fc.shape[1], dtype=self.dtype, device=dev),
            "pos_slots": torch.zeros(max_seqs * 2 * B, dtype=torch.int64, device=dev),
        }

        def store(n: int):
            rows = n * B
            ps = ctx["pos_slots"]
            self.model.store_context(ctx["hidden"][:rows], ps[:rows], ps[rows : 2 * rows], self.kv_cache)
            return ()

        # Hidden rows past a store's are left as they are: their slots are the reserved slot 0.
        self.context_graphs = DecodeGraphs(store, ctx, {"hidden": B, "pos_slots": 2 * B},
                                           {"hidden": None, "pos_slots": 0}, max_seqs, dev)

    # The model and its context cache live in this process (step_graph.py).
    local_model = True
    runs_step_graphs = True

    @property
    def stores_whole_blocks(self) -> bool:
        """Takes the context of a graphed decode step as whole verify blocks
        (rejected rows pointed at slot 0)."""
        return self.context_graphs is not None

    def bytes_per_block(self, block_size: int) -> int:
        s = self.spec
        return s.num_layers * 2 * block_size * s.num_kv_heads * s.head_dim * self.dtype.itemsize

    def init_cache(self, num_blocks: int, block_size: int) -> None:
        s = self.spec
        self.kv_cache = allocate_kv_cache(
            s.num_layers, num_blocks, block_size, s.num_kv_heads, s.head_dim, self.dtype, self.device
        )

    @torch.inference_mode()
    def store_context(self, hidden_tapped: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Append accepted positions ``[n]`` to the context KV. Rows whose
        slot is 0 (the reserved block) are padding and change nothing."""
        n = hidden_tapped.shape[0]
        if n == 0:
            return
        g, B = self.context_graphs, self.draft_block
        if g is not None:
            # Any rows, a prompt's too, in graph-sized pieces padded to
            # whole blocks: eager, a 12-token prompt's store kept the host
            # launching for ~0.8 ms on the H200 (the prefill's apply phase,
            # 0.47 ms this way).
            step = g.max_seqs * B
            for i in range(0, n, step):
                rows = min(step, n - i)
                seqs = g.padded(-(-rows // B))
                g.run(seqs, {"hidden": hidden_tapped[i : i + rows],
                             "pos_slots": pos_slots_input(positions[i : i + rows], slot_mapping[i : i + rows],
                                                          seqs * B)})
            return
        self.model.store_context(
            hidden_tapped.to(self.device, non_blocking=True),
            positions.to(self.device, non_blocking=True),
            slot_mapping.to(self.device, non_blocking=True),
            self.kv_cache,
        )

    @torch.inference_mode()
    def propose(self, batch: DraftBatch) -> DraftOutput:
        dev = self.device
        n = batch.block_ids.shape[0]
        if self.graphs is not None and n <= self.graphs.max_seqs and batch.block_ids.shape[1] == self.draft_block:
            (logits,) = self.graphs.run(n, {"block_ids": batch.block_ids, "ctx_lens": batch.ctx_lens,
                                           "block_lens": batch.block_lens, "block_tables": batch.block_tables})
            logits = logits[:n]
        else:
            hidden = self.model.propose_hidden(
                batch.block_ids.to(dev, non_blocking=True),
                batch.ctx_lens.to(dev, non_blocking=True),
                batch.block_lens.to(dev, non_blocking=True),
                batch.block_tables.to(dev, non_blocking=True),
                batch.max_ctx_len,
                self.kv_cache,
            )
            logits = self.model.logits(hidden[:, 1:])
        if batch.tree and self.tree is not None:
            lookup = None if batch.tree_lookup is None else batch.tree_lookup.to(dev, non_blocking=True)
            has = None if batch.tree_lookup is None else batch.tree_has_lookup.to(dev, non_blocking=True)
            st = batch.sampling
            temp = None if st is None or st.all_greedy else st.temperature.to(dev, non_blocking=True)
            tokens, tree = draft_tree_of(logits, self.tree, lookup, has, temp)
            return DraftOutput(tokens, None, None, tree)
        tokens, idx, q = sample_draft_tokens(logits, batch.sampling.to(dev), self.draft_top_k)
        return DraftOutput(tokens, idx, q)
