"""specray.training: the training forward sees exactly what inference sees
(block logits equal dflash.model.DFlashDraftModel's for the same context,
weights read back from the checkpoint training writes), the checkpoint
loads in the reference and in specray, and a tiny end-to-end run (generate
-> features -> train -> save) works on CPU."""

import json
import os
from pathlib import Path

import pytest
from safetensors.torch import load_file
import torch
import torch.nn.functional as F

from factories import add_tokenizer, make_target
from specray import LLM, SamplingParams
from specray.config import DrafterSpec, TargetSpec
from specray.training import cli, dataset, export, initialize, model, prompts
from specray.training.generator import BulkGenerator
from specray.training.loss import block_loss, summarize

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-4


def build_and_save(tmp_path, arch, intermediate, block_size=8, taps=(1, 2)):
    hf = make_target(tmp_path / "t", arch=arch)
    cfg = model.drafter_config(hf.config, 2, intermediate, list(taps), block_size, hf.config.vocab_size - 1)
    d = model.Drafter(cfg, max_positions=128)
    calib = [torch.randint(2, hf.config.vocab_size - 1, (20,), generator=torch.Generator().manual_seed(3))]
    info = initialize.init_drafter(d, hf, list(taps), "target", calib, "cpu")
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in d.parameters():
            # Move every weight off its init (fc's zero blocks included) and
            # onto bf16 values, so the bf16 checkpoint holds exactly them.
            p.add_(0.05 * torch.randn(p.shape, generator=g))
            p.copy_(p.bfloat16().float())
    export.save_checkpoint(d, tmp_path / "d")
    return hf, d.eval(), info


@pytest.mark.parametrize("arch,intermediate", [("llama", 128), ("qwen3", 96)])
def test_train_forward_matches_reference(tmp_path, arch, intermediate):
    from dflash.model import DFlashDraftModel

    hf, d, info = build_and_save(tmp_path, arch, intermediate)
    assert info["source_layers"] == [2, 3] and info["fc_identity_tap"] == 1
    ref, loading = DFlashDraftModel.from_pretrained(str(tmp_path / "d"), dtype=torch.float32, output_loading_info=True)
    assert not any(loading.values()), loading  # exactly the reference's parameter names
    ref = ref.eval()
    B, taps = ref.block_size, ref.target_layer_ids
    assert (B, taps, ref.mask_token_id) == (8, [1, 2], hf.config.vocab_size - 1)

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, hf.config.vocab_size - 1, (1, 40), generator=g)
    with torch.no_grad():
        hs = hf.model(input_ids=ids, output_hidden_states=True).hidden_states
        feats = torch.cat([hs[t + 1] for t in taps], -1)  # [1, 40, 2H]
        anchors = torch.tensor([[5, 17, 30, 38, 17]])  # a block past the end, a repeat
        block = ids[0, anchors[0]][:, None].repeat(1, B)
        block[:, 1:] = ref.mask_token_id
        emb = hf.get_input_embeddings().weight
        got = d(feats, F.embedding(block, emb)[None], anchors)[0] @ hf.lm_head.weight.T  # [K, B, V]
        for j, a in enumerate(anchors[0].tolist()):
            h = ref(
                target_hidden=feats[:, :a],
                noise_embedding=F.embedding(block[j : j + 1], emb),
                position_ids=torch.arange(a + B)[None],
            )
            want = ref.compute_logits(h, hf.lm_head)[0]
            diff = (got[j] - want).abs().max().item()
            assert diff <= TOL, (a, diff)


def test_narrower_mlp_starts_as_a_pruned_copy(tmp_path):
    hf = make_target(tmp_path / "t", arch="llama")  # intermediate 128
    cfg = model.drafter_config(hf.config, 2, 48, [1, 2], 8, hf.config.vocab_size - 1)
    d = model.Drafter(cfg, max_positions=64)
    calib = [torch.randint(2, hf.config.vocab_size - 1, (20,), generator=torch.Generator().manual_seed(3))]
    initialize.init_drafter(d, hf, [1, 2], "target", calib, "cpu")
    for dl, tl in zip(d.layers, hf.model.layers[-2:], strict=True):
        norms = tl.mlp.down_proj.weight.norm(dim=0)
        keep = norms.topk(48).indices.sort().values  # the rows of the 48 largest down_proj columns
        torch.testing.assert_close(dl.mlp.gate_proj.weight, tl.mlp.gate_proj.weight[keep])
        torch.testing.assert_close(dl.mlp.up_proj.weight, tl.mlp.up_proj.weight[keep])
        torch.testing.assert_close(dl.mlp.down_proj.weight, tl.mlp.down_proj.weight[:, keep])


