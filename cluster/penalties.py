"""Presence, frequency and repetition penalties on a synchronous step's
target logits (vLLM's rules), applied before verification.

A verify block's row ``j`` is the target's distribution of the request's
``j``-th new token, given its output so far and the block's first ``j``
drafts: where those drafts are accepted they are output tokens, so the
row is penalised as if they were. Greedy acceptance and rejection
sampling then follow the penalised distribution an autoregressive step
samples from, and the output stays the autoregressive engine's. Rows
after a rejected draft are penalised for tokens that never happen, but no
token is taken from them.
"""

from __future__ import annotations

import torch

from specray.request import Request
from specray.staging import host_to_device


def apply_penalties(logits: torch.Tensor, prompt_mask: torch.Tensor, output_counts: torch.Tensor,
                        presence: torch.Tensor, frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """``logits`` ``[n, V]`` penalised: repetition divides a positive logit
    (multiplies a negative one) of every token seen in the prompt
    (``prompt_mask``) or the output (``output_counts`` > 0), then frequency
    and presence subtract ``count`` and ``count > 0`` times themselves."""
    seen = prompt_mask | (output_counts > 0)
    rep = torch.where(seen, repetition[:, None], torch.ones_like(logits))
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    return logits - frequency[:, None] * output_counts - presence[:, None] * (output_counts > 0).to(logits.dtype)


def penalize(logits: torch.Tensor, groups: list[tuple[Request, list[int], int | None]],
             draft_tokens: torch.Tensor | None) -> None:
    """Penalise ``logits`` ``[rows, V]`` in place. ``groups``: each
    penalised request, its logits rows (row ``j`` predicts its ``j``-th
    new token) and its row of ``draft_tokens`` ``[S, G]`` (the block's
    drafts; None for a prompt's first-token row)."""
    if not groups:
        return
    dev, V = logits.device, logits.shape[-1]
    P = len(groups)
    # Per request: its prompt's tokens and its output's counts, as flat
    # indices p * V + token. index_fill_ / index_add_ / index_select rather
    # than advanced indexing, whose host side costs tens of microseconds a
    # call (index_add_'s atomics are exact for integer counts).
    prompt_flat, out_flat, knobs = [], [], []
    for p, (r, _, _) in enumerate(groups):
        prompt_flat.extend(p * V + t for t in r.prompt_token_ids)
        out_flat.extend(p * V + t for t in r.output_token_ids)
        sp = r.params
        knobs.append((sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty))
    # Row j of a block also counts the block's first j drafts.
    row_req, row_pos, row_draft, logit_rows = [], [], [], []
    for p, (_, rows, s) in enumerate(groups):
        for j, row in enumerate(rows):
            row_req.append(p)
            row_pos.append(j)
            row_draft.append(-1 if s is None else s)
            logit_rows.append(row)
    n_prompt, n_out = len(prompt_flat), len(out_flat)
    ints = host_to_device(torch.tensor(prompt_flat + out_flat + row_req + row_pos + row_draft + logit_rows,
                                       dtype=torch.int64), dev)
    prompt_idx, out_idx = ints[:n_prompt], ints[n_prompt : n_prompt + n_out]
    meta = ints[n_prompt + n_out :].view(4, -1)
    prompt_mask = torch.zeros(P * V, dtype=torch.bool, device=dev).index_fill_(0, prompt_idx, True)
    counts = torch.zeros(P * V, dtype=torch.float32, device=dev)
    counts.index_add_(0, out_idx, torch.ones(n_out, device=dev))
    row_counts = counts.view(P, V).index_select(0, meta[0])
    if draft_tokens is not None and draft_tokens.shape[1] and any(s is not None for _, _, s in groups):
        drafts = draft_tokens.to(dev)
        G = drafts.shape[1]
        prefix = torch.arange(G, device=dev)[None, :] < meta[1][:, None]  # [n, G]: drafts before row j
        has = (meta[2] >= 0)[:, None] & prefix
        toks = drafts.index_select(0, meta[2].clamp(min=0))
        row_counts.scatter_add_(1, toks, has.to(row_counts.dtype))

    knobs_dev = host_to_device(torch.tensor(knobs, dtype=torch.float32), dev).index_select(0, meta[0])  # [n, 3]
    with torch.inference_mode():  # the workers' logits are inference tensors
        rows = meta[3]
        penalised = apply_penalties(logits.index_select(0, rows).float(),
                                    prompt_mask.view(P, V).index_select(0, meta[0]), row_counts,
                                    knobs_dev[:, 0], knobs_dev[:, 1], knobs_dev[:, 2])
        logits.index_copy_(0, rows, penalised.to(logits.dtype))
