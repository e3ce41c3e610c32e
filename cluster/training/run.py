"""One training run, start to finish: the target, the data, the drafter
(fresh, from a checkpoint, grown, or resumed), the features, the loop, and
the summary in OUT/training.json."""

from __future__ import annotations

import json
from pathlib import Path
import time

import torch

from specray.training.dataset import Batcher, compute_features, select_sequences, split_validation
from specray.training.export import load_drafter, save_checkpoint
from specray.training.initialize import checkpoint_depth, grow_drafter, init_drafter, pick_mask_token
from specray.training.model import Drafter, default_taps, drafter_config, parse_taps
from specray.training.progress import elapsed, log, reset_clock
from specray.training.prompts import eos_token_ids
from specray.training.selfdistill import load_or_generate
from specray.training.trainer import train


def load_target(args, device):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.target)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype, attn_implementation="sdpa")
    target = target.to(device).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    tcfg = target.config
    log(f"target {args.target}: {tcfg.num_hidden_layers} layers, hidden {tcfg.hidden_size}, vocab {tcfg.vocab_size}, "
        f"{dtype} on {device}")
    return tok, target, dtype


def build_drafter(args, tok, target, tokens, calib, max_positions: int, ckpt, state, device):
    """(drafter, init info): resumed from ``state``, continued (or grown)
    from ``ckpt`` (``--init-from``), or fresh from the target."""
    tcfg = target.config
    weights = None
    if state is not None:
        from specray.training.resume import drafter_config as saved_config

        config, weights, init_info = saved_config(state), state["model"], state["init"]
    elif ckpt is not None:
        # Continue from a checkpoint: its config decides the architecture.
        config, weights = ckpt
        taps = config.dflash_config["target_layer_ids"]
        init_info = {"mode": "from", "dir": str(args.init_from)}
        if args.draft_layers > config.num_hidden_layers:
            config, weights, grow_info = grow_drafter(config, weights, args.draft_layers, target, taps, args.init,
                                                      calib, device)
            init_info = {"mode": "grow", "dir": str(args.init_from), **grow_info}
    else:
        args.draft_layers = 4 if args.draft_layers is None else args.draft_layers
        args.block_size = 16 if args.block_size is None else args.block_size
        taps = parse_taps(args.target_layer_ids) or default_taps(tcfg.num_hidden_layers)
        mask_id = pick_mask_token(tok, tcfg.vocab_size, tokens, args.mask_token_id)
        inter = args.intermediate_size or tcfg.intermediate_size
        config = drafter_config(tcfg, args.draft_layers, inter, taps, args.block_size, mask_id)
    args.draft_layers, args.block_size = config.num_hidden_layers, config.block_size
    drafter = Drafter(config, max_positions=max_positions + config.block_size + 64).to(device)
    n_params = sum(p.numel() for p in drafter.parameters())
    mb = 2 * n_params / 2**20
    dc = config.dflash_config
    log(f"drafter: {config.num_hidden_layers} layers, intermediate {config.intermediate_size}, taps "
        f"{dc['target_layer_ids']}, block {config.block_size}, mask {dc['mask_token_id']} "
        f"({tok.convert_ids_to_tokens(dc['mask_token_id'])!r}), {n_params / 1e6:.2f}M params = {mb:.1f} MiB bf16")
    if mb > args.max_ckpt_mb:
        raise SystemExit(f"drafter checkpoint would be {mb:.1f} MiB > --max-ckpt-mb {args.max_ckpt_mb}")
    if weights is not None:
        drafter.load_state_dict({k: v.to(device, torch.float32) for k, v in weights.items()})
    else:
        init_info = init_drafter(drafter, target, dc["target_layer_ids"], args.init, calib, device)
    log(f"init: {init_info}")
    return drafter, init_info


def run(args) -> dict:
    reset_clock()
    deadline = time.time() + args.time_budget_s - args.reserve_s
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    tok, target, dtype = load_target(args, device)
    state = ckpt = None
    if args.resume:
        from specray.training.resume import load_state

        state = load_state(out)
        if not (out / "data.pt").is_file():
            raise SystemExit(f"--resume: {out / 'data.pt'}, the data the run trained on, is missing")
    elif args.init_from:  # before stage 1: a checkpoint or flag that does not fit fails now, not after generation
        ckpt = load_drafter(args.init_from, args.target)
        args.draft_layers = checkpoint_depth(args, ckpt[0])

    data = load_or_generate(args, tok, eos_token_ids(target, tok), device, out)
    if args.gen_only:
        return {"data": data["meta"]}
    tokens, lengths, prompt_lens, offsets, data_stats = select_sequences(data, args.max_seq_len,
                                                                         args.max_train_tokens)
    calib = [tokens[offsets[i] : offsets[i] + lengths[i]] for i in range(min(8, len(lengths)))]
    drafter, init_info = build_drafter(args, tok, target, tokens, calib, int(lengths.max()), ckpt, state, device)
    config = drafter.config
    if state is None:
        save_checkpoint(drafter, out)  # loadable from the start

    # ---- features (one target pass per sequence)
    t_f = time.time()
    taps = config.dflash_config["target_layer_ids"]
    feats, soft = compute_features(target, tokens, lengths, offsets, taps, device, args.feat_batch_tokens,
                                   args.soft_top_k)
    if device.type == "cuda":
        torch.cuda.synchronize()
    feat_s = time.time() - t_f
    log(f"features: {tuple(feats.shape)} {feats.dtype} ({feats.numel() * feats.element_size() / 2**30:.2f} GiB) "
        f"in {feat_s:.1f}s")
    embed = target.get_input_embeddings().weight.detach().to(dtype)
    lm_head = target.get_output_embeddings().weight.detach().to(dtype)
    del target
    if device.type == "cuda":
        torch.cuda.empty_cache()

    train_idx, val_idx = split_validation(len(lengths), args.val_frac)
    batcher = Batcher(tokens, feats, lengths, prompt_lens, offsets, device, soft=soft)
    drafter.train()
    res = train(args, drafter, embed, lm_head, batcher, train_idx, val_idx, config.dflash_config["mask_token_id"],
                device, deadline, out, init_info, state)
    size = (out / "model.safetensors").stat().st_size
    summary = dict(
        data=data_stats, features_seconds=round(feat_s, 1), steps=res["steps"], train_seconds=res["train_seconds"],
        total_seconds=round(elapsed(), 1), final=res["history"][-1] if res["history"] else {},
        kept=res["best"] or "last step", init=init_info,
        resumed_from_step=state["step"] if state is not None else None,
        architecture=dict(layers=config.num_hidden_layers, intermediate_size=config.intermediate_size,
                          target_layer_ids=taps, block_size=config.block_size,
                          mask_token_id=config.dflash_config["mask_token_id"],
                          params=sum(p.numel() for p in drafter.parameters()), checkpoint_bytes=size),
        tflop_per_step=round(res["flops_per_step"] / 1e12, 3),
        peak_memory_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None,
        args=vars(args),
    )
    if args.eval_prompts and args.eval_n:
        from specray.training.evaluate import eval_acceptance

        del feats, batcher
        if device.type == "cuda":
            torch.cuda.empty_cache()
        summary["eval"] = eval_acceptance(args, out, tok)
    (out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    kept = f"best by validation at step {res['best']['step']}" if res["best"] else "last step"
    log(f"done: {res['steps']} steps, checkpoint ({kept}) {size / 2**20:.1f} MiB in {out}, "
        f"total {summary['total_seconds']}s")
    return summary
