"""Tokenizer loading, incremental detokenization and stop strings."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
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
    if not _spells_every_character(tokenizer):
        return float("inf")
    return 8 * max(map(len, tokenizer.get_vocab())) * max_tokens


def max_prompt_bytes(tokenizer, max_tokens: int) -> float:
    """A length in UTF-8 bytes beyond which a text surely takes more than
    ``max_tokens`` tokens: the longest token's bytes times ``max_tokens``.
    Checked before anything else (a 2 MB prompt took the tokenizer 4.5 s to
    refuse by its token count), and tighter than :func:`max_prompt_chars` for
    the same tokenizer (no margin where nothing normalises the text first;
    a byte-level vocabulary entry spells one byte per character).

    Sound under the same conditions as :func:`max_prompt_chars`: every token
    covers at most its own bytes of the normalised text, and no normaliser
    shrinks a text by more than the margin of 8 (NFKC maps a 4-byte
    mathematical letter to one ASCII byte)."""
    spec = _bounded_spec(tokenizer)
    if spec is None:
        return float("inf")
    byte_level = '"ByteLevel"' in json.dumps(spec.get("pre_tokenizer"))
    added = {t.get("content") for t in spec.get("added_tokens") or []}
    longest = 1
    for token in tokenizer.get_vocab():
        n = len(token) if byte_level and token not in added else len(token.encode("utf-8", "surrogatepass"))
        longest = max(longest, n)
    margin = 1 if spec.get("normalizer") is None else 8
    return margin * longest * max_tokens


def _spells_every_character(tokenizer) -> bool:
    return _bounded_spec(tokenizer) is not None


def _bounded_spec(tokenizer) -> dict | None:
    """The fast tokenizer's spec where a text's length bounds its token
    count from below, else None."""
    if tokenizer is None:
        return None
    try:
        spec = json.loads(tokenizer.backend_tokenizer.to_str())
    except Exception:  # a slow (Python) tokenizer: no spec to read
        return None
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return None
    if '"ByteLevel"' not in json.dumps(spec.get("pre_tokenizer")) and not model.get("byte_fallback"):
        return None
    if any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens") or []):
        return None
    if not _pre_tokenizer_keeps_text(spec.get("pre_tokenizer")):
        return None
    return spec if _normalizer_keeps_length(spec.get("normalizer")) else None


# Normalisers that never shrink a text by more than a small factor; others
# (Strip, BertNormalizer's control-character removal, a Replace that
# deletes) can turn megabytes into nothing.
_BOUNDED_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Prepend"}


# Pre-tokenizers that drop what they split on (whitespace, delimiters).
_DROPPING_PRE_TOKENIZERS = {"Whitespace", "WhitespaceSplit", "BertPreTokenizer", "CharDelimiterSplit"}


def _pre_tokenizer_keeps_text(pre: dict | None) -> bool:
    if pre is None:
        return True
    if pre.get("type") == "Sequence":
        return all(_pre_tokenizer_keeps_text(p) for p in pre.get("pretokenizers") or [])
    return pre.get("type") not in _DROPPING_PRE_TOKENIZERS and pre.get("behavior") != "Removed"


def _normalizer_keeps_length(norm: dict | None) -> bool:
    if norm is None:
        return True
    kind = norm.get("type")
    if kind == "Sequence":
        return all(_normalizer_keeps_length(n) for n in norm.get("normalizers") or [])
    if kind == "Replace":
        pattern = (norm.get("pattern") or {}).get("String")
        content = norm.get("content") or ""
        return pattern is not None and len(content.encode()) >= len(pattern.encode()) > 0
    return kind in _BOUNDED_NORMALIZERS


def text_decoder(tokenizer) -> Callable[[list[int], bool], str] | None:
    """``tokenizer.decode`` as a plain function of (ids, skip_special_tokens).

    A fast tokenizer's own decode where transformers' wrapper adds nothing
    to it: the wrapper's Python (argument conversion, the clean-up rule)
    cost ~4x the decode itself, paid twice a step for every row. The only
    text the wrapper changes is its clean-up of spaces before punctuation,
    which transformers applies or skips by tokenizer kind and version: a
    probe that clean-up would change decides, against the wrapper itself."""
    if tokenizer is None:
        return None

    def wrapped(ids: list[int], skip: bool) -> str:
        return tokenizer.decode(ids, skip_special_tokens=skip)

    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is None:
        return wrapped
    try:
        probe = tokenizer.encode(_CLEAN_UP_PROBE, add_special_tokens=False)
        same = all(backend.decode(probe, skip_special_tokens=skip) == wrapped(probe, skip) for skip in (False, True))
    except Exception:  # a tokenizer that cannot take the probe: keep its own decode
        return wrapped
    if not same:
        return wrapped
    return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)


# What transformers' clean_up_tokenization rewrites (a space before . ? ! ,
# and English contractions).
_CLEAN_UP_PROBE = "a . b ? c ! d , e ' f n't g 'm h 's i 've j 're k"


def decodes_in_runs(tokenizer) -> bool:
    """Whether several new tokens may be decoded at once: a byte-level
    decoder's text is its tokens' bytes, so the text a window adds does not
    depend on where earlier calls cut it (sentencepiece-style decoders
    strip a leading space at the start of a window: those step one token
    at a time)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return decoder is not None and type(decoder).__name__ == "ByteLevel"


def detokenize_step(decode: Callable[[list[int], bool], str] | None, req: Request, runs: bool = False) -> str:
    """Text added by the request's new tokens, with ``decode``
    (:func:`text_decoder`). Each token's call decodes a short window twice
    (before / after) so that multi-token characters and leading spaces come
    out right, and emits nothing while a character is incomplete.
    ``runs`` (:func:`decodes_in_runs`): all new tokens in one call where
    the text then ends on a whole character; else, and for other decoders,
    one call per token, as if each had come alone."""
    if decode is None:
        return ""
    if runs:
        text = _decode_through(decode, req, req.num_tokens)
        if text or req.num_tokens - req.detok_read_offset <= 1:
            return text
    # A call that emits nothing moves nothing: stepping again from the last
    # emission is what the calls token by token did.
    return "".join(_decode_through(decode, req, end) for end in range(req.detok_read_offset + 1, req.num_tokens + 1))


def _decode_through(decode, req: Request, end: int) -> str:
    """The text the tokens before ``end`` add past the last emission."""
    skip = req.params.skip_special_tokens
    window = req.token_ids_from(req.detok_prefix_offset)[: end - req.detok_prefix_offset]
    prefix = decode(window[: req.detok_read_offset - req.detok_prefix_offset], skip)
    full = decode(window, skip)
    if len(full) > len(prefix) and not full.endswith("\ufffd"):
        req.detok_prefix_offset = req.detok_read_offset
        req.detok_read_offset = end
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
