"""Prompt-lookup drafts on the device, for steps whose tokens the host has
not seen yet (asynchronous steps keep each row's tokens in a device buffer).

The rule is ``NgramIndex``'s (cluster/prompt_lookup.py): the longest suffix
n-gram (``max_n`` down to ``min_n``) of a row's ``L`` tokens that occurred
earlier, its most recent earlier occurrence, and the ``k`` tokens after it,
padded with the last of them where the row ends first.

``lookup_drafts`` is what a step graph runs: it reads the batch's rows of
the history buffer, looks up, and writes the verify block's input ids
with a row's lookup draft in place of its drafter's where it has one (on
the GPU one kernel, where gather, lookup, compare, and, where and cat
were six)."""

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


def lookup_drafts_ref(history: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor, block_len: torch.Tensor,
                      greedy: torch.Tensor | None, drafts: torch.Tensor, last: torch.Tensor, min_n: int,
                      max_n: int, agree: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Batch row ``s`` reads ``history[rows[s]]`` (``lengths[s]`` tokens).
    A row takes its lookup draft over its drafter's ``drafts`` ``[S, G]``
    when it has one, its block verifies a draft (``block_len > 1``),
    (``greedy`` ``[S]`` bool, None for all) it is greedy and (with
    ``agree``) the two drafts open with the same token. Returns the
    block's input ids ``[S, G + 1]`` (``last``, then the drafts), the
    drafts ``[S, G]`` and which rows were looked up ``[S]``."""
    found_drafts, found = ngram_lookup_ref(history.index_select(0, rows), lengths, min_n, max_n, drafts.shape[1])
    looked_up = found & (block_len > 1)
    if agree:
        looked_up = looked_up & (found_drafts[:, 0] == drafts[:, 0])
    if greedy is not None:
        looked_up = looked_up & greedy
    merged = torch.where(looked_up[:, None], found_drafts, drafts)
    return torch.cat([last[:, None], merged], 1), merged, looked_up
