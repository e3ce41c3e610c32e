"""The target model: Qwen3 / Llama dense decoder, tensor-parallel, on a
paged KV cache, with hidden-state taps for the drafter.

Qwen3 differs from Llama only in the per-head RMSNorm of q and k before
RoPE (and Llama's optional llama3 RoPE scaling and biases), so one forward
serves both.

Tensor parallelism (Megatron style): q/k/v and gate/up are split by output
(heads / intermediate units), o_proj and down_proj by input, each followed by
an all-reduce. The embedding and lm_head are replicated; only the rank that
samples (rank 0) computes logits and taps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specray.actors.models.layers import AttentionMetadata, Rotary, TPContext
from specray.actors.weights import Checkpoint, CheckpointError
from specray.config import TargetSpec
from specray.kernels import ops


@dataclass
class TargetLayer:
    input_norm: torch.Tensor  # [H]
    qkv: torch.Tensor  # [(q_heads + 2 kv_heads) * D, H], local heads
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # [D] (Qwen3)
    k_norm: torch.Tensor | None
    o_proj: torch.Tensor  # [H, q_heads * D]
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor  # [H]
    gate_up: torch.Tensor  # [2 * I_local, H]
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor  # [H, I_local]
    down_bias: torch.Tensor | None
    window: int | None


class TargetModel:
    """Weights of one TP rank, and the forward pass over them."""

    def __init__(self, spec: TargetSpec, tp: TPContext, dtype: torch.dtype, device, max_positions: int):
        self.spec = spec
        self.tp = tp
        self.dtype = dtype
        self.device = torch.device(device)
        spec.check_tensor_parallel(tp.size)
        self.num_q_heads = spec.num_heads // tp.size
        if spec.num_kv_heads % tp.size == 0:
            self.num_kv_heads = spec.num_kv_heads // tp.size
            self.kv_head_start = tp.rank * self.num_kv_heads
        else:
            # More ranks than KV heads: each rank keeps the one KV head its
            # query heads read.
            self.num_kv_heads = 1
            self.kv_head_start = tp.rank * spec.num_kv_heads // tp.size
        self.head_dim = spec.head_dim
        self.scale = spec.head_dim**-0.5
        self.rotary = Rotary(spec.rope, spec.head_dim, max_positions, self.device)
        self.layers: list[TargetLayer] = []
        self.embed: torch.Tensor | None = None
        self.final_norm: torch.Tensor | None = None
        self.lm_head: torch.Tensor | None = None

    # ------------------------------------------------------------------ load
    def load(self, ckpt: Checkpoint) -> None:
        spec, tp = self.spec, self.tp
        H, D, I = spec.hidden_size, spec.head_dim, spec.intermediate_size
        q0, q1 = tp.split(spec.num_heads, "num_attention_heads")
        kv0, kv1 = self.kv_head_start, self.kv_head_start + self.num_kv_heads
        i0, i1 = tp.split(I, "intermediate_size")

        def get(name, shape, dim=None, shard=None):
            t = ckpt.get(name, shape, dim, (shard[0], shard[1]) if shard else None)
            return t.to(device=self.device, dtype=self.dtype)

        def maybe(name, shape, dim=None, shard=None):
            return get(name, shape, dim, shard) if name in ckpt else None

        self.embed = get("model.embed_tokens.weight", (spec.vocab_size, H))
        self.final_norm = get("model.norm.weight", (H,))
        if spec.tie_word_embeddings:
            self.lm_head = self.embed
        elif "lm_head.weight" in ckpt:
            self.lm_head = get("lm_head.weight", (spec.vocab_size, H))
        else:
            raise CheckpointError(
                f"checkpoint {spec.path!r} has no lm_head.weight and tie_word_embeddings is false"
            )
        self.layers = []
        for li in range(spec.num_layers):
            p = f"model.layers.{li}."
            a = p + "self_attn."
            q = get(a + "q_proj.weight", (spec.num_heads * D, H), 0, (q0 * D, q1 * D))
            k = get(a + "k_proj.weight", (spec.num_kv_heads * D, H), 0, (kv0 * D, kv1 * D))
            v = get(a + "v_proj.weight", (spec.num_kv_heads * D, H), 0, (kv0 * D, kv1 * D))
            qkv_bias = None
            if spec.attention_bias:
                qkv_bias = torch.cat(
                    [
                        get(a + "q_proj.bias", (spec.num_heads * D,), 0, (q0 * D, q1 * D)),
                        get(a + "k_proj.bias", (spec.num_kv_heads * D,), 0, (kv0 * D, kv1 * D)),
                        get(a + "v_proj.bias", (spec.num_kv_heads * D,), 0, (kv0 * D, kv1 * D)),
                    ]
                )
            gate = get(p + "mlp.gate_proj.weight", (I, H), 0, (i0, i1))
            up = get(p + "mlp.up_proj.weight", (I, H), 0, (i0, i1))
            gate_up_bias = None
            if spec.mlp_bias:
                gate_up_bias = torch.cat(
                    [get(p + "mlp.gate_proj.bias", (I,), 0, (i0, i1)), get(p + "mlp.up_proj.bias", (I,), 0, (i0, i1))]
                )
            self.layers.append(
                TargetLayer(
                    input_norm=get(p + "input_layernorm.weight", (H,)),
                    qkv=torch.cat([q, k, v]),
                    qkv_bias=qkv_bias,
                    q_norm=get(a + "q_norm.weight", (D,)) if spec.qk_norm else None,
                    k_norm=get(a + "k_norm.weight", (D,)) if spec.qk_norm else None,
                    o_proj=get(a + "o_proj.weight", (H, spec.num_heads * D), 1, (q0 * D, q1 * D)),
                    o_bias=maybe(a + "o_proj.bias", (H,)) if spec.attention_bias else None,
                    post_norm=get(p + "post_attention_layernorm.weight", (H,)),
                    gate_up=torch.cat([gate, up]),
                    gate_up_bias=gate_up_bias,
                    down=get(p + "mlp.down_proj.weight", (H, I), 1, (i0, i1)),
                    down_bias=maybe(p + "mlp.down_proj.bias", (H,)) if spec.mlp_bias else None,
                    window=spec.layer_window[li] if spec.layer_window else None,
                )
            )

    # --------------------------------------------------------------- forward
    def forward(
        self,
        input_ids: torch.Tensor,
        attn: AttentionMetadata,
        kv_cache: torch.Tensor,
        logits_indices: torch.Tensor | slice | None = None,
        tap_layer_ids: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Run ``input_ids`` ``[num_tokens]`` through the model, writing their
        K/V into ``kv_cache`` ``[L, 2, blocks, block_size, kv_heads, D]``.

        Returns ``logits`` ``[len(logits_indices), vocab]`` (every row's
        for ``slice(None)``, which gathers nothing; model dtype: sampling
        casts, an argmax needs no cast) and
        ``hidden_tapped`` ``[num_tokens, len(tap_layer_ids) * H]``: the output
        of each listed decoder layer, concatenated in the order listed (the
        last layer's output is taken after the final norm, as HF's
        ``hidden_states[-1]`` is)."""
        D = self.head_dim
        nq, nkv = self.num_q_heads, self.num_kv_heads
        eps = self.spec.rms_norm_eps
        h = self.embed[input_ids]  # not F.embedding: its index_select walks the ids serially on a GPU
        rope = self.rotary.lookup(attn.positions, h.dtype)
        tree = ops.tree_rows(attn.tree_mask)
        taps: dict[int, torch.Tensor] = {}
        last = len(self.layers) - 1
        # ``h`` is the last sublayer's output and ``residual`` the stream
        # before it: each norm adds the two first (one kernel on the GPU),
        # so the stream after layer ``li`` appears at layer ``li + 1``'s norm.
        residual = None
        for li, layer in enumerate(self.layers):
            qkv, residual = ops.norm_linear(h, layer.input_norm, eps, residual, layer.qkv, layer.qkv_bias)
            if li - 1 in tap_layer_ids:
                taps[li - 1] = residual
            q, _ = ops.qkv_rope(qkv[:, : nq * D], qkv[:, nq * D :], nq, nkv, D, rope, layer.q_norm, layer.k_norm,
                                eps, kv_cache[li, 0], kv_cache[li, 1], attn.slot_mapping)
            o = ops.paged_attention(
                q,
                kv_cache[li, 0],
                kv_cache[li, 1],
                attn.query_start_loc,
                attn.seq_lens,
                attn.block_tables,
                attn.max_query_len,
                attn.max_seq_len,
                self.scale,
                layer.window,
                attn.tree_mask,
                tree,
            )
            h = self.tp.all_reduce(ops.linear(o.reshape(-1, nq * D), layer.o_proj))
            if layer.o_bias is not None:
                h = h + layer.o_bias
            gate_up, residual = ops.norm_linear(h, layer.post_norm, eps, residual, layer.gate_up,
                                                layer.gate_up_bias)
            h = self.tp.all_reduce(ops.silu_mul_linear(gate_up, layer.down))
            if layer.down_bias is not None:
                h = h + layer.down_bias

        if logits_indices is None and not tap_layer_ids:
            return None, None
        h, _ = ops.rms_norm(h, self.final_norm, eps, residual)
        if last in tap_layer_ids:
            taps[last] = h
        hidden_tapped = torch.cat([taps[i] for i in tap_layer_ids], dim=-1) if tap_layer_ids else None
        logits = None
        if logits_indices is not None:
            logits = F.linear(h[logits_indices], self.lm_head)
        return logits, hidden_tapped
