"""bench/row_invariance.py on a tiny random target (CPU, fp32): its
teacher-forced block and single-step passes compute the same logits up to
rounding, so the bitwise counts it reports on a GPU mean what they say; and,
on a target made row-invariant by construction, it counts no difference, and
a difference planted in one block row is traced to the op that made it."""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from factories import add_tokenizer, make_target

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import row_invariance  # noqa: E402

qwen3 = row_invariance.qwen3
linear_refs = sys.modules["specray.kernels.linear"]
PLANT_ROW = 2


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rows")
    hf = make_target(tmp / "t", seed=4)
    add_tokenizer(tmp / "t", hf.config.vocab_size)
    prompts = tmp / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ("The capital of France is", "Once upon")))
    return tmp, ["--target", str(tmp / "t"), "--prompts", str(prompts), "--device", "cpu", "--dtype", "float32",
                 "--block", "4", "--positions", "12", "--max-model-len", "128"]


def test_blocks_and_steps_agree_up_to_rounding(setup):
    tmp, argv = setup
    r = row_invariance.main(argv + ["--out", str(tmp / "r.json")])
    assert len(r["prompts"]) == 2 and r["total"]["positions"] == 24
    for row in r["prompts"].values():
        assert row["max_abs_diff"] < 1e-4, row
        assert row["argmax_differ_block_4"] == 0
    assert json.loads((tmp / "r.json").read_text())["total"] == r["total"]


@pytest.fixture
def row_invariant_target(monkeypatch):
    """Every GEMM and every attention row computed one row at a time, so a
    block row is bitwise its decode step (CPU GEMMs are not otherwise)."""
    F, attend = qwen3.F, qwen3.ops.paged_attention

    def linear(x, w, b=None):
        return torch.cat([F.linear(r[None], w, b) for r in x]) if len(x) else F.linear(x, w, b)

    def attention(q, k, v, query_start_loc, seq_lens, tables, max_query_len, max_seq_len, scale, window=None,
                  tree_mask=None, tree=None):
        assert len(seq_lens) == 1 and tree_mask is None  # the bench runs one sequence at a time, no trees
        n, end = q.shape[0], int(seq_lens[0])
        return torch.cat([attend(q[i:i + 1], k, v, query_start_loc.new_tensor([0, 1]),
                                 seq_lens.new_tensor([end - n + i + 1]), tables, 1, max_seq_len, scale, window)
                          for i in range(n)])

    monkeypatch.setattr(qwen3, "F", SimpleNamespace(linear=linear))
    monkeypatch.setattr(linear_refs, "linear", linear)  # the projections' GEMMs (kernels.ops calls it)
    monkeypatch.setattr(qwen3.ops, "paged_attention", attention)


def test_row_invariant_target_counts_no_difference(setup, row_invariant_target):
    r = row_invariance.main(setup[1])
    assert r["total"]["positions_differ_block_4"] == r["total"]["positions_differ_block_8"] == 0
    assert "first_difference" not in r


def test_planted_difference_is_traced_at_its_row(setup, row_invariant_target, monkeypatch):
    """The MLP's down projection nudges row 2 of every call of 4+ rows: the
    first position that differs is the first block's row 2, and the trace,
    run at that row of its block (not as row 0 of a block starting there,
    which holds no nudge), names it as the first op that differs."""
    silu_mul_linear = qwen3.ops.silu_mul_linear

    def nudged(x, w, b=None):
        out = silu_mul_linear(x, w, b)
        if out.shape[0] >= 4:
            out = out.clone()
            out[PLANT_ROW] += 1e-3
        return out

    monkeypatch.setattr(qwen3.ops, "silu_mul_linear", nudged)
    r = row_invariance.main(setup[1])
    assert r["total"]["positions_differ_block_4"] > 0
    first = r["first_difference"]
    rows = r["prompts"][first["prompt"]]
    assert first["position"] == rows["prompt_len"] + PLANT_ROW and first["row_in_block"] == PLANT_ROW
    assert first["first_op"] == "silu_mul_linear", first
