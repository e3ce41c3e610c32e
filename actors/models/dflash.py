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
    q_proj: torch.Tensor  # [Hq * D, H]
    q_bias: torch.Tensor | None
    kv_proj: torch.Tensor  # [2 * Hkv * D, H]
    kv_bias: torch.Tensor | None
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
            kv_bias = None
            if spec.attention_bias:
                kv_bias = torch.cat([get(a + "k_proj.bias", (Hkv * D,)), get(a + "v_proj.bias", (Hkv * D,))])
            self.layers.append(
                DrafterLayer(
                    input_norm=get(p + "input_layernorm.weight", (H,)),
                    q_proj=get(a + "q_proj.weight", (Hq * D, H)),
                    q_bias=bias(a + "q_proj.bias", (Hq * D,)),
                    kv_proj=torch.cat([get(a + "k_proj.weight", (Hkv * D, H)), get(a + "v_proj.weight", (Hkv * D, H))]),
                    kv_bias=kv_bias,
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
        rope = self.rotary.lookup(positions, ctx.dtype)
        for li, layer in enumerate(self.layers):
            kv = F.linear(ctx, layer.kv_proj, layer.kv_bias)
            ops.qkv_rope(None, kv, 0, spec.num_kv_heads, self.head_dim, rope, None, layer.k_norm, eps,
                         kv_cache[li, 0], kv_cache[li, 1], slot_mapping)

    def propose_hidden(
        self,
        block_ids: torch.Tensor,
        ctx_lens: torch.Tensor,
        block_lens: torch.Tensor,
        block_tables: torch.Tensor,
        max_ctx_len: int,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Final-normed hidden states ``[S, B, H]`` of the blocks
        ``block_ids`` ``[S, B]``; block ``s`` starts at position
        ``ctx_lens[s]`` and has ``block_lens[s]`` real rows."""
        spec = self.spec
        eps = spec.rms_norm_eps
        S, B = block_ids.shape
        nq, nkv, D = spec.num_heads, spec.num_kv_heads, self.head_dim
        positions = ctx_lens[:, None] + torch.arange(B, device=block_ids.device)[None]
        h = F.embedding(block_ids, self.embed).view(S * B, -1)
        if spec.input_embedding_scale != 1.0:
            h = h * spec.input_embedding_scale
        rope = self.rotary.lookup(positions.view(-1), h.dtype)
        # As in the target: each norm adds the sublayer output ``h`` to the
        # stream ``residual`` first.
        residual = None
        for li, layer in enumerate(self.layers):
            x, residual = ops.rms_norm(h, layer.input_norm, eps, residual)
            q = F.linear(x, layer.q_proj, layer.q_bias)
            kv = F.linear(x, layer.kv_proj, layer.kv_bias)  # [S*B, 2*nkv*D]: K, then V
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
        logits = F.linear(hidden, self.lm_head).float()
        if self.spec.output_multiplier != 1.0:
            logits = logits * self.spec.output_multiplier
        cap = self.spec.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits
