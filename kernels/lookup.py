"""Prompt-lookup drafts on the device, for steps whose tokens the host has
not seen yet (asynchronous steps keep each row's tokens in a device buffer).

The rule is ``NgramIndex``'s (cluster/prompt_lookup.py): the longest suffix
n-gram (``max_n`` down to ``min_n``) of a row's ``L`` tokens that occurred
earlier, its most recent earlier occurrence, and the ``k`` tokens after it,
padded with the last of them where the row ends first."""

from __future__ import annotations

import torch


def ngram_lookup_ref(history: torch.Tensor, lengths: torch.Tensor, min_n: int, max_n: int,
                     k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``history`` ``[S, W]`` token ids (row ``s`` holds ``lengths[s]`` of
    them), ``lengths`` ``[S]`` -> drafts ``[S, k]`` int64 (0 where none) and
    ``found`` ``[S]`` bool."""
    S, W = history.shape
    dev = history.device
    L = lengths.long()[:, None]  # [S, 1]
    ends = torch.arange(W, device=dev)[None]  # an occurrence ends just before ``end`` and is followed by it
    match = torch.ones(S, W, dtype=torch.bool, device=dev)
    start = torch.full((S,), -1, dtype=torch.int64, device=dev)
    for n in range(1, max_n + 1):
        src = (ends - n).clamp(min=0)
        suffix_tok = history.gather(1, (L - n).clamp(min=0))  # [S, 1]
        match = match & (history.gather(1, src.expand(S, W)) == suffix_tok)
        valid = match & (ends >= n) & (ends <= L - 1)
        if n >= min_n:
            best = torch.where(valid, ends, -1).amax(1)
            start = torch.where(best >= 0, best, start)  # a longer n overrides a shorter one
    found = start >= 0
    idx = torch.minimum(start.clamp(min=0)[:, None] + torch.arange(k, device=dev)[None], L - 1).clamp(min=0)
    drafts = torch.where(found[:, None], history.gather(1, idx), 0)
    return drafts, found
