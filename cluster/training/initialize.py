"""How a drafter starts: a fresh one from the target's last layers, or a
checkpoint grown by new layers that leave its function unchanged; and the
mask token it drafts with."""

from __future__ import annotations

import copy

import torch

from specray.training.model import Drafter, parse_taps


def pick_mask_token(tok, vocab_size: int, tokens: torch.Tensor, override: int | None) -> int:
    """An id that never occurs in real text: by default the highest-id added
    special token that is not bos/eos/pad/unk (SmolLM2: 16 '<empty_output>',
    a Jupyter marker from pre-training that chat text never produces; its
    embedding is shared by the other unused specials 7..16)."""
    if override is not None:
        mask = override
    else:
        used = {tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id}
        added = getattr(tok, "added_tokens_decoder", {}) or {}
        cands = [i for i, t in added.items() if getattr(t, "special", False) and i not in used and i < vocab_size]
        if cands:
            mask = max(cands)
        elif len(tok) < vocab_size:  # an embedding row that no tokenizer id maps to
            mask = vocab_size - 1
        else:
            raise SystemExit("the tokenizer has no unused special token: pass --mask-token-id")
    n = int((tokens == mask).sum())
    if n:
        raise SystemExit(f"mask token {mask} occurs {n} times in the training data; pick another with --mask-token-id")
    return mask


@torch.inference_mode()
def qk_scales(target, seqs: list[torch.Tensor], layers: list[int], device) -> dict[int, tuple[float, float]]:
    """Mean RMS of the target's per-head q and k (pre-RoPE) at ``layers``.
    A Llama target has no q/k norm; the drafter's RMSNorm would rescale
    every head to RMS 1 and so change the attention temperature by
    (rms_q * rms_k). Setting q_norm/k_norm to these means keeps the copied
    layer's attention logits at the target's scale."""
    stats = {(li, w): [] for li in layers for w in "qk"}
    hooks = []
    D = target.config.hidden_size // target.config.num_attention_heads
    D = getattr(target.config, "head_dim", None) or D
    for li in layers:
        att = target.model.layers[li].self_attn
        for w, mod in (("q", att.q_proj), ("k", att.k_proj)):
            def hook(_m, _i, out, key=(li, w)):
                stats[key].append(out.float().unflatten(-1, (-1, D)).pow(2).mean(-1).sqrt().mean().item())
            hooks.append(mod.register_forward_hook(hook))
    try:
        for s in seqs:  # one at a time: no padding rows in the statistics
            target.model(input_ids=s[None].long().to(device), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return {li: (sum(stats[li, "q"]) / len(seqs), sum(stats[li, "k"]) / len(seqs)) for li in layers}


@torch.no_grad()
def init_drafter(drafter: Drafter, target, taps, mode: str, calib_seqs, device) -> dict:
    """``target``: drafter layer i <- target layer L-n+i (the last n layers),
    because the drafter's output goes through the target's final norm and
    lm_head, which is what those layers feed; final norm <- the target's.
    fc starts as the identity on the tap nearest to the first copied
    layer's input (layer L-n-1) and zero on the other taps (their gradients
    do not depend on their values), and hidden_norm <- that layer's
    input_layernorm: at step 0 the first drafter layer reads the context
    through the same K/V projections the target layer applies to it (up to
    the per-head k_norm). q/k norms: copied (Qwen3) or the target's mean
    q/k RMS (Llama, see qk_scales). In a CPU A/B on SmolLM2 (13 training
    responses, 60 steps) this reached a held-out CE of 7.39 against 7.97
    for ``random`` (N(0, 0.02), norms 1: what SpecForge's DFlash trainer
    does), and got there in a third of the steps."""
    c = drafter.config
    for name, p in drafter.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02)
    if mode == "random":
        return {"mode": "random"}
    tl = target.model.layers
    n = len(drafter.layers)
    src = list(range(len(tl) - n, len(tl)))
    has_qk_norm = hasattr(tl[0].self_attn, "q_norm")
    scales = {} if has_qk_norm else qk_scales(target, calib_seqs, src, device)
    for d, s in zip(drafter.layers, src, strict=True):
        t = tl[s]
        for w in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(d.self_attn, w).weight.copy_(getattr(t.self_attn, w).weight)
        n_inter = c.intermediate_size
        if n_inter <= t.mlp.gate_proj.weight.shape[0]:
            # A narrower MLP keeps the target neurons with the largest
            # down-projection norms: a pruned copy of the layer, not noise.
            keep = t.mlp.down_proj.weight.norm(dim=0).topk(n_inter).indices.sort().values
            d.mlp.gate_proj.weight.copy_(t.mlp.gate_proj.weight[keep])
            d.mlp.up_proj.weight.copy_(t.mlp.up_proj.weight[keep])
            d.mlp.down_proj.weight.copy_(t.mlp.down_proj.weight[:, keep])
        d.input_layernorm.weight.copy_(t.input_layernorm.weight)
        d.post_attention_layernorm.weight.copy_(t.post_attention_layernorm.weight)
        if has_qk_norm:
            d.self_attn.q_norm.weight.copy_(t.self_attn.q_norm.weight)
            d.self_attn.k_norm.weight.copy_(t.self_attn.k_norm.weight)
        else:
            d.self_attn.q_norm.weight.fill_(scales[s][0])
            d.self_attn.k_norm.weight.fill_(scales[s][1])
    drafter.norm.weight.copy_(target.model.norm.weight)
    drafter.hidden_norm.weight.copy_(tl[src[0]].input_layernorm.weight)
    j = min(range(len(taps)), key=lambda i: abs(taps[i] - (src[0] - 1)))
    H = c.hidden_size
    drafter.fc.weight.zero_()
    drafter.fc.weight[:, j * H : (j + 1) * H] = torch.eye(H)
    return {"mode": "target", "source_layers": src, "fc_identity_tap": taps[j],
            "qk_scales": {str(k): [round(v[0], 4), round(v[1], 4)] for k, v in scales.items()}}


