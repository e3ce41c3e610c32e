"""Random small checkpoints for tests: HF targets (Qwen3 / Llama) and DFlash
drafters in the authors' format, saved as safetensors directories."""

from __future__ import annotations

import json
import random
import socket
from pathlib import Path

import torch

def free_port() -> int:
    """A free loopback port for a server a test starts. Not bind(0)'s: Ray's
    own processes take ports from the kernel's ephemeral range as they start
    (and its workers 10002-19999), so one chosen there could be taken
    between choosing it and serving on it (a Serve proxy then failed to bind
    its gRPC port)."""
    for _ in range(500):
        port = random.randrange(20000, 32000)
        if port in _PORTS_GIVEN:  # several chosen before any is bound
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _PORTS_GIVEN.add(port)
        return port
    raise RuntimeError("no free port in 20000-32000")


_PORTS_GIVEN: set[int] = set()


TINY = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    eos_token_id=1,
    bos_token_id=0,
)


def _perturb_norms(model) -> None:
    """Norm weights away from 1, so that a misplaced norm shows in parity."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))


def make_target(path: Path, arch: str = "qwen3", seed: int = 0, init_std: float = 0.1, **overrides):
    """Save a random HF causal LM under ``path``; return the HF model (fp32,
    eval). A larger init than HF's default keeps argmax margins wide so that
    greedy comparisons are not decided by rounding."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    cfg = {**TINY, **overrides}
    torch.manual_seed(seed)
    if arch == "qwen3":
        config, cls = Qwen3Config(**cfg), Qwen3ForCausalLM
    else:
        config, cls = LlamaConfig(**cfg), LlamaForCausalLM
    config.initializer_range = init_std
    model = cls(config).float().eval()
    _perturb_norms(model)
    model.save_pretrained(str(path), safe_serialization=True)
    return model


def make_drafter(
    path: Path,
    target_config,
    seed: int = 1,
    num_layers: int = 2,
    block_size: int = 8,
    target_layer_ids=(1, 2),
    layer_types=None,
    sliding_window=None,
    mask_token_id: int | None = None,
    init_std: float = 0.1,
):
    """Save a random DFlash drafter for ``target_config``; return the
    reference ``dflash.model.DFlashDraftModel`` (fp32, eval)."""
    from dflash.model import DFlashDraftModel
    from transformers import Qwen3Config

    tc = target_config
    config = Qwen3Config(
        vocab_size=tc.vocab_size,
        hidden_size=tc.hidden_size,
        intermediate_size=tc.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads,
        head_dim=getattr(tc, "head_dim", tc.hidden_size // tc.num_attention_heads),
        max_position_embeddings=tc.max_position_embeddings,
        rms_norm_eps=tc.rms_norm_eps,
        layer_types=list(layer_types) if layer_types else ["full_attention"] * num_layers,
        sliding_window=sliding_window,
        use_sliding_window=bool(sliding_window),
    )
    config.architectures = ["DFlashDraftModel"]
    config.block_size = block_size
    config.num_target_layers = tc.num_hidden_layers
    mask = tc.vocab_size - 1 if mask_token_id is None else mask_token_id
    config.dflash_config = {"mask_token_id": mask, "target_layer_ids": list(target_layer_ids)}
    config.initializer_range = init_std
    torch.manual_seed(seed)
    model = DFlashDraftModel(config).float().eval()
    _perturb_norms(model)
    model.save_pretrained(str(path), safe_serialization=True)
    # The authors' checkpoints carry these at the top level too.
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["DFlashDraftModel"]
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return model


def make_models(root: Path, seed: int = 2, drafter_seed: int = 12, block_size: int = 8, **target_overrides) -> Path:
    """A tiny target with a tokenizer at ``root / "t"`` and a drafter for it
    at ``root / "d"``; returns ``root``."""
    hf = make_target(root / "t", seed=seed, **target_overrides)
    add_tokenizer(root / "t", hf.config.vocab_size)
    make_drafter(root / "d", hf.config, seed=drafter_seed, block_size=block_size)
    return root


def add_tokenizer(path: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer of exactly ``vocab_size`` ids, trained on a
    few sentences, with a chat template; ids 0/1 are <s>/</s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = ["The capital of France is Paris.", "Hello world, this is a test of the tokenizer.",
            "Speculative decoding drafts a block of tokens and verifies them at once."] * 20
    tok.train_from_iterator(text, trainer)
    assert tok.get_vocab_size() <= vocab_size
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant: {% endif %}"
    )
    fast.save_pretrained(str(path))


def small_engine(root: Path, drafter: bool, async_: bool = False):
    """An in-process EngineCore on ``make_models``' pair under ``root`` (the
    padded, graph-shaped path; ``async_``: async steps, synchronous on the CPU)."""
    from specray.config import EngineConfig
    from specray.llm import build_engine

    return build_engine(EngineConfig(
        target=str(root / "t"), drafter=str(root / "d") if drafter else None, kv_block_size=4, num_kv_blocks=300,
        max_model_len=96, max_num_seqs=8, cuda_graphs=True, async_scheduling=async_,
    ))


def run_engine_to_end(eng, prompts, params, on_output=None, max_steps: int = 500) -> list:
    """Add every prompt, step until all finish; the final outputs in prompt
    order. ``on_output`` sees every output of every step."""
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(p, sp, request_id=str(i))
    outs = {}
    for _ in range(max_steps):
        for o in eng.step():
            if on_output is not None:
                on_output(o)
            if o.finished:
                outs[o.request_id] = o
        if not eng.has_unfinished():
            return [outs[str(i)] for i in range(len(prompts))]
    raise AssertionError("did not finish")
