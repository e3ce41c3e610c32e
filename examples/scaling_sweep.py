"""Scaling sweep on the Ray backend: tensor-parallel size x drafter placement
x engine replicas x concurrency, speculative and autoregressive, one JSON
(and a PNG when matplotlib is installed).

    python examples/scaling_sweep.py --shape qwen3-8b --device cuda --tp 1 2 \\
        --placement separate colocated --replicas 1 2 --concurrency 1 4 16 64 --out sweep.json

``--shape`` writes random checkpoints of that shape once (bf16 safetensors,
straight from the shapes: an 8B target takes ~16 GB of disk and no GPU);
``--target/--drafter`` take real ones. Random weights time the system, not
the drafter: their acceptance length is ~1. A configuration that needs more
GPUs than the machine has is recorded as skipped. Concurrency is requests in
flight per replica; replicas are independent engines, each on its own GPUs,
fed from threads of this process.
"""

from __future__ import annotations

import argparse
import itertools
import json
import threading
import time
from pathlib import Path

import torch

SHAPES = {
    # name: target config fields, drafter layers
    "qwen3-8b": (dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128), 5),
    # Qwen3-32B's shape; its drafter's depth (5) is the 8B one's, assumed.
    "qwen3-32b": (dict(vocab_size=151936, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                       num_attention_heads=64, num_key_value_heads=8, head_dim=128), 5),
    "qwen3-0.6b": (dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                        num_attention_heads=16, num_key_value_heads=8, head_dim=128), 2),
    "tiny": (dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16), 2),
}


# The target's embeddings are drawn this large, against ~0.02-std layers:
# the residual stream stays mostly its token's embedding (36 random layers
# of the 8B shape add an RMS of ~16 to 64).
EMBED_SCALE = 64.0


def _device() -> str:
    # Normals for an 8B shape take minutes on the host.
    return "cuda" if torch.cuda.is_available() else "cpu"


def greedy_permutation_head(vocab: int, hidden: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Embeddings and an LM head under which the greedy next token of t is
    ``perm[t]`` with a wide margin: the head's row ``perm[t]`` is t's
    embedding (unit scale). With plain random weights the top two logits
    sit within bf16 rounding of each other, so a verify block and an
    autoregressive step (other kernels, other batch shapes) pick
    different tokens within a few steps; an oracle-acceptance run, whose
    drafts are the recorded autoregressive continuation, then accepts
    nothing. The compute of every layer is the same as with any weights."""
    g = torch.Generator(_device()).manual_seed(seed)
    embed = torch.randn(vocab, hidden, device=_device(), generator=g)
    perm = torch.randperm(vocab, device=_device(), generator=g)
    head = torch.empty_like(embed)
    head[perm] = embed
    return {"model.embed_tokens.weight": embed.mul_(EMBED_SCALE).bfloat16().cpu(), "lm_head.weight": head.bfloat16().cpu(),
            "perm": perm.cpu()}


def _write_random(out: Path, shapes: dict[str, tuple[int, ...]], shard_bytes: int = 4 << 30,
                  given: dict[str, torch.Tensor] | None = None) -> None:
    """Random bf16 weights (norms: ones; ``given`` tensors as they are) as
    safetensors shards + index."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    given = given or {}
    shards, cur, size = [], {}, 0
    for name, shape in shapes.items():
        if name in given:
            t = given[name]
        elif "norm" in name:
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = torch.randn(shape, device=_device()).mul_(0.02).bfloat16().cpu()
        cur[name] = t
        size += t.numel() * 2
        if size >= shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
    if cur:
        shards.append(cur)
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def random_checkpoints(root: Path, shape: str, block_size: int = 16) -> tuple[str, str]:
    """A random Qwen3 target of ``shape`` (its greedy continuation a fixed
    permutation of the vocabulary: ``greedy_permutation_head``;
    ``greedy_next.pt`` holds it) and a DFlash drafter for it (reused when
    already written)."""
    from transformers import Qwen3Config

    from specray.training.model import default_taps, drafter_config

    fields, draft_layers = SHAPES[shape]
    tdir, ddir = root / f"{shape}-target", root / f"{shape}-drafter"
    cfg = Qwen3Config(**fields, max_position_embeddings=4096, tie_word_embeddings=False, eos_token_id=None)
    H, D, I = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    nq, nkv, V = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size

    def layer(p):
        return {p + "self_attn.q_proj.weight": (nq * D, H), p + "self_attn.k_proj.weight": (nkv * D, H),
                p + "self_attn.v_proj.weight": (nkv * D, H), p + "self_attn.o_proj.weight": (H, nq * D),
                p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (D,),
                p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H), p + "mlp.down_proj.weight": (H, I),
                p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,)}

    L = cfg.num_hidden_layers
    taps = default_taps(L)
    # The marker: checkpoints written before the permutation head are redrawn.
    if not (tdir / "greedy_next.pt").is_file():
        shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}
        for i in range(L):
            shapes.update(layer(f"model.layers.{i}."))
        head = greedy_permutation_head(V, H)
        _write_random(tdir, shapes, given=head)
        cfg.to_json_file(str(tdir / "config.json"))
        torch.save(head["perm"], tdir / "greedy_next.pt")
    if not (ddir / "config.json").is_file():
        dcfg = drafter_config(cfg, draft_layers, I, taps, block_size, V - 1)
        shapes = {"fc.weight": (H, len(taps) * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
        for i in range(draft_layers):
            shapes.update(layer(f"layers.{i}."))
        _write_random(ddir, shapes)
        dcfg.to_json_file(str(ddir / "config.json"), use_diff=False)
    return str(tdir), str(ddir)


def gpus_needed(tp: int, placement: str, replicas: int) -> int:
    return replicas * (tp + (placement == "separate"))


def run_point(llms: list, concurrency: int, max_tokens: int, vocab: int) -> dict:
    """``concurrency`` requests per replica at once; all replicas together."""
    from specray import SamplingParams

    g = torch.Generator().manual_seed(concurrency)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    outs: list[list] = [[] for _ in llms]

    def work(i):
        prompts = [torch.randint(1, vocab - 1, (64,), generator=g).tolist() for _ in range(concurrency)]
        outs[i] = llms[i].generate(prompts, params)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(llms))]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    secs = time.perf_counter() - t
    flat = [o for group in outs for o in group]
    tokens = sum(len(o.token_ids) for o in flat)
    steps = [a for o in flat for a in o.metrics.acceptance_lengths]
    return {"tokens": tokens, "seconds": round(secs, 4), "tokens_per_s": round(tokens / secs, 2),
            "mean_acceptance_length": round(sum(steps) / len(steps), 3) if steps else None}


def sweep(args) -> dict:
    import ray

    from specray.placement import ensure_ray

    target, drafter = args.target, args.drafter
    if args.shape:
        target, drafter = random_checkpoints(Path(args.ckpt_dir), args.shape)
    vocab = json.loads((Path(target) / "config.json").read_text())["vocab_size"]
    have = torch.cuda.device_count() if args.device != "cpu" else None
    report = {"target": target, "drafter": drafter, "device": args.device, "max_tokens": args.max_tokens,
              "gpus_here": have, "points": []}

    def record(point: dict) -> None:  # each point is written as it comes: a killed sweep keeps what it measured
        report["points"].append(point)
        print(point, flush=True)
        Path(args.out).write_text(json.dumps(report, indent=2))

    started_ray = not ray.is_initialized()
    ensure_ray()
    try:
        sweep_points(args, target, drafter, vocab, have, record)
    finally:
        if started_ray:  # stop what we started
            ray.shutdown()
    return report


def sweep_points(args, target: str, drafter: str, vocab: int, have: int | None, record) -> None:
    from specray import LLM

    for tp, placement, replicas in itertools.product(args.tp, args.placement, args.replicas):
        need = gpus_needed(tp, placement, replicas)
        base = {"tp": tp, "placement": placement, "replicas": replicas, "gpus": need if have is not None else 0,
                "cuda_graphs": args.cuda_graphs and tp == 1,  # graphs exist for TP 1 only
                "remote_step_graphs": args.remote_step_graphs}
        if have is not None and need > have:
            record({**base, "skipped": f"needs {need} GPUs, {have} here"})
            continue
        for mode, d in (("spec", drafter), ("ar", None)):
            llms = [LLM(target, d, device=args.device, backend="ray", tensor_parallel_size=tp,
                        drafter_placement=placement, max_model_len=args.max_model_len,
                        max_num_seqs=max(args.concurrency), cuda_graphs=args.cuda_graphs,
                        remote_step_graphs=args.remote_step_graphs or None) for _ in range(replicas)]
            try:
                # An untimed pass at every concurrency (allocator, first steps):
                # graphs get captured and Triton compiles the kernel variants
                # each batch size needs.
                # Without it, first-use costs (compiles, most likely) landed in
                # the timed low-concurrency points of whichever configuration
                # ran first: seconds against a c=1 run of ~3 s.
                for c in args.concurrency:
                    run_point(llms, c, 16, vocab)
                for c in args.concurrency:
                    record({**base, "mode": mode, "concurrency": c, **run_point(llms, c, args.max_tokens, vocab)})
            finally:
                for llm in llms:
                    llm.shutdown()


def plot(report: dict, path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict[tuple, list] = {}
    for p in report["points"]:
        if "skipped" not in p:
            series.setdefault((p["tp"], p["placement"], p["replicas"], p["mode"]), []).append(p)
    for (tp, placement, replicas, mode), pts in sorted(series.items()):
        pts.sort(key=lambda p: p["concurrency"])
        ax.plot([p["concurrency"] for p in pts], [p["tokens_per_s"] for p in pts], marker="o",
                linestyle="-" if mode == "spec" else "--", label=f"TP{tp} {placement} x{replicas} {mode}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("requests in flight per replica")
    ax.set_ylabel("tokens/s (all replicas)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target")
    p.add_argument("--drafter")
    p.add_argument("--shape", choices=sorted(SHAPES), help="write and use random checkpoints of this shape")
    p.add_argument("--ckpt-dir", default="runs/random-checkpoints")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--placement", nargs="+", default=["separate", "colocated"], choices=["separate", "colocated"])
    p.add_argument("--replicas", type=int, nargs="+", default=[1])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--cuda-graphs", action="store_true", help="replay decode steps from CUDA graphs (TP 1)")
    p.add_argument("--remote-step-graphs", action="store_true",
                   help="with --cuda-graphs, a separate drafter on another GPU replays its half of async step "
                        "graphs (not yet run between GPUs, so opt-in there: EngineConfig.remote_step_graphs)")
    p.add_argument("--out", default="sweep.json")
    args = p.parse_args(argv)
    if not args.shape and not (args.target and args.drafter):
        p.error("give --shape, or --target and --drafter")
    report = sweep(args)
    png = str(Path(args.out).with_suffix(".png"))
    print(f"wrote {args.out}" + (f" and {png}" if plot(report, png) else " (no matplotlib: no plot)"))
    return report


if __name__ == "__main__":
    main()