def test_loss_labels_and_positions(tmp_path):
    hf, d, _ = build_and_save(tmp_path, "qwen3", 96)
    B = d.block_size
    ids = torch.randint(2, 300, (2, 24))
    L = torch.tensor([24, 20])
    with torch.no_grad():
        hs = hf.model(input_ids=ids, output_hidden_states=True).hidden_states
        feats = torch.cat([hs[2], hs[3]], -1)
    anchors = torch.tensor([[10, 22], [15, 18]])
    decay = torch.exp(-torch.arange(B - 1).float() / 7.0)
    loss, stats = block_loss(d, hf.get_input_embeddings().weight, hf.lm_head.weight, ids, feats, L, anchors,
                                319, decay, None)
    assert torch.isfinite(loss)
    # labelled rows: anchor 10 -> 7 (all), 22 -> 1 (only 23), 15 -> 4 (16..19), 18 -> 1 (19)
    assert stats[1].item() == 7 + 1 + 4 + 1
    s = summarize(stats, B, 4)
    assert 1.0 <= s["tau"] <= B and len(s["acc"]) == B - 1
    # Soft targets: a top-1 "distribution" on the data's next token is the
    # hard cross-entropy again, whatever the weight.
    nxt = torch.cat([ids[:, 1:], ids[:, -1:]], 1)
    onehot = (torch.zeros(2, 24, 1), nxt[..., None].int())
    for wt in (0.3, 1.0):
        soft_loss, _ = block_loss(d, hf.get_input_embeddings().weight, hf.lm_head.weight, ids, feats, L,
                                     anchors, 319, decay, None, onehot, wt)
        torch.testing.assert_close(soft_loss, loss)
    # ... and a real top-k changes it.
    f, soft = dataset.compute_features(hf, ids.flatten().int(), torch.tensor([24, 24]), torch.tensor([0, 24]), [1, 2],
                                  "cpu", 1000, soft_k=5)
    want = hf(ids).logits.log_softmax(-1).topk(5, -1)
    torch.testing.assert_close(soft[0].view(2, 24, 5).float(), want.values, atol=2e-2, rtol=0)  # bf16 storage
    assert torch.equal(soft[1].view(2, 24, 5).long(), want.indices)
    torch.testing.assert_close(f.view(2, 24, -1), feats.to(f.dtype))
    mixed, _ = block_loss(d, hf.get_input_embeddings().weight, hf.lm_head.weight, ids, feats, L, anchors, 319,
                             decay, None, (soft[0].view(2, 24, 5), soft[1].view(2, 24, 5)), 0.5)
    assert torch.isfinite(mixed) and not torch.allclose(mixed, loss)
    # anchors are response positions whose next token exists
    a = dataset.sample_anchors(L, torch.tensor([3, 15]), 1000)
    assert set(a[0].tolist()) == set(range(3, 23)) and set(a[1].tolist()) == set(range(15, 19))


def test_checkpoint_runs_losslessly_in_specray(tmp_path):
    build_and_save(tmp_path, "llama", 128)
    spec = DrafterSpec.from_dir(tmp_path / "d")
    spec.check_fits(TargetSpec.from_dir(tmp_path / "t"))
    assert spec.target_layer_ids == (1, 2) and spec.block_size == 8
    prompts = [[5, 9, 44, 12, 7], [3] * 11, list(range(20, 50))]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    base = LLM(str(tmp_path / "t")).generate(prompts, params)
    spec_out = LLM(str(tmp_path / "t"), str(tmp_path / "d")).generate(prompts, params)
    assert [o.token_ids for o in spec_out] == [o.token_ids for o in base]
    assert all(o.metrics.acceptance_lengths for o in spec_out)