def checkpoint_depth(args, config) -> int:
    """The depth to train an --init-from checkpoint at: its own, or a larger
    explicit --draft-layers (growth). The checkpoint sets the rest of the
    architecture, so an explicit flag that disagrees with it is an error
    rather than silently ignored."""
    dc = config.dflash_config
    given = {"--intermediate-size": (args.intermediate_size or None, config.intermediate_size),
             "--target-layer-ids": (parse_taps(args.target_layer_ids), dc["target_layer_ids"]),
             "--block-size": (args.block_size, config.block_size),
             "--mask-token-id": (args.mask_token_id, dc["mask_token_id"])}
    for flag, (asked, have) in given.items():
        if asked is not None and asked != have:
            raise SystemExit(f"{flag} {asked} conflicts with the --init-from checkpoint's {have}")
    k = config.num_hidden_layers
    if args.draft_layers is not None and args.draft_layers < k:
        raise SystemExit(f"--draft-layers {args.draft_layers} is fewer than the {k} layers of the --init-from "
                         f"checkpoint (growing only adds layers)")
    n = k if args.draft_layers is None else args.draft_layers
    if n - k > getattr(config, "num_target_layers", n - k):
        raise SystemExit(f"growing by {n - k} layers needs as many target layers to copy; the target has "
                         f"{config.num_target_layers}")
    return n


@torch.no_grad()
def grow_drafter(config, state, n: int, target, taps, mode: str, calib_seqs, device):
    """(config, state dict, info) of an ``n``-layer drafter: the checkpoint's
    k layers and every other weight unchanged, then n - k new layers, set as
    ``init_drafter`` sets a fresh (n - k)-layer drafter: from the target's
    last n - k layers, the ones a fresh n-layer drafter puts at these last
    positions, since they feed the final norm and lm_head as these do."""
    k = config.num_hidden_layers
    grown = copy.deepcopy(config)
    grown.num_hidden_layers = grown.max_window_layers = n
    grown.layer_types = list(config.layer_types) + ["full_attention"] * (n - k)  # the only kind Drafter runs
    extra = copy.deepcopy(grown)
    extra.num_hidden_layers = n - k
    fresh = Drafter(extra, max_positions=1).to(device)
    info = init_drafter(fresh, target, taps, mode, calib_seqs, device)
    state = dict(state)
    for i, layer in enumerate(fresh.layers):
        # Zero residual branches: the grown drafter starts as exactly the
        # checkpoint's function, so training resumes from its quality, not
        # from what a copied target layer does to it.
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
        state.update({f"layers.{k + i}.{name}": v for name, v in layer.state_dict().items()})
    return grown, state, {"checkpoint_layers": k, "new_layers": list(range(k, n)), "new_layers_init": mode,
                          "source_layers": info.get("source_layers"), "qk_scales": info.get("qk_scales"),
                          "zeroed": ["self_attn.o_proj", "mlp.down_proj"]}

