"""The DFlash drafter (arXiv 2602.06036) on a paged, per-request context KV.

Two passes, both batched over requests:

* ``store_context``: tapped target hidden states of newly *accepted*
  positions ``[n, k*H]`` -> ``fc`` -> ``hidden_norm`` -> every layer's
  ``k_proj``/``v_proj`` (+ ``k_norm``, RoPE at the absolute position) ->
  that layer's paged context KV. Computed once per position, kept until the
  request ends.
* ``propose``: the block ``[last, MASK x (B-1)]`` at positions
  ``p .. p+B-1`` is embedded with the *target's* embedding, runs through the
  Qwen3-style layers attending to [context KV ; block KV] (non-causal inside
  the block unless the layer says otherwise; block K/V are never stored),
  and the *target's* lm_head turns rows ``1 .. B-1`` into draft logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specray.actors.models.layers import Rotary
from specray.actors.weights import Checkpoint
from specray.config import DrafterSpec
from specray.kernels import ops


@dataclass
class DrafterLayer:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [(Hq + 2 * Hkv) * D, H]: Q, then K, then V
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor  # [D]
    k_norm: torch.Tensor  # [D]
    o_proj: torch.Tensor  # [H, Hq * D]
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [2I, H]
    down: torch.Tensor  # [H, I]
    causal: bool
    window: int | None


class DFlashDrafter:
    def __init__(self, spec: DrafterSpec, dtype: torch.dtype, device, max_positions: int):
        self.spec = spec
        self.dtype = dtype
        self.device = torch.device(device)
        self.head_dim = spec.head_dim
        self.scale = spec.head_dim**-0.5
        self.rotary = Rotary(spec.rope, spec.head_dim, max_positions, self.device)
        self.layers: list[DrafterLayer] = []
        self.fc: torch.Tensor | None = None
        # Every layer's K and V projections stacked ``[L * 2 * Hkv * D, H]``:
        # the context store projects its rows for all layers in one GEMM (a
        # copy of the rows inside each layer's ``qkv``: ~0.4 MB a layer at
        # SmolLM2's shape, against a GEMM launch a layer a step).
        self.ctx_kv: torch.Tensor | None = None
        self.ctx_kv_bias: torch.Tensor | None = None
        self.k_norms: torch.Tensor | None = None
        self.hidden_norm: torch.Tensor | None = None
        self.final_norm: torch.Tensor | None = None
        self.embed: torch.Tensor | None = None  # the target's
        self.lm_head: torch.Tensor | None = None  # the target's

    def load(self, ckpt: Checkpoint, embed: torch.Tensor, lm_head: torch.Tensor) -> None:
        spec = self.spec
        H, D, I = spec.hidden_size, spec.head_dim, spec.intermediate_size
        Hq, Hkv = spec.num_heads, spec.num_kv_heads
        prefix = "model." if "model.fc.weight" in ckpt else ""

        def get(name, shape):
            return ckpt.get(prefix + name, shape).to(device=self.device, dtype=self.dtype)

        def bias(name, shape):
            return get(name, shape) if spec.attention_bias else None

        self.fc = get("fc.weight", (H, len(spec.target_layer_ids) * H))
        self.hidden_norm = get("hidden_norm.weight", (H,))
        self.final_norm = get("norm.weight", (H,))
        self.layers = []
        for li in range(spec.num_layers):
            p = f"layers.{li}."
            a = p + "self_attn."
            qkv_bias = None
            if spec.attention_bias:
                qkv_bias = torch.cat([get(a + "q_proj.bias", (Hq * D,)), get(a + "k_proj.bias", (Hkv * D,)),
                                      get(a + "v_proj.bias", (Hkv * D,))])
            self.layers.append(
                DrafterLayer(
                    input_norm=get(p + "input_layernorm.weight", (H,)),
                    qkv=torch.cat([get(a + "q_proj.weight", (Hq * D, H)), get(a + "k_proj.weight", (Hkv * D, H)),
                                   get(a + "v_proj.weight", (Hkv * D, H))]),
                    qkv_bias=qkv_bias,
                    q_norm=get(a + "q_norm.weight", (D,)),
                    k_norm=get(a + "k_norm.weight", (D,)),
                    o_proj=get(a + "o_proj.weight", (H, Hq * D)),
                    o_bias=bias(a + "o_proj.bias", (H,)),
                    post_norm=get(p + "post_attention_layernorm.weight", (H,)),
                    gate_up=torch.cat([get(p + "mlp.gate_proj.weight", (I, H)), get(p + "mlp.up_proj.weight", (I, H))]),
                    down=get(p + "mlp.down_proj.weight", (H, I)),
                    causal=spec.layer_causal[li],
                    window=spec.layer_window[li],
                )
            )
        self.ctx_kv = torch.cat([layer.qkv[Hq * D:] for layer in self.layers])
        self.k_norms = torch.stack([layer.k_norm for layer in self.layers])  # [L, D]
        if spec.attention_bias:
            self.ctx_kv_bias = torch.cat([layer.qkv_bias[Hq * D:] for layer in self.layers])
        self.embed = embed.to(device=self.device, dtype=self.dtype)
        self.lm_head = lm_head.to(device=self.device, dtype=self.dtype)

    def store_context(
        self,
        hidden_tapped: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_cache: torch.Tensor,
    ) -> None:
        """``hidden_tapped`` ``[n, k*H]`` at ``positions`` ``[n]`` into the
        context KV ``[L, 2, blocks, block_size, Hkv, D]`` at ``slot_mapping``."""
        spec = self.spec
        eps = spec.rms_norm_eps
        ctx, _ = ops.rms_norm(F.linear(hidden_tapped.to(self.dtype), self.fc), self.hidden_norm, eps)
        kv_all = F.linear(ctx, self.ctx_kv, self.ctx_kv_bias)  # [n, L * 2 * Hkv * D]
        ops.context_kv(kv_all, spec.num_kv_heads, self.head_dim, self.rotary.lookup(positions, ctx.dtype),
                       self.k_norms, eps, kv_cache, slot_mapping)

    def propose_hidden(
        self,
        block_ids: torch.Tensor,
        ctx_lens: torch.Tensor,
        block_lens: torch.Tensor,
        block_tables: torch.Tensor,
        max_ctx_len: int,
        kv_cache: torch.Tensor,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states ``[S, B, H]`` of the blocks
        ``block_ids`` ``[S, B]``; block ``s`` starts at position
        ``ctx_lens[s]`` and has ``block_lens[s]`` real rows. ``positions``
        ``[S, B]`` (``ctx_lens[s] + 0 .. B-1``) where the caller has them."""
        spec = self.spec
        eps = spec.rms_norm_eps
        S, B = block_ids.shape
        nq, nkv, D = spec.num_heads, spec.num_kv_heads, self.head_dim
        if positions is None:
            positions = ctx_lens[:, None] + torch.arange(B, device=block_ids.device)[None]
        # Indexing, not F.embedding: its index_select kernel walks the ids
        # one after another (6.9 us for a block of 16 on the H200).
        h = self.embed[block_ids.reshape(-1)]
        if spec.input_embedding_scale != 1.0:
            h = h * spec.input_embedding_scale
        rope = self.rotary.lookup(positions.reshape(-1), h.dtype)
        # As in the target: each norm adds the sublayer output ``h`` to the
        # stream ``residual`` first.
        residual = None
        for li, layer in enumerate(self.layers):
            x, residual = ops.rms_norm(h, layer.input_norm, eps, residual)
            qkv = F.linear(x, layer.qkv, layer.qkv_bias)  # [S*B, (nq + 2*nkv)*D]
            q, kv = qkv[:, : nq * D], qkv[:, nq * D :]
            q, k = ops.qkv_rope(q, kv, nq, nkv, D, rope, layer.q_norm, layer.k_norm, eps)
            v = kv[:, nkv * D :].view(S, B, nkv, D)
            o = ops.dflash_block_attention(
                q.view(S, B, nq, D),
                k.view(S, B, nkv, D),
                v,
                kv_cache[li, 0],
                kv_cache[li, 1],
                ctx_lens,
                block_tables,
                max_ctx_len,
                block_lens,
                self.scale,
                layer.causal,
                layer.window,
            )
            h = F.linear(o.reshape(S * B, nq * D), layer.o_proj, layer.o_bias)
            x, residual = ops.rms_norm(h, layer.post_norm, eps, residual)
            h = F.linear(ops.silu_mul(F.linear(x, layer.gate_up)), layer.down)
        return ops.rms_norm(h, self.final_norm, eps, residual)[0].view(S, B, -1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[..., vocab]`` of ``hidden`` ``[..., H]``, in the model's
        dtype unless a multiplier or soft-capping needs fp32 (sampling casts;
        an argmax needs no cast)."""
        # One 2-D GEMM: a strided 3-D input (the block rows after the anchor)
        # runs as a batched GEMM that reads lm_head once per sequence
        # (95 us instead of ~17 at batch 8 on the H200).
        flat = hidden.reshape(-1, hidden.shape[-1])
        logits = F.linear(flat, self.lm_head).view(*hidden.shape[:-1], -1)
        if self.spec.output_multiplier != 1.0:
            logits = logits.float() * self.spec.output_multiplier
        cap = self.spec.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits.float() / cap) * cap
        return logits