def test_end_to_end_tiny(tmp_path, capsys):
    make_target(tmp_path / "t", arch="llama", vocab_size=330, seed=4)
    add_tokenizer(tmp_path / "t", 320)  # ids 320..329: embedding rows no text maps to
    prompts = tmp_path / "p.jsonl"
    with open(prompts, "w") as f:
        for i in range(6):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"Hello world number {i}, test."}]}) + "\n")
    out = tmp_path / "out"
    argv = ["--target", str(tmp_path / "t"), "--prompts", str(prompts), "--out", str(out), "--device", "cpu",
            "--max-new-tokens", "12", "--gen-batch-size", "4", "--batch-seqs", "2", "--anchors", "4",
            "--block-size", "8", "--max-steps", "6", "--log-every", "2", "--warmup-steps", "2",
            "--intermediate-size", "96", "--magpie", "5", "--magpie-max-tokens", "6"]
    more = tmp_path / "q.jsonl"
    more.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Question {i}?"}]}) + "\n"
                            for i in range(3)))
    summary = cli.train_drafter(argv[:4] + [str(more)] + argv[4:] + ["--sampled-prompts", str(more), "--sampled-answers", "2"])
    gen = summary["data"]["gen"]
    assert gen["magpie_sampled"] == 5 and gen["file_prompts"] == 6 + 3
    # every prompt answered greedily, the second file's twice more sampled
    assert summary["steps"] == 6 and summary["data"]["sequences"] == 6 + 3 + 3 * 2 + gen["magpie_kept"]
    written = (out / "magpie_prompts.jsonl").read_text().splitlines()
    assert len(written) == gen["magpie_kept"]
    assert summary["architecture"]["mask_token_id"] == 329
    logs = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logs] == [1, 2, 4, 6] and all("val_ce" in r for r in logs)
    spec = DrafterSpec.from_dir(out)
    assert spec.num_layers == 4 and spec.mask_token_id == 329 and spec.num_target_layers == 4  # the default depth
    assert json.loads((out / "training.json").read_text())["steps"] == 6
    # A rerun reuses the generated data.
    mtime = (out / "data.pt").stat().st_mtime
    cli.train_drafter(argv[:-12] + ["--max-steps", "1", "--log-every", "1", "--intermediate-size", "96", "--soft-top-k", "4"])
    assert (out / "data.pt").stat().st_mtime == mtime
    assert "data: reusing" in capsys.readouterr().out
    out_spec = LLM(str(tmp_path / "t"), str(out)).generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=8))
    assert len(out_spec[0].token_ids) == 8 or out_spec[0].finish_reason == "stop"
    # Training continues from a checkpoint: with a zero learning rate its
    # weights come back unchanged (at its own depth, asked for or not).
    more = tmp_path / "more"
    more.mkdir()
    os.symlink(out / "data.pt", more / "data.pt")
    summary = cli.train_drafter(argv[:4] + ["--out", str(more), "--device", "cpu", "--init-from", str(out), "--draft-layers", "4",
                                  "--max-steps", "2", "--lr", "0", "--batch-seqs", "2", "--anchors", "4"])
    assert summary["init"] == {"mode": "from", "dir": str(out)} and summary["architecture"]["layers"] == 4
    before, after = load_file(str(out / "model.safetensors")), load_file(str(more / "model.safetensors"))
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def grow_setup(tmp_path):
    """A 2-layer checkpoint (build_and_save) for a target with a tokenizer,
    and a cached data.pt in OUT, so main() goes straight to the drafter."""
    hf, d, _ = build_and_save(tmp_path, "llama", 128)
    add_tokenizer(tmp_path / "t", 320)
    out = tmp_path / "out"
    out.mkdir()
    g = torch.Generator().manual_seed(7)
    seqs = [torch.randint(2, 300, (n,), generator=g, dtype=torch.int32) for n in (30, 26, 34, 28)]
    torch.save({"tokens": torch.cat(seqs), "lengths": torch.tensor([len(s) for s in seqs]),
                "prompt_lens": torch.tensor([10, 8, 12, 9]), "meta": {"max_new_tokens": 24, "temperature": 0.0}},
               out / "data.pt")
    argv = ["--target", str(tmp_path / "t"), "--out", str(out), "--device", "cpu", "--init-from", str(tmp_path / "d"),
            "--max-steps", "1", "--log-every", "1", "--lr", "0", "--batch-seqs", "2", "--anchors", "4"]
    return hf, d, out, argv


