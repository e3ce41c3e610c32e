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

from specray.actors.models.layers import Rotary, apply_rope, rms_norm
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

    def _kv(self, layer: DrafterLayer, x: torch.Tensor, rope):
        """K (normed, rotated) and V of ``x`` ``[..., H]``."""
        nkv, D = self.spec.num_kv_heads, self.head_dim
        k, v = F.linear(x, layer.kv_proj, layer.kv_bias).split([nkv * D, nkv * D], dim=-1)
        k = rms_norm(k.unflatten(-1, (nkv, D)), layer.k_norm, self.spec.rms_norm_eps)
        return apply_rope(k, rope), v.unflatten(-1, (nkv, D))

    def store_context(
        self,
        hidden_tapped: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_cache: torch.Tensor,
    ) -> None:
        """``hidden_tapped`` ``[n, k*H]`` at ``positions`` ``[n]`` into the
        context KV ``[L, 2, blocks, block_size, Hkv, D]`` at ``slot_mapping``."""
        ctx = rms_norm(F.linear(hidden_tapped.to(self.dtype), self.fc), self.hidden_norm, self.spec.rms_norm_eps)
        rope = self.rotary.lookup(positions, ctx.dtype)
        for li, layer in enumerate(self.layers):
            k, v = self._kv(layer, ctx, rope)
            ops.store_kv(kv_cache[li, 0], kv_cache[li, 1], k, v, slot_mapping)

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
        S, B = block_ids.shape
        nq, D = spec.num_heads, self.head_dim
        positions = ctx_lens[:, None] + torch.arange(B, device=block_ids.device)[None]
        x = F.embedding(block_ids, self.embed)
        if spec.input_embedding_scale != 1.0:
            x = x * spec.input_embedding_scale
        rope = self.rotary.lookup(positions, x.dtype)
        for li, layer in enumerate(self.layers):
            residual = x
            h = rms_norm(x, layer.input_norm, spec.rms_norm_eps)
            q = F.linear(h, layer.q_proj, layer.q_bias).unflatten(-1, (nq, D))
            q = apply_rope(rms_norm(q, layer.q_norm, spec.rms_norm_eps), rope)
            k, v = self._kv(layer, h, rope)
            o = ops.dflash_block_attention(
                q,
                k,
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
            x = residual + F.linear(o.flatten(-2), layer.o_proj, layer.o_bias)
            residual = x
            h = rms_norm(x, layer.post_norm, spec.rms_norm_eps)
            gate, up = F.linear(h, layer.gate_up).chunk(2, dim=-1)
            x = residual + F.linear(F.silu(gate) * up, layer.down)
        return rms_norm(x, self.final_norm, spec.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.lm_head).float()
        if self.spec.output_multiplier != 1.0:
            logits = logits * self.spec.output_multiplier
        cap = self.spec.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits
