"""Target logits and hidden taps vs HF transformers, fp32 CPU: a prefill,
then paged multi-token verify steps, several sequences per batch, blocks
interleaved between sequences."""

import pytest
import torch

from factories import make_target
from specray.actors.kv_cache import BlockAllocator, BlockTable, block_table_tensor
from specray.actors.target import TargetWorker
from specray.config import TargetSpec
from specray.plan import AttentionMetadata, TargetBatch

TOL = 1e-4


def run_chunks(worker, tables, seqs, chunks):
    """One forward over ``chunks``: per sequence, (start, end) of its tokens
    to compute now. Returns logits for every computed row and the taps."""
    ids, pos, slots, starts, seq_lens, bts = [], [], [], [0], [], []
    for s, (a, b) in chunks.items():
        tables[s].reserve(b)
        ids += seqs[s][a:b]
        pos += list(range(a, b))
        slots += tables[s].slots(a, b)
        seq_lens.append(b)
        bts.append(tables[s].blocks)
        starts.append(len(ids))
    attn = AttentionMetadata(
        torch.tensor(pos),
        torch.tensor(slots),
        torch.tensor(starts),
        torch.tensor(seq_lens),
        block_table_tensor(bts),
        max(b - a for a, b in zip(starts[:-1], starts[1:])),
        max(seq_lens),
    )
    batch = TargetBatch(torch.tensor(ids), attn, torch.arange(len(ids)), want_hidden=True)
    logits = worker.execute(batch)
    return logits, worker.last_hidden, starts


@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("qwen3", {}),
        ("qwen3", {"tie_word_embeddings": True}),
        ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}),
        ("llama", {"attention_bias": True, "mlp_bias": True, "num_key_value_heads": 4}),
    ],
)
def test_prefill_then_paged_verify_matches_hf(tmp_path, arch, overrides):
    hf = make_target(tmp_path, arch, **overrides)
    taps = (0, 2, 3)  # 3 is the last layer: HF gives it after the final norm
    spec = TargetSpec.from_dir(tmp_path)
    worker = TargetWorker(spec, max_model_len=128, tap_layer_ids=taps)
    worker.init_cache(num_blocks=64, block_size=4)
    pool = BlockAllocator(64, 4)
    g = torch.Generator().manual_seed(0)
    lens = [11, 5, 23]
    seqs = [torch.randint(2, spec.vocab_size, (n + 12,), generator=g).tolist() for n in lens]
    tables = [BlockTable(pool) for _ in seqs]

    with torch.no_grad():
        ref = [hf(torch.tensor([s]), output_hidden_states=True) for s in seqs]

    def check(chunks):
        logits, hidden, starts = run_chunks(worker, tables, seqs, chunks)
        for i, (s, (a, b)) in enumerate(chunks.items()):
            got = logits[starts[i] : starts[i + 1]]
            want = ref[s].logits[0, a:b]
            assert (got - want).abs().max().item() <= TOL
            want_h = torch.cat([ref[s].hidden_states[t + 1][0, a:b] for t in taps], -1)
            assert (hidden[starts[i] : starts[i + 1]] - want_h).abs().max().item() <= TOL

    # Prefill (one sequence in two chunks), then verify blocks of 4 and 3.
    check({0: (0, 11), 1: (0, 5), 2: (0, 13)})
    check({2: (13, 23), 0: (11, 15)})
    check({0: (15, 19), 1: (5, 9), 2: (23, 26)})
    # A rejected tail is rolled back: blocks past row 17 go back to the pool,
    # and other tokens written from row 17 on (another draft accepted) are
    # what the following rows attend to, in reused blocks too.
    free = pool.num_free
    for t in tables:
        t.trim(17)
    assert pool.num_free == free + 2  # sequence 2 held rows 0..25: 7 blocks, now 5
    for s in (0, 2):
        seqs[s][17:] = torch.randint(2, spec.vocab_size, (len(seqs[s]) - 17,), generator=g).tolist()
    with torch.no_grad():
        ref = [hf(torch.tensor([s]), output_hidden_states=True) for s in seqs]
    check({0: (17, 21), 1: (9, 12), 2: (17, 20)})
    check({2: (20, 24), 0: (21, 23)})


def test_slots_of_any_range_are_each_positions_block_and_offset():
    """``BlockTable.slots`` in runs a block: equal to the per-position
    definition for ranges starting and ending anywhere in and across blocks."""
    import random

    rng = random.Random(0)
    table = BlockTable(BlockAllocator(200, 16))
    table.reserve(1500)
    rng.shuffle(table.blocks)
    for _ in range(500):
        a = rng.randrange(0, 1400)
        b = rng.randrange(a, 1500)
        assert table.slots(a, b) == [table.blocks[p // 16] * 16 + p % 16 for p in range(a, b)]
    assert table.slots(5, 5) == []