def test_init_from_grows_the_checkpoint(tmp_path):
    hf, d, out, argv = grow_setup(tmp_path)
    summary = cli.train_drafter(argv + ["--draft-layers", "3"])
    init = summary["init"]
    assert (init["mode"], init["checkpoint_layers"], init["new_layers"]) == ("grow", 2, [2])
    assert init["source_layers"] == [3]  # the target's last layer, as for a fresh drafter's last position
    assert json.loads((out / "training.json").read_text())["init"] == init
    assert summary["architecture"]["layers"] == 3 and summary["architecture"]["block_size"] == 8
    spec = DrafterSpec.from_dir(out)
    spec.check_fits(TargetSpec.from_dir(tmp_path / "t"))
    assert spec.num_layers == 3 and spec.target_layer_ids == (1, 2) and spec.mask_token_id == 319

    # Everything the checkpoint had comes back bit for bit; the new layer is
    # the target's last one with its residual branches zeroed.
    before, after = load_file(str(tmp_path / "d" / "model.safetensors")), load_file(str(out / "model.safetensors"))
    new = {k for k in after if k.startswith("layers.2.")}
    assert new and after.keys() == before.keys() | new
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not after["layers.2.self_attn.o_proj.weight"].any() and not after["layers.2.mlp.down_proj.weight"].any()
    src = hf.model.layers[3]
    assert torch.equal(after["layers.2.self_attn.q_proj.weight"], src.self_attn.q_proj.weight.bfloat16())
    assert torch.equal(after["layers.2.mlp.gate_proj.weight"], src.mlp.gate_proj.weight.bfloat16())

    # ... so the grown drafter computes what the checkpoint computes.
    from transformers import Qwen3Config

    grown = model.Drafter(Qwen3Config.from_pretrained(str(out)), max_positions=128)
    grown.load_state_dict({k: v.float() for k, v in after.items()})
    ids = torch.randint(2, 300, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hs = hf.model(input_ids=ids, output_hidden_states=True).hidden_states
        feats = torch.cat([hs[2], hs[3]], -1)
        anchors = torch.tensor([[5, 17, 30]])
        block = ids[0, anchors[0]][:, None].repeat(1, 8)
        block[:, 1:] = 319
        x = F.embedding(block, hf.get_input_embeddings().weight)[None]
        want, got = d(feats, x, anchors) @ hf.lm_head.weight.T, grown.eval()(feats, x, anchors) @ hf.lm_head.weight.T
    torch.testing.assert_close(got, want)


def test_init_from_rejects_fewer_layers_and_conflicting_flags(tmp_path):
    _, _, _, argv = grow_setup(tmp_path)
    with pytest.raises(SystemExit, match="--draft-layers 1 is fewer than the 2 layers of the --init-from checkpoint"):
        cli.train_drafter(argv + ["--draft-layers", "1"])
    with pytest.raises(SystemExit, match="--block-size 16 conflicts with the --init-from checkpoint's 8"):
        cli.train_drafter(argv + ["--draft-layers", "3", "--block-size", "16"])
    with pytest.raises(SystemExit, match="--target-layer-ids"):
        cli.train_drafter(argv + ["--target-layer-ids", "0,2"])


def test_bulk_generator_matches_hf_greedy(tmp_path):
    """The self-distillation generator (static batches, padded graph layout,
    chunked prefill) gives HF's greedy tokens, cut after the first stop id."""
    hf = make_target(tmp_path / "t", arch="llama", seed=2)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 320, (n,), generator=g).tolist() for n in (3, 17, 9, 30, 5)]
    bulk = BulkGenerator(str(tmp_path / "t"), max_prompt_len=32, max_new_tokens=10, batch_size=4,
                         device="cpu", dtype="float32", prefill_tokens=24)
    ref = [hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                       pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    stop = ref[1][4]  # a token the second prompt emits: its answer ends there
    got = bulk.generate_all(prompts, temperature=0.0, top_p=1.0, stop_ids=[stop], seed=0, time_budget_s=1e9,
                            log=lambda m: None)
    want = [r[: r.index(stop) + 1] if stop in r else r for r in ref]
    assert got == want and len(got[1]) == 5


def test_self_written_prompts_near_held_out_sets_are_dropped():
    """Both held-out sets: eval (reported) and dev (chooses between drafters)."""
    sets = [ROOT / "data" / "prompts" / name for name in ("eval.jsonl", "dev.jsonl")]
    index = prompts.eval_index([str(p) for p in sets])
    for path in sets:
        first = json.loads(path.read_text().splitlines()[0])
        assert index.near(first["messages"][-1]["content"].upper().replace("?", "!")), path.name
    assert not index.near("Write a limerick about a cat who learns to play the trumpet.")
    assert prompts.eval_index([]) is None
    defaults = cli.parse_args(["--target", "t", "--out", "o"]).exclude_prompts
    assert sorted(Path(p).name for p in defaults) == ["dev.jsonl", "eval.jsonl"]


def test_train_drafter_command_help(capsys):
    """``specray train-drafter --help`` through the dispatcher and through
    the installed console script, every flag of the scripts it replaced
    listed."""
    import subprocess
    import sys

    from specray.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["train-drafter", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--target", "--out", "--resume", "--init-from", "--draft-layers", "--soft-top-k", "--magpie-systems",
                 "--sampled-answers", "--save-every-steps", "--gen-only", "--exclude-prompts"):
        assert flag in text, flag
    script = Path(sys.executable).parent / "specray"
    res = subprocess.run([str(script), "train-drafter", "--help"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "--resume" in res.stdout, res.stderr


def resume_setup(tmp_path):
    """A target with a tokenizer and OUT dirs holding the same cached
    data.pt (8 sequences), so a run goes straight to training."""
    make_target(tmp_path / "t", arch="llama", vocab_size=330, seed=4)
    add_tokenizer(tmp_path / "t", 320)
    g = torch.Generator().manual_seed(7)
    seqs = [torch.randint(2, 300, (n,), generator=g, dtype=torch.int32) for n in (30, 26, 34, 28, 40, 22, 31, 36)]
    data = {"tokens": torch.cat(seqs), "lengths": torch.tensor([len(s) for s in seqs]),
            "prompt_lens": torch.tensor([10, 8, 12, 9, 11, 7, 10, 12]),
            "meta": {"max_new_tokens": 24, "temperature": 0.0}}
    outs = [tmp_path / "whole", tmp_path / "resumed"]
    for out in outs:
        out.mkdir()
        torch.save(data, out / "data.pt")
    # A clock too long to matter, so the learning rate follows the steps alone.
    argv = ["--target", str(tmp_path / "t"), "--device", "cpu", "--draft-layers", "2", "--intermediate-size", "96",
            "--block-size", "8", "--batch-seqs", "2", "--anchors", "4", "--max-steps", "8", "--log-every", "2",
            "--warmup-steps", "3", "--lr", "3e-3", "--val-frac", "0.2", "--time-budget-s", "1e9",
            "--save-every-s", "0", "--save-every-steps", "4"]
    return outs, argv


def test_interrupted_run_resumes_bit_for_bit(tmp_path, monkeypatch):
    """A run killed during step 7 resumes through ``specray train-drafter
    --resume`` from the state saved at step 4 (its saved arguments) and ends
    with exactly the weights, optimizer state, log and checkpoint of the
    same run left alone: model, optimizer, schedule, batch order and RNG
    all come back."""
    from specray.cli import main
    from specray.training import resume, trainer

    (whole, resumed), argv = resume_setup(tmp_path)
    assert main(["train-drafter", "--out", str(whole), *argv]) == 0

    class Killed(Exception):
        pass

    real_step, calls = trainer.step_once, []

    def dies_on_step_7(*a, **k):
        calls.append(1)
        if len(calls) == 7:
            raise Killed
        return real_step(*a, **k)

    monkeypatch.setattr(trainer, "step_once", dies_on_step_7)
    with pytest.raises(Killed):
        main(["train-drafter", "--out", str(resumed), *argv])
    monkeypatch.setattr(trainer, "step_once", real_step)
    assert resume.load_state(resumed)["step"] == 4
    assert main(["train-drafter", "--out", str(resumed), "--resume"]) == 0

    summary = json.loads((resumed / "training.json").read_text())
    assert summary["resumed_from_step"] == 4 and summary["steps"] == 8
    assert summary["args"]["max_steps"] == 8 and summary["args"]["block_size"] == 8  # the saved arguments
    a, b = resume.load_state(whole), resume.load_state(resumed)
    assert a["step"] == b["step"] == 8
    assert a["model"].keys() == b["model"].keys() and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    moments = [(s["exp_avg"], s["exp_avg_sq"]) for s in a["optimizer"]["state"].values()]
    moments_b = [(s["exp_avg"], s["exp_avg_sq"]) for s in b["optimizer"]["state"].values()]
    assert all(torch.equal(x, y) for m, n in zip(moments, moments_b, strict=True) for x, y in zip(m, n))
    assert not torch.equal(a["model"]["fc.weight"], b["model"]["fc.weight"] * 0)  # it trained
    logs = [[json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()] for out in (whole, resumed)]
    assert [r["step"] for r in logs[1]] == [1, 2, 4, 6, 8]
    assert [(r["loss"], r["val_ce"]) for r in logs[0]] == [(r["loss"], r["val_ce"]) for r in logs[1]]
    ckpt_a, ckpt_b = load_file(str(whole / "model.safetensors")), load_file(str(resumed / "model.safetensors"))
    assert all(torch.equal(ckpt_a[k], ckpt_b[k]) for k in ckpt_a)
