"""Log probabilities of generated tokens, from the target's logits of a
synchronous step.

They are vLLM's raw logprobs: the target model's distribution, before
temperature, top-k / top-p and the ``min_tokens`` mask. A speculative step
verifies a block: its row ``j`` holds the target's distribution of the
request's ``j``-th new token given the tokens before it, which are exactly
the emitted ones for every row that emits. So the figures are those an
autoregressive step would report, whatever the drafts were.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specray.request import Request, TokenLogprobs
from specray.staging import host_to_device


@dataclass
class LogprobRows:
    """The log-softmax rows of the requests that asked, taken before the
    step's results are known; ``read`` picks the emitted tokens' entries."""

    requests: list[Request]
    starts: list[int]  # request i owns rows starts[i] .. starts[i + 1] - 1
    logp: torch.Tensor  # [n, vocab] fp32
    top_logp: torch.Tensor  # [n, k]: the k = max asked most likely, per row
    top_ids: torch.Tensor  # [n, k]

    @classmethod
    def take(cls, logits: torch.Tensor, wanted: list[tuple[Request, list[int]]]) -> "LogprobRows | None":
        """``wanted``: each asking request with its logits rows (the row that
        predicts its next token first)."""
        if not wanted:
            return None
        rows = [row for _, rs in wanted for row in rs]
        starts = [0]
        for _, rs in wanted:
            starts.append(starts[-1] + len(rs))
        k = max(r.params.logprobs for r, _ in wanted)
        with torch.inference_mode():  # the workers' logits are inference tensors
            rows_dev = host_to_device(torch.tensor(rows, dtype=torch.int64), logits.device)
            logp = torch.log_softmax(logits.index_select(0, rows_dev).float(), dim=-1)
            top_logp, top_ids = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
        return cls([r for r, _ in wanted], starts, logp, top_logp, top_ids)

    def read(self, emitted: list[list[int]]) -> dict[str, list[TokenLogprobs]]:
        """Entries of the tokens ``emitted[i]`` that request ``i`` emitted
        from its rows, in order (at most one per row), by request id."""
        rows, cols = [], []
        for i, tokens in enumerate(emitted):
            if len(tokens) > self.starts[i + 1] - self.starts[i]:
                raise ValueError(f"{len(tokens)} tokens emitted from {self.starts[i + 1] - self.starts[i]} rows")
            rows.extend(range(self.starts[i], self.starts[i] + len(tokens)))
            cols.extend(tokens)
        with torch.inference_mode():
            idx = host_to_device(torch.tensor([rows, cols], dtype=torch.int64), self.logp.device)
            chosen = self.logp.view(-1).index_select(0, idx[0] * self.logp.shape[1] + idx[1])
            # One transfer for the step: the chosen tokens' figures, then the rows' top k
            # (ids as fp32: exact below 2**24, far above any vocabulary).
            flat = torch.cat([chosen, self.top_logp.index_select(0, idx[0]).reshape(-1),
                              self.top_ids.index_select(0, idx[0]).reshape(-1).float()]).cpu()
        n, k = len(rows), self.top_logp.shape[1]
        chosen_l = flat[:n].tolist()
        top_l = flat[n : n + n * k].view(n, k).tolist() if k else [[] for _ in range(n)]
        ids_l = flat[n + n * k :].view(n, k).long().tolist() if k else [[] for _ in range(n)]
        out: dict[str, list[TokenLogprobs]] = {}
        j = 0
        for r, tokens in zip(self.requests, emitted):
            keep = r.params.logprobs
            entries = []
            for tok in tokens:
                entries.append(TokenLogprobs(tok, chosen_l[j], list(zip(ids_l[j][:keep], top_l[j][:keep]))))
                j += 1
            out[r.request_id] = entries
        return out
