#!/usr/bin/env python
"""Train a DFlash drafter (arXiv 2602.06036) for a small HF target by
self-distillation, on one GPU, in a few minutes.

    python examples/train_drafter.py --target ~/.cache/specray/smollm2-135m-instruct \
        --out runs/drafter --device cuda --gen-only
    python examples/train_drafter.py --target ~/.cache/specray/smollm2-135m-instruct \
        --out runs/drafter --device cuda

The defaults are the first stage of the shipped drafter's recipe: 4
layers, 14 M tokens, a 750 s budget for features + training on the cached
data (~165 s of data generation before it, in its own run). It was then
continued five times with ``--init-from`` and ``--warmup-steps 50``: twice
on the same data (``--lr 3e-4`` for 760 s, ``--lr 2e-4`` for 380 s), then
three times on fresh data weighted toward the hand-written prompts
(``--magpie 20000 --sampled-answers 12`` with ``--seed`` 0, 1, 2; ``--lr``
3e-4, 2e-4, 3e-4; ~450, 320, 470 s of training; the last one after the
hand-written prompts doubled). Each stage's training.json lists every
argument (the last stage's beside the checkpoint, the others in
``earlier_stages/``).

Stage 1 (data): with ``--magpie N`` the target first writes N user messages
itself (sampled from the chat template cut where a user turn starts, after a
system prompt from --magpie-systems that steers the topic); then it answers
those and the files' prompts (greedy unless --temperature > 0), and the
--sampled-prompts again --sampled-answers times at --sampled-temperature, all
on specray's static-batch, CUDA-graphed generator (examples/selfdistill.py).
The token sequences are cached in OUT/data.pt, so a rerun skips this stage.

Stage 2 (train): the frozen target runs once over every sequence and the
tapped hidden states are kept on the device (bf16, ~5.8 KB a token for five
taps of 576). Each step takes a batch of sequences and many anchors per
sequence; anchor ``a`` (a response position) gives the block
``[tok_a, MASK x (B-1)]`` at positions ``a .. a+B-1`` that sees the context
features of positions ``< a`` and its own rows (non-causal), exactly what
inference sees after ``a`` tokens are accepted. All blocks of a sequence go
through the drafter in one forward with one dense boolean mask over
[context ; all blocks]. Loss: cross-entropy of rows 1..B-1 through the
target's lm_head, weighted by exp(-(k-1)/gamma).

Why not SpecForge or vLLM's speculators (both train DFlash drafters): they
take their hidden states from a running SGLang / vLLM server (or from data
that server wrote), their data recipes read hub datasets, and their
checkpoints need converting to the authors' layout. The GPU machine here has
neither server nor network, and what one call can carry is ~64 MB. This
script needs only torch + transformers, generates its data with specray's
own engine code (so it is exactly what specray's greedy decoding emits),
and writes the authors' format, tested against their forward
(tests/test_train_drafter.py).

OUT/ ends up a drafter in the DFlash authors' format (config.json +
model.safetensors in bf16, no embedding / lm_head) that
``specray.config.DrafterSpec`` and ``dflash.model.DFlashDraftModel`` load,
plus train_log.jsonl and training.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import torch
from torch import nn
import torch.nn.functional as F

# --------------------------------------------------------------------------
# logging
# --------------------------------------------------------------------------

T0 = time.time()
PROMPTS = Path(__file__).resolve().parents[1] / "data" / "prompts"


def log(msg: str) -> None:
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


# --------------------------------------------------------------------------
# stage 1: self-distillation data
# --------------------------------------------------------------------------


def load_prompts(paths: str | list[str], limit: int) -> list[list[dict]]:
    out = []
    for path in [paths] if isinstance(paths, str) else paths:
        with open(path) as f:
            for line in f:
                if line.strip():
                    out.append(json.loads(line)["messages"])
                    if limit and len(out) >= limit:
                        return out
    return out


def chat_ids(tok, messages) -> list[int]:
    # Template as text, then encode without extra specials: the template
    # already carries them, and this avoids apply_chat_template's
    # return-type differences between transformers versions.
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


def eos_token_ids(target, tok) -> list[int]:
    ids = target.generation_config.eos_token_id
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tok.eos_token_id is not None and tok.eos_token_id not in ids:
        ids.append(tok.eos_token_id)
    return ids


def magpie_prefix(tok, system: str | None = None) -> list[int]:
    """The chat template up to where the user's message would start, after
    ``system`` (which steers what the user asks) or the template's default."""
    marker = "\u2047MARKER\u2047"
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": marker}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    return tok(text[: text.index(marker)], add_special_tokens=False)["input_ids"]


