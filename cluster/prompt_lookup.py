"""Prompt-lookup drafts beside the DFlash drafter.

When the last few tokens of a request already occurred earlier in it (the
prompt or the answer so far), the tokens that followed them there are
proposed as the step's drafts instead of the drafter's: text that quotes
its prompt (summaries, code edits, worked math) continues a past run far
more often than a small drafter predicts it. Any draft is verified as
usual, so the output is unchanged (greedy: token-identical; sampled: the
draft distribution of such a row is one-hot, which rejection sampling
handles exactly). A step whose every request has a lookup draft skips the
drafter's forward, unless lookups must agree with the drafter
(``prompt_lookup_agree``): then a greedy row takes its lookup only where
the drafter's first draft is the lookup's first token.

The index is kept per request and only extended: each new token registers
the n-grams ending just before it, so a lookup is a dictionary get.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specray.plan import DraftOutput
from specray.sampling import SamplingTensors
from specray.staging import host_to_device


@dataclass
class NgramIndex:
    """A request's tokens, and where each of their ``min_n..max_n``-grams
    was last followed by a token: ``n-gram -> index of that token``."""

    min_n: int
    max_n: int
    tokens: list[int] = field(default_factory=list)
    next_after: dict[tuple[int, ...], int] = field(default_factory=dict)

    def propose(self, prompt: list[int], output: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the most recent earlier
        occurrence of the longest suffix n-gram of ``prompt + output``
        (output only grows between calls); [] when none occurred."""
        have = len(self.tokens)
        if have == 0:
            self.tokens = prompt + output
        else:
            self.tokens.extend(output[have - len(prompt) :])
        toks, L = self.tokens, len(self.tokens)
        for end in range(max(have, 1), L):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.next_after[tuple(toks[end - n : end])] = end
        for n in range(min(self.max_n, L), self.min_n - 1, -1):
            start = self.next_after.get(tuple(toks[L - n :]))
            if start is not None:
                return toks[start : start + k]
        return []


def lookup_rows(lookup: list[list[int]], num_drafts: int) -> torch.Tensor:
    """``[S, num_drafts]`` int64: each row's lookup draft padded with its
    last token (zeros for a row without one)."""
    G = num_drafts
    rows = [(t + [t[-1]] * G)[:G] if t else [0] * G for t in lookup]
    return torch.tensor(rows, dtype=torch.int64).view(len(lookup), G)


def merge_lookup_drafts(
    drafts: DraftOutput | None,
    lookup: list[list[int]],
    num_drafts: int,
    st: SamplingTensors,
    device: torch.device,
    agree: bool = False,
) -> DraftOutput:
    """The step's drafts ``[S, num_drafts]`` on ``device``: row ``s`` takes
    ``lookup[s]`` where it is non-empty (padded with its last token), the
    drafter's row otherwise (``drafts`` may be None only when every row
    has a lookup). With ``agree``, a greedy row takes its lookup only where
    it opens with the drafter's first draft (a sampled row's drafter token
    is a draw from q, which a one-hot lookup q would misstate). For
    sampled batches the lookup rows' sparse draft distribution is one-hot
    on the drafted token."""
    S, G = len(lookup), num_drafts
    has = [bool(t) for t in lookup]
    tokens = host_to_device(lookup_rows(lookup, G), device)
    if drafts is None:
        assert all(has), "rows without a lookup draft need the drafter's"
        if st.all_greedy:
            return DraftOutput(tokens, None, None)
        return DraftOutput(tokens, tokens[:, :, None], torch.ones(S, G, 1, device=device))
    use = host_to_device(torch.tensor(has), device)[:, None]
    d_tokens = drafts.tokens[:, :G].to(device)
    if agree and G:
        agrees = tokens[:, :1] == d_tokens[:, :1]
        if not st.all_greedy:  # sampled rows keep the plain rule
            agrees = agrees | host_to_device(st.temperature != 0, device)[:, None]
        use = use & agrees
    merged = torch.where(use, tokens, d_tokens)
    if drafts.draft_idx is None:
        return DraftOutput(merged, None, None)
    idx, q = drafts.draft_idx[:, :G].to(device), drafts.draft_q[:, :G].to(device)
    K = idx.shape[-1]
    onehot = torch.zeros(K, device=device, dtype=q.dtype)
    onehot[0] = 1.0
    # Every index of a lookup row names the drafted token and only the first
    # carries mass: q of the drafted token is exactly 1.
    idx = torch.where(use[:, :, None], tokens[:, :, None].expand(S, G, K), idx)
    q = torch.where(use[:, :, None], onehot, q)
    return DraftOutput(merged, idx, q)
