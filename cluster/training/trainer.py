"""The training loop: AdamW under a warmup + cosine learning rate whose
clock is the run's training time (or its steps, with ``--max-steps``),
validation on a fixed batch, the exported checkpoint (the best by
validation, else the latest), and the training state that ``--resume``
continues from."""

from __future__ import annotations

import json
import math
from pathlib import Path
import time

import torch

from specray.training.dataset import Batcher, BatchStream, sample_anchors
from specray.training.export import save_checkpoint
from specray.training.loss import block_loss, step_flops, summarize
from specray.training.progress import bar, elapsed, log
from specray.training.resume import restore_rng, save_state


def learning_rate(args, step: int, progress: float) -> float:
    """Linear warmup over ``--warmup-steps``, then cosine from ``--lr`` down
    to ``--min-lr-ratio`` of it as ``progress`` goes from 0 to 1."""
    warm = min(1.0, (step + 1) / args.warmup_steps)
    cos = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return args.lr * warm * (args.min_lr_ratio + (1 - args.min_lr_ratio) * cos)


def make_optimizer(args, drafter, device) -> torch.optim.AdamW:
    decay_params = [p for n, p in drafter.named_parameters() if p.ndim == 2]
    other = [p for n, p in drafter.named_parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay_params, "weight_decay": args.weight_decay}, {"params": other, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8, **({"fused": True} if device.type == "cuda" else {}))


def step_once(args, drafter, opt, batch, embed, lm_head, mask_id, decay, amp, lr: float):
    """One optimizer step on ``batch``; returns its loss statistics (on the
    device: no host sync) and the gradient norm."""
    for gp in opt.param_groups:
        gp["lr"] = lr
    toks, feats, L, P, soft = batch
    anchors = sample_anchors(L, P, args.anchors)
    loss, stats = block_loss(drafter, embed, lm_head, toks, feats, L, anchors, mask_id, decay, amp, soft,
                             args.soft_weight)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    gnorm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), args.clip)
    opt.step()
    return torch.cat([stats, (loss.detach() * 1.0).view(1), gnorm.view(1)])


