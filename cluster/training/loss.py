"""The training loss: weighted cross-entropy of a block's rows against the
data's next tokens (optionally mixed with the target's top-k
distribution), the acceptance statistics logged beside it, and a step's
FLOPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def block_loss(drafter, embed, lm_head, toks, feats, L, anchors, mask_id, decay, amp_dtype, soft=None,
               soft_weight: float = 0.0):
    """Weighted CE over rows 1..B-1 plus detached statistics. With ``soft``
    (the target's top-k log-probs and ids ``[N, T, k]`` at every position),
    the loss mixes in ``soft_weight`` of the cross-entropy against the
    target's own next-token distribution (renormalised over its top k),
    which says how close the runners-up were, not just which token won."""
    T = toks.shape[1]
    B = drafter.block_size
    rows = anchors[..., None] + torch.arange(B, device=toks.device)  # [N, K, B]
    valid = rows < L[:, None, None]
    tok = toks.gather(1, rows.clamp(max=T - 1).flatten(1)).view_as(rows)
    block = tok.clone()
    block[..., 1:] = mask_id
    with torch.autocast(toks.device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
        h = drafter(feats, F.embedding(block, embed).float(), anchors)
        logits = F.linear(h[:, :, 1:], lm_head)
    labels, lv = tok[..., 1:], valid[..., 1:]
    lf = logits.float()
    lse = torch.logsumexp(lf, -1)
    ce = lse - lf.gather(-1, labels[..., None]).squeeze(-1)
    w = decay * lv
    loss = (ce * w).sum() / w.sum().clamp_min(1e-6)
    if soft is not None and soft_weight > 0:
        # Row k predicts position a+k: the target's distribution for it sits
        # at position a+k-1.
        at = (rows[..., 1:] - 1).clamp(max=T - 1).flatten(1)  # [N, K*(B-1)]
        k = soft[0].shape[-1]
        t_logp = soft[0].gather(1, at[..., None].expand(-1, -1, k)).view(*labels.shape, k).float()
        t_ids = soft[1].gather(1, at[..., None].expand(-1, -1, k)).view(*labels.shape, k).long()
        soft_ce = -(t_logp.softmax(-1) * (lf.gather(-1, t_ids) - lse[..., None])).sum(-1)
        loss = (1 - soft_weight) * loss + soft_weight * (soft_ce * w).sum() / w.sum().clamp_min(1e-6)
    with torch.no_grad():
        match = (logits.argmax(-1) == labels) & lv
        # Rows past the sequence end count as misses, so the accepted
        # prefix (+1 bonus) of a block is what greedy verification would give.
        stats = torch.cat([
            torch.stack([(ce * lv).sum(), lv.sum().float(), (match.long().cumprod(-1).sum(-1) + 1).sum().float()]),
            match.flatten(0, 1).sum(0).float(), lv.flatten(0, 1).sum(0).float(),
        ])
    return loss, stats


def summarize(stats: torch.Tensor, B: int, n_blocks: int) -> dict:
    s = stats.tolist()  # the one host sync per log interval
    ce_sum, n_valid, tau_sum = s[:3]
    hits, cnt = s[3 : 3 + B - 1], s[3 + B - 1 :]
    acc = [h / c if c else 0.0 for h, c in zip(hits, cnt, strict=True)]
    return {"ce": ce_sum / max(n_valid, 1), "acc": [round(a, 4) for a in acc],
            "tau": tau_sum / max(n_blocks, 1)}


def step_flops(c, N, K, T, V) -> float:
    """Model FLOPs of one training step (fwd + bwd), for sizing runs."""
    H, inter, D, nq, nkv, Ln = c.hidden_size, c.intermediate_size, c.head_dim, c.num_attention_heads, \
        c.num_key_value_heads, c.num_hidden_layers
    B = c.block_size
    R = N * K * B
    kH = len(c.dflash_config["target_layer_ids"]) * H
    lin = 2 * R * Ln * (2 * H * nq * D + 2 * H * nkv * D + 3 * H * inter)
    attn = 4 * N * Ln * nq * K * B * (T + K * B) * D
    ctx = 2 * N * T * (kH * H + Ln * 2 * H * nkv * D)
    head = 2 * N * K * (B - 1) * H * V
    return 3 * (lin + attn) + 2 * ctx + 2 * head  # frozen head: fwd + input grad only

