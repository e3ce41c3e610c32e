"""Acceptance of a synchronous step on the device: greedy and rejection
sampling over chains (sampling.verify), acceptance over draft trees of
greedy and sampled rows (draft_tree.py, moving the accepted K/V), the first tokens of finished
prompts; the results reach the host in one transfer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specray.draft_tree import accept_greedy, kv_moves, path_tokens, target_choices
from specray.sampling import SamplingTensors, verify
from specray.staging import host_to_device

@dataclass
class AcceptedOnDevice:
    """A synchronous step's results, being copied to the host."""

    host: torch.Tensor  # [2S + S*G (+ S*G) + P]: accepted counts, bonus tokens, drafts, (path rows,) first tokens
    ready: torch.cuda.Event | None
    S: int  # decode rows
    G: int  # drafts a row
    first_tokens: torch.Tensor | None  # [P] on the device: first tokens of the prompts this step finished
    tree: bool = False  # draft trees: the drafts are the accepted paths', their block rows follow
    path_rows: list[list[int]] | None = None  # set by read() for trees

    def read(self, wait=None) -> tuple[list[int], list[int], list[list[int]], list[int]]:
        """``wait(event)`` in place of a plain sync (``step_wait.result_wait``)."""
        if self.ready is not None:
            self.ready.synchronize() if wait is None else wait(self.ready)
        host, S, G = self.host.tolist(), self.S, self.G
        drafts = host[2 * S : 2 * S + S * G]
        end = 2 * S + S * G
        if self.tree:
            rows = host[end : end + S * G]
            self.path_rows = [rows[s * G : (s + 1) * G] for s in range(S)]
            end += S * G
        return host[:S], host[S : 2 * S], [drafts[s * G : (s + 1) * G] for s in range(S)], host[end:]



class SyncAccept:
    """``EngineCore``'s acceptance of synchronous steps."""

    def _accept(self, decode, prefill, logits, logit_rows, drafts, st, batch) -> "AcceptedOnDevice":
        """Accepted counts, emitted bonus tokens and first tokens of
        finished prefills, on their way to the host in one transfer."""
        dev = logits.device
        verify_rows, sample_rows = logit_rows
        parts = []
        S = len(decode)
        G = verify_rows.shape[1] - 1 if S else 0  # drafts of the longest block
        tree = S and drafts is not None and drafts.tree is not None
        if S:
            num_drafts = host_to_device(torch.tensor([d.block_len - 1 for d in decode]), dev)
            if batch.uniform_rows:  # sequence s owns rows s*B .. s*B+B-1, in order
                target_logits = logits.view(S, batch.uniform_rows, -1)[:, : G + 1]
            else:
                target_logits = logits[host_to_device(verify_rows, dev)]
        if tree:
            G = drafts.tokens.shape[1]
            parts += self._accept_tree(decode, target_logits, num_drafts, drafts, batch, st)
        elif S:
            if drafts is not None:
                draft_tokens = drafts.tokens[:, :G].to(dev)
                idx = drafts.draft_idx[:, :G].to(dev) if drafts.draft_idx is not None else None
                q = drafts.draft_q[:, :G].to(dev) if drafts.draft_q is not None else None
            else:
                draft_tokens, idx, q = torch.zeros(S, 0, dtype=torch.long, device=dev), None, None
            res = verify(target_logits, draft_tokens, num_drafts, st, idx, q)
            parts += [res.num_accepted, res.bonus, draft_tokens.reshape(-1)]
        sampling = [p for p in prefill if p.samples_first_token]
        if sampling:
            ps = [p.request.params for p in sampling]
            st = SamplingTensors.build(ps, [p.request.seed for p in sampling], [p.end - 1 for p in sampling], 1, dev,
                                       vocab_size=self.target_spec.vocab_size)
            no_drafts = torch.zeros(len(sampling), 0, dtype=torch.long, device=dev)
            zeros = torch.zeros(len(sampling), dtype=torch.long, device=dev)
            first = verify(logits[host_to_device(sample_rows, dev)][:, None], no_drafts, zeros, st)
            parts.append(first.bonus)
        flat = torch.cat([p.reshape(-1).long() for p in parts]) if parts else torch.zeros(0, dtype=torch.long)
        # Copied out before anything else is enqueued: the host waits for
        # this step's results only, not for a chain launched after it.
        host, ready = self.result_buffers.fetch(flat) if flat.is_cuda else (flat, None)
        return AcceptedOnDevice(host, ready, S, G, first.bonus if sampling else None, tree=bool(tree))

    def _accept_tree(self, decode, target_logits, num_drafts, drafts, batch, st) -> list[torch.Tensor]:
        """Acceptance over draft trees (greedy rows: the target's argmax;
        sampled rows: its samples, draft_tree.target_choices), from the verify blocks' logits
        ``[S, longest block, V]``; the accepted nodes' target K/V move to
        their positions' slots. Returns the device parts of the results:
        accepted counts, bonus tokens, the paths' drafts and block rows."""
        dev, S = target_logits.device, len(decode)
        B = drafts.tokens.shape[1] + 1
        target_argmax = target_choices(target_logits, drafts.tree, st)
        if target_argmax.shape[1] < B:  # rows past every block: no real node has its parent there
            target_argmax = torch.nn.functional.pad(target_argmax, (0, B - target_argmax.shape[1]))
        acc = accept_greedy(target_argmax, drafts.tokens, drafts.tree, num_drafts)
        # Block row j of sequence s is token query_start_loc[s] + j; rows past
        # a cut-short block stand for its row 0 (they only copy onto themselves).
        j = torch.arange(B)
        lens = torch.tensor([d.block_len for d in decode])
        rows = batch.attn.query_start_loc[:S, None] + torch.where(j[None] < lens[:, None], j[None], 0)
        row_slots = host_to_device(batch.attn.slot_mapping[rows], dev)
        self.target.move_kv(*kv_moves(row_slots, acc.path_rows))
        return [acc.num_accepted, acc.bonus, path_tokens(drafts.tokens, acc.path_rows).reshape(-1),
                acc.path_rows.reshape(-1)]