def train(args, drafter, embed, lm_head, batcher: Batcher, train_idx, val_idx, mask_id, device, deadline: float,
          out: Path, init: dict, state: dict | None = None) -> dict:
    """Trains until ``deadline``, ``--max-steps`` or, resumed, the first
    run's planned training time; ``state`` (``resume.load_state``) continues
    an interrupted run where its last saved state left it."""
    c = drafter.config
    B = c.block_size
    amp = torch.bfloat16 if device.type == "cuda" else None
    # w_k = exp(-(k-1)/gamma): early rows decide acceptance (a block is cut at
    # its first miss), so they get the most weight (DFlash: gamma=7 for B=16).
    decay = torch.exp(-torch.arange(B - 1, device=device, dtype=torch.float32) / args.gamma)
    opt = make_optimizer(args, drafter, device)
    stream = BatchStream(train_idx, batcher.lengths, args.batch_seqs, args.seed)
    N = min(args.batch_seqs, len(train_idx))
    V = embed.shape[0]

    # Fixed validation batch and anchors, so the curve is comparable.
    val = vsoft = None
    if val_idx:
        vt, vf, vL, vP, vsoft = batcher(val_idx[: args.batch_seqs])
        g = torch.Generator(device=device).manual_seed(1234)
        val = (vt, vf, vL, sample_anchors(vL, vP, args.anchors, g))

    avg_T = float(batcher.lengths[train_idx].float().mean())
    T_est = -(-int(avg_T) // 64) * 64
    flops = step_flops(c, N, args.anchors, T_est, V)
    log(f"train: {len(train_idx)} train / {len(val_idx)} val sequences; per step {N} seqs x {args.anchors} anchors "
        f"= {N * args.anchors} blocks, {N * args.anchors * (B - 1)} labelled rows, ~{N * avg_T:.0f} context tokens; "
        f"~{flops / 1e12:.2f} TFLOP/step (T~{T_est})")

    def validate():
        drafter.eval()
        with torch.no_grad():
            _, vs = block_loss(drafter, embed, lm_head, *val, mask_id, decay, amp, vsoft, args.soft_weight)
        drafter.train()
        return summarize(vs, B, val[0].shape[0] * args.anchors)

    # With a validation set OUT holds the best checkpoint by validation
    # acceptance estimate (ties: lower CE): many epochs over a few thousand
    # responses can overfit, and the last weights need not be the best.
    best: dict = {}

    def keep_if_best(v, at_step):
        if not best or (v["tau"], -v["ce"]) > (best["val_tau_est"], -best["val_ce"]):
            save_checkpoint(drafter, out)
            best.update(step=at_step, val_tau_est=round(v["tau"], 4), val_ce=round(v["ce"], 4), val_acc=v["acc"])

    log_path = out / "train_log.jsonl"
    step, done_s, history = 0, 0.0, []
    t_train = time.time()
    planned_s = max(deadline - t_train, 1e-6)
    if state is None:
        log_path.write_text("")
    else:
        opt.load_state_dict(state["optimizer"])
        stream.load_state_dict(state["stream"])
        step, done_s, planned_s = state["step"], state["train_s"], state["planned_s"]
        best.update(state["best"])
        history = list(state["history"])
        # Records past the saved step belong to the lost part of the run.
        kept = [line for line in log_path.read_text().splitlines() if json.loads(line)["step"] <= step] \
            if log_path.is_file() else []
        log_path.write_text("".join(line + "\n" for line in kept))
        restore_rng(state)
        log(f"resume: step {step}, {done_s:.0f} of {planned_s:.0f} s of training done")
    # A resumed run stops at its own deadline or where the first run's
    # planned training time runs out, whichever comes first.
    deadline = min(deadline, t_train + planned_s - done_s)

    def save():
        save_state(out, drafter=drafter, optimizer=opt, stream=stream, step=step,
                   train_s=done_s + time.time() - t_train, planned_s=planned_s, best=best, history=history,
                   init=init, args=vars(args))

    acc_stats = None
    t_log, steps_log, blocks_log, last_save = t_train, 0, 0, t_train
    progress = bar(total=args.max_steps or None, initial=step, unit="step", desc="train")
    while True:
        now = time.time()
        if now >= deadline or (args.max_steps and step >= args.max_steps):
            break
        frac = (done_s + now - t_train) / planned_s
        if args.max_steps:
            frac = max(frac, step / args.max_steps)
        lr = learning_rate(args, step, frac)
        batch = batcher(next(stream))
        stats = step_once(args, drafter, opt, batch, embed, lm_head, mask_id, decay, amp, lr)
        step += 1
        progress.update(1)
        acc_stats = stats if acc_stats is None else acc_stats + stats
        steps_log += 1
        blocks_log += batch[0].shape[0] * args.anchors

        if step % args.log_every == 0 or step == 1:
            rec = summarize(acc_stats[:-2], B, blocks_log)
            loss_avg, gn_avg = (acc_stats[-2:] / steps_log).tolist()
            dt = time.time() - t_log
            rec = {"step": step, "time_s": round(elapsed(), 1), "lr": lr, "loss": round(loss_avg, 4),
                   "ce": round(rec["ce"], 4), "tau_est": round(rec["tau"], 3), "grad_norm": round(gn_avg, 3),
                   "steps_per_s": round(steps_log / dt, 2), "tflops": round(flops * steps_log / dt / 1e12, 1),
                   "acc": rec["acc"]}
            if val is not None:
                v = validate()
                rec.update(val_ce=round(v["ce"], 4), val_tau_est=round(v["tau"], 3), val_acc=v["acc"])
                keep_if_best(v, step)
            with open(log_path, "a") as f:
                f.write(json.dumps(rec) + "\n")
            history.append(rec)
            progress.set_postfix(loss=rec["loss"], tau=rec["tau_est"], refresh=False)
            log(f"step {step}: loss {rec['loss']:.3f} ce {rec['ce']:.3f} tau~{rec['tau_est']:.2f} "
                f"acc[1,2,4,8,15]={[rec['acc'][i] for i in (0, 1, 3, 7, B - 2) if i < B - 1]} "
                + (f"| val ce {rec['val_ce']:.3f} tau~{rec['val_tau_est']:.2f} " if val is not None else "")
                + f"| lr {lr:.2e} gn {gn_avg:.2f} {rec['steps_per_s']:.1f} it/s {rec['tflops']} TFLOP/s")
            acc_stats, steps_log, blocks_log, t_log = None, 0, 0, time.time()
        by_steps = args.save_every_steps and step % args.save_every_steps == 0
        if by_steps or (args.save_every_s and time.time() - last_save > args.save_every_s):
            if val is None:
                save_checkpoint(drafter, out)
            save()  # insurance against a hard kill: --resume continues from here
            last_save = time.time()
    progress.close()
    train_s = time.time() - t_train
    if val is None:
        save_checkpoint(drafter, out)
    elif not history or history[-1]["step"] != step:
        keep_if_best(validate(), step)
    save()
    return dict(steps=step, train_seconds=round(done_s + train_s, 1), history=history, flops_per_step=flops,
                best=best)
