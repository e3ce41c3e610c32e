"""Chat prompts for self-distillation: the committed prompt sets, the chat
template prefixes the target writes its own user messages from (Magpie), and
the held-out sets those messages must not near-duplicate."""

from __future__ import annotations

import json
from pathlib import Path
import random


def prompts_dir() -> Path:
    """The committed prompt sets: the checkout's ``data/prompts`` when
    specray runs from one (an editable install), else ``./data/prompts``."""
    checkout = Path(__file__).resolve().parents[2] / "data" / "prompts"
    return checkout if checkout.is_dir() else Path("data") / "prompts"


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

    script = prompts_dir() / "make_train_prompts.py"
    if not script.is_file():
        raise SystemExit(f"--exclude-prompts needs the near-duplicate rule of {script}: run from a checkout of specray")
    spec = importlib.util.spec_from_file_location("make_train_prompts", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.EvalIndex([text for path in paths for text in mod.load_eval(Path(path))])
