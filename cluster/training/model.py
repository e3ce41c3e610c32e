"""The drafter's training-time model: parameter names are
``dflash.model.DFlashDraftModel``'s, so its state dict is a checkpoint in the
DFlash authors' format. One forward runs a block at every anchor of a
sequence (training sees what inference sees after ``a`` tokens are
accepted)."""

from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        # Qwen3RMSNorm's order (fp32 statistics, cast back, then weight).
        dt = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dt)


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        H, D = c.hidden_size, c.head_dim
        self.nq, self.nkv, self.D = c.num_attention_heads, c.num_key_value_heads, D
        self.q_proj = nn.Linear(H, self.nq * D, bias=False)
        self.k_proj = nn.Linear(H, self.nkv * D, bias=False)
        self.v_proj = nn.Linear(H, self.nkv * D, bias=False)
        self.o_proj = nn.Linear(self.nq * D, H, bias=False)
        self.q_norm = RMSNorm(D, c.rms_norm_eps)
        self.k_norm = RMSNorm(D, c.rms_norm_eps)

    def forward(self, h, ctx, rope_q, rope_k, mask):
        """h [N, R, H] block rows, ctx [N, T, H] normed context features."""
        N, R, _ = h.shape
        S = ctx.shape[1] + R
        q = self.q_norm(self.q_proj(h).view(N, R, self.nq, self.D)).transpose(1, 2)
        kv_in = torch.cat([ctx, h.to(ctx.dtype)], 1)  # context K/V come from the same k/v_proj
        k = self.k_norm(self.k_proj(kv_in).view(N, S, self.nkv, self.D)).transpose(1, 2)
        v = self.v_proj(kv_in).view(N, S, self.nkv, self.D).transpose(1, 2)
        q, k = rotate(q, *rope_q), rotate(k, *rope_k)
        rep = self.nq // self.nkv
        # Explicit GQA expansion keeps SDPA on its masked fused kernels.
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        o = F.scaled_dot_product_attention(q.to(v.dtype), k.to(v.dtype), v, attn_mask=mask, scale=self.D**-0.5)
        return self.o_proj(o.transpose(1, 2).reshape(N, R, self.nq * self.D))


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, ctx, rope_q, rope_k, mask):
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope_q, rope_k, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Drafter(nn.Module):
    def __init__(self, config, max_positions: int):
        super().__init__()
        self.config = config
        taps = config.dflash_config["target_layer_ids"]
        self.block_size = config.block_size
        self.layers = nn.ModuleList([Layer(config) for _ in range(config.num_hidden_layers)])
        self.fc = nn.Linear(len(taps) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # cos/sin from transformers' own rotary class on this config: the
        # reference uses it, so any rope type in the config stays in parity.
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

        rot = Qwen3RotaryEmbedding(config)
        pos = torch.arange(max_positions)[None]
        cos, sin = rot(torch.zeros(1, dtype=torch.float32), pos)
        self.register_buffer("cos", cos[0].float(), persistent=False)
        self.register_buffer("sin", sin[0].float(), persistent=False)

    def forward(self, feats, x, anchors):
        """feats [N, T, k*H] target taps of positions 0..T-1; x [N, K, B, H]
        block embeddings; anchors [N, K]: block j starts at anchors[:, j]
        and sees context positions < anchors[:, j]. Returns the final-normed
        hidden states [N, K, B, H]."""
        N, K, B, H = x.shape
        T, R = feats.shape[1], K * B
        dev = feats.device
        ctx = self.hidden_norm(self.fc(feats))
        qpos = (anchors[..., None] + torch.arange(B, device=dev)).reshape(N, R)
        kpos = torch.cat([torch.arange(T, device=dev).expand(N, T), qpos], 1)
        rope_q = (self.cos[qpos].unsqueeze(1), self.sin[qpos].unsqueeze(1))
        rope_k = (self.cos[kpos].unsqueeze(1), self.sin[kpos].unsqueeze(1))
        see_ctx = torch.arange(T, device=dev) < anchors[..., None]  # [N, K, T]
        see_ctx = see_ctx[:, :, None].expand(N, K, B, T).reshape(N, R, T)
        blk = torch.arange(R, device=dev) // B
        see_blk = (blk[:, None] == blk[None]).expand(N, R, R)
        mask = torch.cat([see_ctx, see_blk], -1)[:, None]
        h = x.reshape(N, R, H)
        for layer in self.layers:
            h = layer(h, ctx, rope_q, rope_k, mask)
        return self.norm(h).view(N, K, B, H)


def default_taps(num_target_layers: int) -> list[int]:
    """The authors' spacing of five taps over layers 1 .. L-3 (every layer
    from 1 on for a target too shallow for it)."""
    L = num_target_layers
    return [round(1 + i * (L - 4) / 4) for i in range(5)] if L >= 8 else list(range(1, max(L - 1, 2)))


def parse_taps(text: str) -> list[int] | None:
    return [int(x) for x in text.split(",")] if text else None


def drafter_config(tcfg, num_layers, intermediate, taps, block_size, mask_id):
    from transformers import Qwen3Config

    rope = getattr(tcfg, "rope_parameters", None) or {
        "rope_type": "default", "rope_theta": float(getattr(tcfg, "rope_theta", 10000.0))}
    eos = tcfg.eos_token_id
    c = Qwen3Config(
        vocab_size=tcfg.vocab_size, hidden_size=tcfg.hidden_size, intermediate_size=intermediate,
        num_hidden_layers=num_layers, num_attention_heads=tcfg.num_attention_heads,
        num_key_value_heads=tcfg.num_key_value_heads,
        head_dim=getattr(tcfg, "head_dim", None) or tcfg.hidden_size // tcfg.num_attention_heads,
        hidden_act="silu", max_position_embeddings=tcfg.max_position_embeddings, rms_norm_eps=tcfg.rms_norm_eps,
        rope_parameters=dict(rope), attention_bias=False, attention_dropout=0.0, tie_word_embeddings=False,
        use_sliding_window=False, sliding_window=None, max_window_layers=num_layers,
        layer_types=["full_attention"] * num_layers, bos_token_id=tcfg.bos_token_id, eos_token_id=eos,
        pad_token_id=getattr(tcfg, "pad_token_id", None),
    )
    c.architectures = ["DFlashDraftModel"]
    c.block_size = block_size
    c.num_target_layers = tcfg.num_hidden_layers
    c.dflash_config = {"mask_token_id": int(mask_id), "target_layer_ids": [int(t) for t in taps]}
    c.dtype = "bfloat16"
    return c
