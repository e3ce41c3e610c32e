"""Tokenizer loading, incremental detokenization and stop strings."""

from __future__ import annotations

import json
import os
from pathlib import Path

from specray.request import Request

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def load_tokenizer(path: str | os.PathLike):
    """The checkpoint's HF tokenizer (offline), or None if it ships none:
    the engine then takes token-id prompts only."""
    if not any((Path(path) / f).is_file() for f in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """``messages`` through the chat template, as /v1/chat/completions and
    vLLM take them: the template writes its own special tokens, so the text
    is encoded without adding more (a second BOS, for tokenizers that add
    one)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def max_prompt_chars(tokenizer, max_tokens: int) -> float:
    """A length in characters beyond which a text surely takes more than
    ``max_tokens`` tokens, so that an absurdly long prompt is refused
    without tokenizing it; infinite where no such bound is sure.

    It holds for a BPE that spells every character with its own tokens
    (byte-level, or byte fallback): no token then covers more characters
    than its vocabulary entry has, except an added token that swallows the
    whitespace around it (lstrip / rstrip), which voids the bound. A margin
    of 8 covers normalisers that compose characters (NFC joins up to 4 into
    1)."""
    if tokenizer is None or not _spells_every_character(tokenizer):
        return float("inf")
    return 8 * max(map(len, tokenizer.get_vocab())) * max_tokens


def _spells_every_character(tokenizer) -> bool:
    try:
        spec = json.loads(tokenizer.backend_tokenizer.to_str())
    except Exception:  # a slow (Python) tokenizer: no spec to read
        return False
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return False
    if '"ByteLevel"' not in json.dumps(spec.get("pre_tokenizer")) and not model.get("byte_fallback"):
        return False
    return not any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens") or [])


def detokenize_step(tokenizer, req: Request) -> str:
    """Text added by the request's newest token(s). Decodes a short window
    twice (before / after) so that multi-token characters and leading spaces
    come out right; returns "" while a character is still incomplete."""
    if tokenizer is None:
        return ""
    ids = req.all_token_ids
    skip = req.params.skip_special_tokens
    prefix = tokenizer.decode(ids[req.detok_prefix_offset : req.detok_read_offset], skip_special_tokens=skip)
    full = tokenizer.decode(ids[req.detok_prefix_offset :], skip_special_tokens=skip)
    if len(full) > len(prefix) and not full.endswith("\ufffd"):
        req.detok_prefix_offset = req.detok_read_offset
        req.detok_read_offset = len(ids)
        return full[len(prefix) :]
    return ""


def init_detokenizer(req: Request) -> None:
    n = len(req.prompt_token_ids)
    req.detok_prefix_offset = max(n - 5, 0)
    req.detok_read_offset = n


def find_stop_string(req: Request, new_len: int) -> tuple[int, str] | None:
    """Earliest stop string that ends inside the last ``new_len`` characters
    of the request's text: ``(index where it starts, the string)``."""
    best = None
    for s in req.params.stop:
        start = max(0, len(req.text) - new_len - len(s) + 1)
        i = req.text.find(s, start)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best


def stop_holdback(req: Request) -> int:
    """Characters to hold back from a stream: a tail that could still turn
    into a stop string must not be sent before we know."""
    if req.finished or not req.params.stop:
        return 0
    return max(len(s) for s in req.params.stop) - 1
