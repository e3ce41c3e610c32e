"""``EngineCore``'s intake: a request validated and tokenized into a
``Request`` without touching the engine's state, so another thread than
the one stepping may do it (a long prompt tokenizes for seconds)."""

from __future__ import annotations

import dataclasses
import operator
import uuid

import torch

from specray.detokenizer import init_detokenizer
from specray.request import Request, check_prompt_length
from specray.sampling import SamplingParams


def _token_ids(prompt) -> list[int]:
    """A token-id prompt as ints: integers only (numpy's too); 1.7, "1" or
    True are no token ids."""
    if isinstance(prompt, (bytes, dict)) or not hasattr(prompt, "__iter__"):
        raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
    ids = []
    for i, t in enumerate(prompt):
        try:
            if isinstance(t, bool) or getattr(t, "dtype", None) == torch.bool:  # a bool tensor has __index__
                raise TypeError
            ids.append(operator.index(t))
        except TypeError:
            raise ValueError(f"prompt token ids must be integers, got {t!r} at index {i}") from None
    return ids


class RequestIntake:
    """Needs ``tokenizer``, ``_encoder`` / ``_encoder_lock``, ``target_spec``,
    ``max_model_len``, ``max_prompt_chars`` and ``_rng`` (EngineCore's)."""

    def make_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> Request:
        """Validate and tokenize without touching engine state (safe to call
        from another thread than the one stepping)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        # The request keeps its own copy, validated again: a caller may reuse
        # and change its object for the next request, and a field made
        # invalid after construction must be refused here, not fail a step
        # that every request in flight shares.
        params = dataclasses.replace(params)
        request_id = request_id or uuid.uuid4().hex
        prompt_text, ids = self._tokenize(prompt)
        check_prompt_length(ids, self.max_model_len, self.max_prompt_chars)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        req = Request(request_id, prompt_text, ids, params, seed, self.target_spec.eos_token_ids)
        init_detokenizer(req)
        return req

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("the target checkpoint ships no tokenizer: pass token ids as the prompt")
            check_prompt_length(prompt, self.max_model_len, self.max_prompt_chars)
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"prompt is not valid Unicode text ({e.reason} at character {e.start})") from None
            with self._encoder_lock:
                ids = self._encoder.encode(prompt, add_special_tokens=True)
            text = prompt
        else:
            ids = _token_ids(prompt)
            text = None
        if not ids:
            raise ValueError("prompt is empty")
        vocab = self.target_spec.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        return text, ids