def magpie_prefixes(tok, n: int, systems_file: str, seed: int) -> list[list[int]]:
    """``n`` prefixes; with a file of system prompts (one a line) each takes
    one at random, so the self-written messages spread over its topics. The
    answers are generated without it (the template's default), as users
    would send them."""
    if not systems_file:
        return [magpie_prefix(tok)] * n
    systems = [line.strip() for line in Path(systems_file).read_text().splitlines() if line.strip()]
    if not systems:
        raise SystemExit(f"{systems_file}: no system prompts")
    options = [magpie_prefix(tok, sp) for sp in systems]
    rng = random.Random(seed)
    return [rng.choice(options) for _ in range(n)]


def eval_index(paths: list[str]):
    """The committed prompt sets' near-duplicate rule (normalized equality or
    word-trigram Jaccard >= 0.5, data/prompts/make_train_prompts.py) over
    the prompts in ``paths``; None without any."""
    if not paths:
        return None
    import importlib.util

    script = Path(__file__).resolve().parents[1] / "data" / "prompts" / "make_train_prompts.py"
    spec = importlib.util.spec_from_file_location("make_train_prompts", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.EvalIndex([text for path in paths for text in mod.load_eval(Path(path))])


def generate_data(args, tok, eos: list[int], device) -> dict:
    """Prompts (the file's, plus ``--magpie`` user messages the target writes
    itself) answered by the target, on specray's bulk generator."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from selfdistill import BulkGenerator

    t_start = time.time()
    file_prompts = [chat_ids(tok, m) for m in load_prompts(args.prompts, args.num_prompts)]
    prefixes = magpie_prefixes(tok, args.magpie, args.magpie_systems, args.seed) if args.magpie else []
    longest_prefix = max(map(len, prefixes), default=0)
    max_prompt = max([len(p) for p in file_prompts] + [longest_prefix + args.magpie_max_tokens + 16])
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    gen = BulkGenerator(str(args.target), max_prompt_len=max_prompt,
                        max_new_tokens=max(args.max_new_tokens, args.magpie_max_tokens),
                        batch_size=args.gen_batch_size, device=str(device), dtype=dtype)
    budget = args.gen_time_budget_s
    magpie = []
    if args.magpie:
        t = time.time()
        gen.max_new = args.magpie_max_tokens
        raw = gen.generate_all(prefixes, temperature=args.magpie_temperature, top_p=args.magpie_top_p,
                               stop_ids=eos, seed=args.seed, time_budget_s=budget * args.magpie_budget_frac, log=log)
        held_out = eval_index(args.exclude_prompts)
        seen, near_eval, texts = set(), 0, []
        for ids in raw:  # a complete, non-trivial, new message, not near an eval prompt
            if len(ids) < 4 or ids[-1] not in eos:
                continue
            text = tok.decode(ids[:-1], skip_special_tokens=True).strip()
            if len(text) < 8 or text in seen:
                continue
            seen.add(text)
            if held_out is not None and held_out.near(text):
                near_eval += 1
                continue
            texts.append(text)
            magpie.append(chat_ids(tok, [{"role": "user", "content": text}]))
        with open(Path(args.out) / "magpie_prompts.jsonl", "w") as f:
            f.writelines(json.dumps({"messages": [{"role": "user", "content": t}]}) + "\n" for t in texts)
        log(f"magpie: {len(magpie)} usable user messages of {len(raw)} sampled in {time.time() - t:.1f}s "
            f"({near_eval} dropped as near-duplicates of {', '.join(args.exclude_prompts) or 'no held-out set'})")
    prompts = [p for p in file_prompts + magpie if len(p) <= max_prompt]
    random.Random(args.seed).shuffle(prompts)
    gen.max_new = args.max_new_tokens
    spent = time.time() - t_start
    answers = gen.generate_all(prompts, temperature=args.temperature, top_p=args.top_p, stop_ids=eos,
                               seed=args.seed + 1, time_budget_s=max(budget - spent, 1.0), log=log)
    if args.sampled_answers and args.sampled_prompts:
        # More answers to the prompts nearest real use, sampled: the drafter
        # also sees the target continue from contexts off its greedy path.
        extra = [chat_ids(tok, m) for m in load_prompts(args.sampled_prompts, 0)] * args.sampled_answers
        extra = [p for p in extra if len(p) <= max_prompt]
        spent = time.time() - t_start
        extra_answers = gen.generate_all(extra, temperature=args.sampled_temperature, top_p=args.sampled_top_p,
                                         stop_ids=eos, seed=args.seed + 2, time_budget_s=max(budget - spent, 1.0),
                                         log=log)
        pairs = list(zip(prompts + extra, answers + extra_answers))
        random.Random(args.seed + 3).shuffle(pairs)  # --max-train-tokens takes a prefix: mix the two kinds
        prompts, answers = [p for p, _ in pairs], [a for _, a in pairs]
        log(f"sampled: {len(extra_answers)} answers at T={args.sampled_temperature} to "
            f"{len(extra) // args.sampled_answers} prompts")
    del gen
    if device.type == "cuda":
        torch.cuda.empty_cache()
    seqs, prompt_lens, n_gen, n_eos = [], [], 0, 0
    for p, a in zip(prompts, answers):
        seqs.append(torch.tensor(p + a, dtype=torch.int32))
        prompt_lens.append(len(p))
        n_gen += len(a)
        n_eos += bool(a) and a[-1] in eos
    gen_s = time.time() - t_start
    meta = dict(
        prompts_file=args.prompts, target=str(args.target), file_prompts=len(file_prompts),
        sampled_prompts=args.sampled_prompts, sampled_answers=args.sampled_answers,
        sampled_temperature=args.sampled_temperature, sampled_top_p=args.sampled_top_p,
        magpie_sampled=args.magpie, magpie_kept=len(magpie), magpie_temperature=args.magpie_temperature,
        magpie_top_p=args.magpie_top_p, magpie_systems=args.magpie_systems,
        magpie_excluded_near=args.exclude_prompts, num_prompts=len(seqs), max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_p=args.top_p, gen_batch_size=args.gen_batch_size,
        gen_seconds=round(gen_s, 2), generated_tokens=n_gen, gen_tokens_per_s=round(n_gen / max(gen_s, 1e-9), 1),
        frac_with_eos=round(n_eos / max(len(seqs), 1), 4), generator="specray BulkGenerator (examples/selfdistill.py)",
    )
    log(f"gen: {len(seqs)} responses, {n_gen} tokens in {gen_s:.1f}s ({meta['gen_tokens_per_s']:.0f} tok/s), "
        f"{100 * meta['frac_with_eos']:.0f}% ended with EOS")
    return dict(tokens=torch.cat(seqs) if seqs else torch.zeros(0, dtype=torch.int32),
                lengths=torch.tensor([len(s) for s in seqs], dtype=torch.long),
                prompt_lens=torch.tensor(prompt_lens, dtype=torch.long), meta=meta)


# --------------------------------------------------------------------------
# the drafter (parameter names = dflash.model.DFlashDraftModel's)
# --------------------------------------------------------------------------


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


def load_drafter(path: str, target_dir: str):
    """(config, state dict) of a checkpoint this script wrote, checked
    against the target with the rule serving applies (DrafterSpec.check_fits)."""
    from safetensors.torch import load_file
    from transformers import Qwen3Config

    from specray.config import ConfigError, DrafterSpec, TargetSpec

    try:
        DrafterSpec.from_dir(path).check_fits(TargetSpec.from_dir(target_dir))
    except ConfigError as e:
        raise SystemExit(f"--init-from: {e}") from None
    return Qwen3Config.from_pretrained(path), load_file(str(Path(path) / "model.safetensors"))


def save_checkpoint(drafter: Drafter, out: Path) -> int:
    """config.json (every Qwen3Config field, not just the diff: DrafterSpec
    reads them explicitly) + model.safetensors in bf16; atomic renames so an
    interrupted run leaves the previous checkpoint intact."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in drafter.state_dict().items()}
    save_file(sd, str(out / "model.safetensors.tmp"), metadata={"format": "pt"})
    os.chmod(out / "model.safetensors.tmp", 0o644)  # safetensors writes 0600; serving workers may be other users
    os.replace(out / "model.safetensors.tmp", out / "model.safetensors")
    drafter.config.to_json_file(str(out / "config.json.tmp"), use_diff=False)
    os.replace(out / "config.json.tmp", out / "config.json")
    return (out / "model.safetensors").stat().st_size


# --------------------------------------------------------------------------
# initialisation
# --------------------------------------------------------------------------


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


# --------------------------------------------------------------------------
# stage 2: features and training
# --------------------------------------------------------------------------


@torch.inference_mode()
def compute_features(target, tokens, lengths, offsets, taps, device, budget_tokens, soft_k: int = 0):
    """Tapped hidden states of every position of every sequence, flat
    [total_tokens, k*H], in the target's dtype, on ``device``; with
    ``soft_k``, also the target's top-``soft_k`` next-token log-probs and
    their ids at every position (``[total_tokens, soft_k]`` bf16 / int32),
    else None. Right padding needs no mask: causal attention never lets a
    real token see a pad."""
    H = target.config.hidden_size
    total = int(lengths.sum())
    feats = torch.empty(total, len(taps) * H, dtype=target.dtype, device=device)
    soft = None
    if soft_k:
        soft = (torch.empty(total, soft_k, dtype=torch.bfloat16, device=device),
                torch.empty(total, soft_k, dtype=torch.int32, device=device))
    order = torch.argsort(lengths, descending=True).tolist()
    lengths, offsets = lengths.tolist(), offsets.tolist()
    i = 0
    while i < len(order):
        width = lengths[order[i]]
        idx = order[i : i + max(1, budget_tokens // width)]
        ids = torch.zeros(len(idx), width, dtype=torch.long)
        for r, s in enumerate(idx):
            ids[r, : lengths[s]] = tokens[offsets[s] : offsets[s] + lengths[s]]
        hs = target.model(input_ids=ids.to(device), output_hidden_states=True, use_cache=False).hidden_states
        # Reference indexing: the output of decoder layer t is hidden_states[t + 1].
        f = torch.cat([hs[t + 1] for t in taps], -1)
        for r, s in enumerate(idx):
            feats[offsets[s] : offsets[s] + lengths[s]] = f[r, : lengths[s]]
            if soft is not None:  # hidden_states[-1] is after the final norm
                for a in range(0, lengths[s], 4096):
                    b = min(a + 4096, lengths[s])
                    logp = target.lm_head(hs[-1][r, a:b]).float().log_softmax(-1)
                    top, top_ids = logp.topk(soft_k, dim=-1)
                    soft[0][offsets[s] + a : offsets[s] + b] = top
                    soft[1][offsets[s] + a : offsets[s] + b] = top_ids
        i += len(idx)
    return feats, soft


def batch_order(train_idx: list[int], lengths: torch.Tensor, n: int, rng: random.Random):
    """Endless stream of batches: shuffled, then sorted by length inside
    windows of 8 batches so that padding stays small."""
    n = min(n, len(train_idx))
    while True:
        perm = train_idx[:]
        rng.shuffle(perm)
        out = []
        for c in range(0, len(perm), 8 * n):
            part = sorted(perm[c : c + 8 * n], key=lambda s: int(lengths[s]))
            out += [part[j : j + n] for j in range(0, len(part), n)]
        full = [b for b in out if len(b) == n]
        out = full or out
        rng.shuffle(out)
        yield from out


class Batcher:
    """Gathers a batch of sequences (tokens + features) on the device."""

    def __init__(self, tokens, feats, lengths, prompt_lens, offsets, device, pad_multiple=64, soft=None):
        self.dev = torch.device(device)
        self.tokens = tokens.to(self.dev, torch.long)
        self.feats = feats
        self.soft = soft
        self.lengths, self.prompt_lens, self.offsets = lengths, prompt_lens, offsets
        self.L = lengths.to(self.dev)
        self.P = prompt_lens.to(self.dev)
        self.O = offsets.to(self.dev)
        self.pad = pad_multiple

    def __call__(self, seq_ids: list[int]):
        T = max(int(self.lengths[s]) for s in seq_ids)
        T = -(-T // self.pad) * self.pad
        idx = torch.tensor(seq_ids)
        if self.dev.type == "cuda":
            idx = idx.pin_memory()
        idx = idx.to(self.dev, non_blocking=True)  # no host sync per step
        L, P = self.L[idx], self.P[idx]
        pos = torch.minimum(torch.arange(T, device=self.dev)[None], L[:, None] - 1) + self.O[idx][:, None]
        soft = (self.soft[0][pos], self.soft[1][pos]) if self.soft is not None else None
        return self.tokens[pos], self.feats[pos], L, P, soft


def sample_anchors(L, P, K, generator=None):
    """K anchors per sequence, uniform over response positions P .. L-2 (the
    last token has nothing after it to predict); with replacement, so short
    responses simply repeat anchors."""
    u = torch.rand(L.shape[0], K, device=L.device, generator=generator)
    return P[:, None] + (u * (L - 1 - P)[:, None]).long()


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


def train(args, drafter, embed, lm_head, batcher, train_idx, val_idx, mask_id, device, deadline, out):
    c = drafter.config
    B = c.block_size
    amp = torch.bfloat16 if device.type == "cuda" else None
    # w_k = exp(-(k-1)/gamma): early rows decide acceptance (a block is cut at
    # its first miss), so they get the most weight (DFlash: gamma=7 for B=16).
    decay = torch.exp(-torch.arange(B - 1, device=device, dtype=torch.float32) / args.gamma)
    decay_params = [p for n, p in drafter.named_parameters() if p.ndim == 2]
    other = [p for n, p in drafter.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay_params, "weight_decay": args.weight_decay}, {"params": other, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8, **({"fused": True} if device.type == "cuda" else {}))
    rng = random.Random(args.seed)
    stream = batch_order(train_idx, batcher.lengths, args.batch_seqs, rng)
    N = min(args.batch_seqs, len(train_idx))
    V = embed.shape[0]

    # Fixed validation batch and anchors, so the curve is comparable.
    val = None
    if val_idx:
        vids = val_idx[: args.batch_seqs]
        vt, vf, vL, vP, vsoft = batcher(vids)
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
    best = {}

    def keep_if_best(v, at_step):
        if not best or (v["tau"], -v["ce"]) > (best["val_tau_est"], -best["val_ce"]):
            save_checkpoint(drafter, out)
            best.update(step=at_step, val_tau_est=round(v["tau"], 4), val_ce=round(v["ce"], 4), val_acc=v["acc"])

    log_path = out / "train_log.jsonl"
    log_path.write_text("")
    acc_stats = None
    step, t_train = 0, time.time()
    t_log, steps_log, blocks_log, last_save = t_train, 0, 0, t_train
    history = []
    total_budget = max(deadline - t_train, 1e-6)
    while True:
        now = time.time()
        if now >= deadline or (args.max_steps and step >= args.max_steps):
            break
        progress = (now - t_train) / total_budget
        if args.max_steps:
            progress = max(progress, step / args.max_steps)
        warm = min(1.0, (step + 1) / args.warmup_steps)
        cos = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        lr = args.lr * warm * (args.min_lr_ratio + (1 - args.min_lr_ratio) * cos)
        for gp in opt.param_groups:
            gp["lr"] = lr

        toks, feats, L, P, soft = batcher(next(stream))
        anchors = sample_anchors(L, P, args.anchors)
        loss, stats = block_loss(drafter, embed, lm_head, toks, feats, L, anchors, mask_id, decay, amp, soft,
                                 args.soft_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), args.clip)
        opt.step()
        step += 1
        stats = torch.cat([stats, (loss.detach() * 1.0).view(1), gnorm.view(1)])
        acc_stats = stats if acc_stats is None else acc_stats + stats
        steps_log += 1
        blocks_log += toks.shape[0] * args.anchors

        if step % args.log_every == 0 or step == 1:
            rec = summarize(acc_stats[:-2], B, blocks_log)
            loss_avg, gn_avg = (acc_stats[-2:] / steps_log).tolist()
            dt = time.time() - t_log
            rec = {"step": step, "time_s": round(time.time() - T0, 1), "lr": lr, "loss": round(loss_avg, 4),
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
            log(f"step {step}: loss {rec['loss']:.3f} ce {rec['ce']:.3f} tau~{rec['tau_est']:.2f} "
                f"acc[1,2,4,8,15]={[rec['acc'][i] for i in (0, 1, 3, 7, B - 2) if i < B - 1]} "
                + (f"| val ce {rec['val_ce']:.3f} tau~{rec['val_tau_est']:.2f} " if val is not None else "")
                + f"| lr {lr:.2e} gn {gn_avg:.2f} {rec['steps_per_s']:.1f} it/s {rec['tflops']} TFLOP/s")
            acc_stats, steps_log, blocks_log, t_log = None, 0, 0, time.time()
        if val is None and args.save_every_s and time.time() - last_save > args.save_every_s:
            save_checkpoint(drafter, out)  # insurance against a hard kill
            last_save = time.time()
    train_s = time.time() - t_train
    if val is None:
        save_checkpoint(drafter, out)
    elif not history or history[-1]["step"] != step:
        keep_if_best(validate(), step)
    return dict(steps=step, train_seconds=round(train_s, 1), history=history, flops_per_step=flops, best=best)


# --------------------------------------------------------------------------
# optional: acceptance with specray itself
# --------------------------------------------------------------------------


def eval_acceptance(args, out: Path, tok) -> dict:
    from specray import LLM, SamplingParams

    prompts = [chat_ids(tok, m) for m in load_prompts(args.eval_prompts, args.eval_n)]
    llm = LLM(str(args.target), str(out), device=str(args.device))
    t = time.time()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.eval_max_tokens))
    steps = sum(len(o.metrics.acceptance_lengths) for o in outs)
    toks = sum(sum(o.metrics.acceptance_lengths) for o in outs)
    res = {"prompts": len(prompts), "mean_acceptance_length": round(toks / max(steps, 1), 3),
           "per_prompt": [round(o.metrics.mean_acceptance_length, 3) for o in outs],
           "seconds": round(time.time() - t, 1)}
    log(f"eval: specray acceptance length {res['mean_acceptance_length']} over {len(prompts)} prompts")
    return res


# --------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--target", required=True, help="HF directory of the target (safetensors)")
    a("--prompts", nargs="+", default=[str(PROMPTS / "train.jsonl"), str(PROMPTS / "curated.jsonl")],
      help="JSONL files of {'messages': [...]} chat prompts, answered greedily")
    a("--out", required=True, help="output directory (drafter checkpoint, data.pt, logs)")
    a("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a("--seed", type=int, default=0)
    a("--time-budget-s", type=float, default=750.0,
      help="wall budget from script start for generation + features + training (training stops "
           "--reserve-s before it)")
    a("--reserve-s", type=float, default=8.0, help="kept for the final save and summary")
    # stage 1
    a("--num-prompts", type=int, default=0, help="use the first N prompts (0 = all)")
    a("--max-new-tokens", type=int, default=256)
    a("--gen-batch-size", type=int, default=1024, help="sequences per static generation batch")
    a("--magpie", type=int, default=60000, help="user messages the target writes itself, added to the prompts")
    a("--magpie-max-tokens", type=int, default=128)
    a("--magpie-temperature", type=float, default=1.0)
    a("--magpie-top-p", type=float, default=1.0)
    a("--magpie-systems", default=str(PROMPTS / "magpie_systems.txt"),
      help="file of system prompts (one a line) that steer the self-written messages; '' = the template's default")
    a("--magpie-budget-frac", type=float, default=0.3, help="share of --gen-time-budget-s for writing prompts")
    a("--exclude-prompts", nargs="*", default=[str(PROMPTS / "eval.jsonl"), str(PROMPTS / "dev.jsonl")],
      help="drop self-written messages that near-duplicate the prompts of these files (none given = keep all)")
    a("--max-train-tokens", type=int, default=14_000_000,
      help="use sequences up to this many tokens in all (their features stay on the device); 0 = all")
    a("--gen-time-budget-s", type=float, default=270.0, help="no new generation batch after this")
    a("--temperature", type=float, default=0.0, help="0 = greedy self-distillation")
    a("--top-p", type=float, default=1.0)
    a("--sampled-prompts", nargs="*", default=[str(PROMPTS / "curated.jsonl")],
      help="JSONL prompt files that also get sampled answers")
    a("--sampled-answers", type=int, default=4, help="sampled answers per --sampled-prompts prompt")
    a("--sampled-temperature", type=float, default=0.8)
    a("--sampled-top-p", type=float, default=0.95)
    a("--regen", action="store_true", help="ignore a cached OUT/data.pt")
    a("--gen-only", action="store_true", help="stop after stage 1 (OUT/data.pt)")
    # model
    a("--draft-layers", type=int, default=None,
      help="default 4; with --init-from, more than the checkpoint's layers grows it (new layers added last)")
    a("--intermediate-size", type=int, default=0, help="0 = the target's")
    a("--target-layer-ids", default="", help="comma list; default: 5 taps spaced as build_target_layer_ids(L, 5)")
    a("--block-size", type=int, default=None, help="default 16")
    a("--mask-token-id", type=int, default=None)
    a("--init", choices=("target", "random"), default="target",
      help="how new layers start (with --init-from: only the layers growing adds)")
    a("--init-from", default="", help="continue training this drafter checkpoint (its config sets the architecture; "
      "the learning-rate schedule starts afresh); architecture flags given with it must agree with it")
    a("--max-ckpt-mb", type=float, default=32.0)
    # training
    a("--batch-seqs", type=int, default=96, help="sequences per step")
    a("--anchors", type=int, default=24, help="blocks per sequence per step")
    a("--lr", type=float, default=6e-4)
    a("--min-lr-ratio", type=float, default=0.1)
    a("--warmup-steps", type=int, default=200)
    a("--weight-decay", type=float, default=0.01)
    a("--clip", type=float, default=1.0)
    a("--soft-top-k", type=int, default=0,
      help="keep the target's top-k next-token log-probs and train on them too (0 = the data's tokens only)")
    a("--soft-weight", type=float, default=0.5, help="share of the soft-target loss when --soft-top-k > 0")
    a("--gamma", type=float, default=7.0, help="loss weight exp(-(k-1)/gamma) of block row k")
    a("--max-steps", type=int, default=0, help="0 = until the time budget")
    a("--log-every", type=int, default=100)
    a("--save-every-s", type=float, default=30.0, help="periodic save when there is no validation set")
    a("--val-frac", type=float, default=0.02)
    a("--max-seq-len", type=int, default=2048)
    a("--feat-batch-tokens", type=int, default=65536)
    # optional evaluation through specray
    a("--eval-prompts", default="")
    a("--eval-n", type=int, default=0)
    a("--eval-max-tokens", type=int, default=128)
    return p.parse_args(argv)


def main(argv=None):
    global T0
    T0 = time.time()
    args = parse_args(argv)
    deadline = T0 + args.time_budget_s - args.reserve_s
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
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
    ckpt = None
    if args.init_from:  # before stage 1: a checkpoint or flag that does not fit fails now, not after generation
        ckpt = load_drafter(args.init_from, args.target)
        depth = checkpoint_depth(args, ckpt[0])

    # ---- stage 1
    cache = out / "data.pt"
    if cache.is_file() and not args.regen:
        data = torch.load(cache)
        log(f"data: reusing {cache} ({len(data['lengths'])} sequences, generated with {data['meta']['max_new_tokens']} "
            f"new tokens, temperature {data['meta']['temperature']})")
    else:
        data = generate_data(args, tok, eos_token_ids(target, tok), device)
        torch.save(data, cache)
    if args.gen_only:
        return {"data": data["meta"]}
    lengths, prompt_lens = data["lengths"], data["prompt_lens"]
    offsets = torch.cumsum(lengths, 0) - lengths
    tokens = data["tokens"].long()
    keep, total = [], 0
    for i in range(len(lengths)):
        if lengths[i] - prompt_lens[i] >= 2 and lengths[i] <= args.max_seq_len:
            if args.max_train_tokens and total + int(lengths[i]) > args.max_train_tokens:
                break
            keep.append(i)
            total += int(lengths[i])
    if not keep:
        raise SystemExit("no usable training sequences (responses need >= 2 tokens)")
    data_stats = dict(sequences=len(lengths), used=len(keep), tokens_all=int(lengths.sum()))
    # Only the kept sequences go on: their features are what fills the device.
    tokens = torch.cat([tokens[offsets[i] : offsets[i] + lengths[i]] for i in keep]) if keep else tokens[:0]
    lengths, prompt_lens = lengths[keep], prompt_lens[keep]
    offsets = torch.cumsum(lengths, 0) - lengths
    keep = list(range(len(keep)))
    resp = (lengths - prompt_lens).float()
    data_stats.update(tokens=int(lengths.sum()),
                      response_tokens=int(resp.sum()), mean_prompt_len=round(float(prompt_lens.float().mean()), 1),
                      mean_response_len=round(float(resp.mean()), 1), max_len=int(lengths.max()), gen=data["meta"])
    log(f"data: {len(keep)} usable sequences, {data_stats['tokens']} tokens "
        f"(prompt ~{data_stats['mean_prompt_len']}, response ~{data_stats['mean_response_len']}, "
        f"max {data_stats['max_len']})")

    # ---- drafter
    calib = [tokens[offsets[i] : offsets[i] + lengths[i]] for i in keep[:8]]
    state = None
    if ckpt is not None:
        # Continue from a checkpoint: its config decides the architecture.
        config, state = ckpt
        taps, mask_id = config.dflash_config["target_layer_ids"], config.dflash_config["mask_token_id"]
        inter, args.draft_layers, args.block_size = config.intermediate_size, depth, config.block_size
        init_info = {"mode": "from", "dir": str(args.init_from)}
        if depth > config.num_hidden_layers:
            config, state, grow_info = grow_drafter(config, state, depth, target, taps, args.init, calib, device)
            init_info = {"mode": "grow", "dir": str(args.init_from), **grow_info}
    else:
        args.draft_layers = 4 if args.draft_layers is None else args.draft_layers
        args.block_size = 16 if args.block_size is None else args.block_size
        taps = parse_taps(args.target_layer_ids) or default_taps(tcfg.num_hidden_layers)
        mask_id = pick_mask_token(tok, tcfg.vocab_size, tokens, args.mask_token_id)
        inter = args.intermediate_size or tcfg.intermediate_size
        config = drafter_config(tcfg, args.draft_layers, inter, taps, args.block_size, mask_id)
    drafter = Drafter(config, max_positions=int(lengths.max()) + args.block_size + 64).to(device)
    n_params = sum(p.numel() for p in drafter.parameters())
    mb = 2 * n_params / 2**20
    log(f"drafter: {args.draft_layers} layers, intermediate {inter}, taps {taps}, block {args.block_size}, "
        f"mask {mask_id} ({tok.convert_ids_to_tokens(mask_id)!r}), {n_params / 1e6:.2f}M params = {mb:.1f} MiB bf16")
    if mb > args.max_ckpt_mb:
        raise SystemExit(f"drafter checkpoint would be {mb:.1f} MiB > --max-ckpt-mb {args.max_ckpt_mb}")
    if state is not None:
        drafter.load_state_dict({k: v.to(device, torch.float32) for k, v in state.items()})
    else:
        init_info = init_drafter(drafter, target, taps, args.init, calib, device)
    log(f"init: {init_info}")
    save_checkpoint(drafter, out)  # loadable from the start

    # ---- features (one target pass per sequence)
    t_f = time.time()
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

    n_val = int(len(keep) * args.val_frac) if len(keep) > 1 else 0
    n_val = max(n_val, 1) if len(keep) > 1 else 0
    val_idx, train_idx = keep[len(keep) - n_val :], keep[: len(keep) - n_val]
    batcher = Batcher(tokens, feats, lengths, prompt_lens, offsets, device, soft=soft)
    drafter.train()
    res = train(args, drafter, embed, lm_head, batcher, train_idx, val_idx, mask_id, device, deadline, out)
    size = (out / "model.safetensors").stat().st_size
    last = res["history"][-1] if res["history"] else {}
    summary = dict(
        data=data_stats, features_seconds=round(feat_s, 1), steps=res["steps"], train_seconds=res["train_seconds"],
        total_seconds=round(time.time() - T0, 1), final=last, kept=res["best"] or "last step", init=init_info,
        architecture=dict(layers=args.draft_layers, intermediate_size=inter, target_layer_ids=taps,
                          block_size=args.block_size, mask_token_id=mask_id, params=n_params, checkpoint_bytes=size),
        tflop_per_step=round(res["flops_per_step"] / 1e12, 3),
        peak_memory_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None,
        args=vars(args),
    )
    if args.eval_prompts and args.eval_n:
        del feats, batcher
        if device.type == "cuda":
            torch.cuda.empty_cache()
        summary["eval"] = eval_acceptance(args, out, tok)
    (out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    kept = f"best by validation at step {res['best']['step']}" if res["best"] else "last step"
    log(f"done: {res['steps']} steps, checkpoint ({kept}) {size / 2**20:.1f} MiB in {out}, "
        f"total {summary['total_seconds']}s")
    return summary


if __name__ == "__main__":
    main()
