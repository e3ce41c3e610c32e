"""Request features read off a synchronous step's verify rows: requested
log probabilities (logprobs.py), presence / frequency / repetition
penalties (penalties.py) and the ``min_tokens`` mask of stop tokens. Row
``j`` of a request's verify block predicts its output token
``len(output) + j``; a prompt's first-token row predicts its first."""

from __future__ import annotations

import torch

from specray.logprobs import LogprobRows
from specray.penalties import penalize
from specray.request import Request
from specray.staging import host_to_device


class VerifyRows:
    """``EngineCore``'s verify-row features."""

    @staticmethod
    def _rows_of(decode, prefill, logit_rows, uniform_rows: int, wants) -> list[tuple[Request, list[int], int | None]]:
        """``(request, its logits rows, its decode row)`` for each request of
        the step that ``wants``: a decode row's verify block (row ``j``
        predicts its output token ``len(output) + j``), a prompt's
        first-token row (decode row None)."""
        verify_rows, sample_rows = logit_rows
        out = []
        for s, d in enumerate(decode):
            if wants(d.request):
                if uniform_rows:  # sequence s owns rows s*B .. s*B+B-1
                    rows = [s * uniform_rows + j for j in range(d.block_len)]
                else:
                    rows = verify_rows[s, : d.block_len].tolist()
                out.append((d.request, rows, s))
        for k, r in enumerate(p.request for p in prefill if p.samples_first_token):
            if wants(r):
                out.append((r, [int(sample_rows[k])], None))
        return out

    def _penalize(self, decode, prefill, logits, logit_rows, uniform_rows: int, drafts) -> None:
        """Presence / frequency / repetition penalties on the rows of the
        requests that set them (penalties.py)."""
        groups = self._rows_of(decode, prefill, logit_rows, uniform_rows, lambda r: r.params.penalized)
        penalize(logits, groups, drafts.tokens if drafts is not None else None)

    def _mask_early_stops(self, decode, prefill, logits, logit_rows, uniform_rows: int) -> None:
        """Stop tokens get no probability (logit -inf) in the rows that
        predict a request's output tokens before its ``min_tokens``; the
        verification then accepts, and samples, what an autoregressive step
        under the same mask would."""
        vocab = logits.shape[-1]
        rows, cols = [], []
        for r, r_rows, _ in self._rows_of(decode, prefill, logit_rows, uniform_rows, lambda r: r.min_tokens_left):
            stops = [t for t in sorted(r.stop_token_ids) if 0 <= t < vocab]
            for row in r_rows[: r.min_tokens_left]:
                rows.extend([row] * len(stops))
                cols.extend(stops)
        if rows:
            rows_cols = host_to_device(torch.tensor([rows, cols], dtype=torch.int64), logits.device)
            with torch.inference_mode():  # the workers' outputs are inference tensors
                logits.index_put_((rows_cols[0], rows_cols[1]),
                                  torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device))

    def _logprob_rows(self, decode, prefill, logits, logit_rows, uniform_rows: int) -> LogprobRows | None:
        """The log-softmax rows of the requests that asked for log
        probabilities, taken before the min_tokens mask (raw logprobs)."""
        wanted = self._rows_of(decode, prefill, logit_rows, uniform_rows, lambda r: r.params.logprobs is not None)
        return LogprobRows.take(logits, [(r, rows) for r, rows, _ in wanted])

    @staticmethod
    def _read_logprobs(rows: LogprobRows, decode, prefill, results) -> dict:
        """The entries of the tokens each asking request emitted this step
        (a decode row's accepted drafts and bonus; a prompt's first token)."""
        n_acc, bonus, drafts, firsts = results
        emitted = {}
        for s, d in enumerate(decode):
            emitted[d.request.request_id] = drafts[s][: n_acc[s]] + [bonus[s]]
        for p, first in zip((p for p in prefill if p.samples_first_token), firsts):
            emitted[p.request.request_id] = [first]
        return rows.read([emitted[r.request_id] for r in rows.requests])
