"""Drafter block logits vs the DFlash authors' reference
(dflash.model.DFlashDraftModel), fp32, same random weights and context
hidden states; several requests in one batched propose, context stored in
pieces into interleaved paged blocks, one block cut short."""

import pytest
import torch
import torch.nn.functional as F

from factories import make_drafter, make_target
from specray.actors.drafter import DrafterWorker
from specray.actors.kv_cache import BlockAllocator, BlockTable, block_table_tensor
from specray.config import DrafterSpec, TargetSpec

TOL = 1e-4


@pytest.mark.parametrize(
    "layer_types,window,graph_seqs",
    [
        (None, None, None),
        (["sliding_attention", "full_attention"], 5, None),
        # The context stored through the decode graphs' static buffers, in
        # pieces of one block (8 rows), the last of each store padded.
        (None, None, 1),
    ],
)
def test_block_logits_match_reference(tmp_path, layer_types, window, graph_seqs):
    hf = make_target(tmp_path / "t")
    ref = make_drafter(tmp_path / "d", hf.config, block_size=8, layer_types=layer_types, sliding_window=window)
    tspec, dspec = TargetSpec.from_dir(tmp_path / "t"), DrafterSpec.from_dir(tmp_path / "d")
    if window:
        assert dspec.layer_window == (5, None) and dspec.layer_causal == (True, False)
    worker = DrafterWorker(dspec, tspec, max_model_len=128)
    worker.init_cache(num_blocks=40, block_size=4)
    if graph_seqs:
        worker.enable_decode_graphs(graph_seqs, 4, dspec.block_size)
    pool = BlockAllocator(40, 4)
    B, H = dspec.block_size, dspec.hidden_size
    k = len(dspec.target_layer_ids)
    g = torch.Generator().manual_seed(0)
    ctx_lens = [9, 3, 17]
    block_lens = [8, 8, 5]
    hidden = [torch.randn(c, k * H, generator=g) for c in ctx_lens]
    last = torch.randint(0, dspec.vocab_size - 1, (3,), generator=g)
    tables = [BlockTable(pool) for _ in ctx_lens]

    # Store context in two rounds, all requests interleaved in each.
    for lo_frac, hi_frac in ((0.0, 0.5), (0.5, 1.0)):
        rows, pos, slots = [], [], []
        for s, c in enumerate(ctx_lens):
            a, b = int(c * lo_frac), int(c * hi_frac)
            tables[s].reserve(b)
            rows.append(hidden[s][a:b])
            pos += list(range(a, b))
            slots += tables[s].slots(a, b)
        worker.store_context(torch.cat(rows), torch.tensor(pos), torch.tensor(slots))

    block_ids = torch.full((3, B), dspec.mask_token_id)
    block_ids[:, 0] = last
    with torch.no_grad():
        got = worker.model.logits(
            worker.model.propose_hidden(
                block_ids,
                torch.tensor(ctx_lens),
                torch.tensor(block_lens),
                block_table_tensor([t.blocks for t in tables]),
                max(ctx_lens),
                worker.kv_cache,
            )
        )
        for s, (c, v) in enumerate(zip(ctx_lens, block_lens)):
            noise = F.embedding(block_ids[s : s + 1, :v], hf.get_input_embeddings().weight)
            h = ref(
                target_hidden=hidden[s][None],
                noise_embedding=noise,
                position_ids=torch.arange(c + v)[None],
            )
            want = ref.compute_logits(h, hf.lm_head)[0, 1:v]
            diff = (got[s, 1:v] - want).abs().max().item()
            assert diff <= TOL, (s, diff)
