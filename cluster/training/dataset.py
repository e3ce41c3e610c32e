"""The training set: the usable token sequences, the frozen target's tapped
hidden states of every position (computed once, kept on the device), and
the batches a step draws from them, in an order a checkpoint can resume."""

from __future__ import annotations

import random

import torch

from specray.training.progress import bar, log


def select_sequences(data: dict, max_seq_len: int, max_train_tokens: int):
    """The sequences with a response of >= 2 tokens and at most
    ``max_seq_len`` tokens, in order, up to ``max_train_tokens`` in all (0:
    no limit). Returns (tokens, lengths, prompt_lens, offsets) of just those,
    and their statistics: only the kept sequences' features fill the device."""
    lengths, prompt_lens = data["lengths"], data["prompt_lens"]
    offsets = torch.cumsum(lengths, 0) - lengths
    tokens = data["tokens"].long()
    keep, total = [], 0
    for i in range(len(lengths)):
        if lengths[i] - prompt_lens[i] >= 2 and lengths[i] <= max_seq_len:
            if max_train_tokens and total + int(lengths[i]) > max_train_tokens:
                break
            keep.append(i)
            total += int(lengths[i])
    if not keep:
        raise SystemExit("no usable training sequences (responses need >= 2 tokens)")
    stats = dict(sequences=len(lengths), used=len(keep), tokens_all=int(lengths.sum()))
    tokens = torch.cat([tokens[offsets[i] : offsets[i] + lengths[i]] for i in keep])
    lengths, prompt_lens = lengths[keep], prompt_lens[keep]
    offsets = torch.cumsum(lengths, 0) - lengths
    resp = (lengths - prompt_lens).float()
    stats.update(tokens=int(lengths.sum()), response_tokens=int(resp.sum()),
                 mean_prompt_len=round(float(prompt_lens.float().mean()), 1),
                 mean_response_len=round(float(resp.mean()), 1), max_len=int(lengths.max()), gen=data["meta"])
    log(f"data: {len(keep)} usable sequences, {stats['tokens']} tokens (prompt ~{stats['mean_prompt_len']}, "
        f"response ~{stats['mean_response_len']}, max {stats['max_len']})")
    return tokens, lengths, prompt_lens, offsets, stats


def split_validation(n: int, val_frac: float) -> tuple[list[int], list[int]]:
    """(train, validation) sequence ids: the last ``val_frac`` of them (at
    least one when there are two or more) hold out."""
    n_val = max(int(n * val_frac), 1) if n > 1 else 0
    return list(range(n - n_val)), list(range(n - n_val, n))


@torch.inference_mode()
def compute_features(target, tokens, lengths, offsets, taps, device, budget_tokens, soft_k: int = 0):
    """Tapped hidden states of every position of every sequence, flat
    [total_tokens, k*H], in the target's dtype, on ``device``; with
    ``soft_k``, also the target's top-``soft_k`` next-token log-probs and
    their ids at every position (``[total_tokens, soft_k]`` bf16 / int32),
    else None. Right padding needs no mask: causal attention never lets a
    real token see a pad."""
    H = target.config.hidden_size
    total = int(lengths.sum())
    feats = torch.empty(total, len(taps) * H, dtype=target.dtype, device=device)
    soft = None
    if soft_k:
        soft = (torch.empty(total, soft_k, dtype=torch.bfloat16, device=device),
                torch.empty(total, soft_k, dtype=torch.int32, device=device))
    order = torch.argsort(lengths, descending=True).tolist()
    lengths, offsets = lengths.tolist(), offsets.tolist()
    i = 0
    progress = bar(total=len(order), unit="seq", desc="features")
    while i < len(order):
        width = lengths[order[i]]
        idx = order[i : i + max(1, budget_tokens // width)]
        ids = torch.zeros(len(idx), width, dtype=torch.long)
        for r, s in enumerate(idx):
            ids[r, : lengths[s]] = tokens[offsets[s] : offsets[s] + lengths[s]]
        hs = target.model(input_ids=ids.to(device), output_hidden_states=True, use_cache=False).hidden_states
        # Reference indexing: the output of decoder layer t is hidden_states[t + 1].
        f = torch.cat([hs[t + 1] for t in taps], -1)
        for r, s in enumerate(idx):
            feats[offsets[s] : offsets[s] + lengths[s]] = f[r, : lengths[s]]
            if soft is not None:  # hidden_states[-1] is after the final norm
                for a in range(0, lengths[s], 4096):
                    b = min(a + 4096, lengths[s])
                    logp = target.lm_head(hs[-1][r, a:b]).float().log_softmax(-1)
                    top, top_ids = logp.topk(soft_k, dim=-1)
                    soft[0][offsets[s] + a : offsets[s] + b] = top
                    soft[1][offsets[s] + a : offsets[s] + b] = top_ids
        i += len(idx)
        progress.update(len(idx))
    progress.close()
    return feats, soft


class BatchStream:
    """Endless batches of sequence ids: each epoch shuffled, then sorted by
    length inside windows of 8 batches so that padding stays small, then
    the batches shuffled. ``state_dict`` is the epoch's seed state and the
    batches taken from it, so a resumed run draws what the interrupted one
    would have drawn."""

    def __init__(self, train_idx: list[int], lengths: torch.Tensor, n: int, seed: int):
        self.train_idx, self.lengths, self.n = train_idx, lengths, min(n, len(train_idx))
        self.rng = random.Random(seed)
        self._new_epoch()

    def _new_epoch(self) -> None:
        self.epoch_rng = self.rng.getstate()
        perm = self.train_idx[:]
        self.rng.shuffle(perm)
        n, out = self.n, []
        for c in range(0, len(perm), 8 * n):
            part = sorted(perm[c : c + 8 * n], key=lambda s: int(self.lengths[s]))
            out += [part[j : j + n] for j in range(0, len(part), n)]
        full = [b for b in out if len(b) == n]
        self.batches = full or out
        self.rng.shuffle(self.batches)
        self.pos = 0

    def __iter__(self):
        return self

    def __next__(self) -> list[int]:
        if self.pos == len(self.batches):
            self._new_epoch()
        self.pos += 1
        return self.batches[self.pos - 1]

    def state_dict(self) -> dict:
        version, internal, gauss = self.epoch_rng
        return {"rng": [version, list(internal), gauss], "pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        self._new_epoch()
        self.pos = state["pos"]


class Batcher:
    """Gathers a batch of sequences (tokens + features) on the device."""

    def __init__(self, tokens, feats, lengths, prompt_lens, offsets, device, pad_multiple=64, soft=None):
        self.dev = torch.device(device)
        self.tokens = tokens.to(self.dev, torch.long)
        self.feats = feats
        self.soft = soft
        self.lengths, self.prompt_lens, self.offsets = lengths, prompt_lens, offsets
        self.L = lengths.to(self.dev)
        self.P = prompt_lens.to(self.dev)
        self.O = offsets.to(self.dev)
        self.pad = pad_multiple

    def __call__(self, seq_ids: list[int]):
        T = max(int(self.lengths[s]) for s in seq_ids)
        T = -(-T // self.pad) * self.pad
        idx = torch.tensor(seq_ids)
        if self.dev.type == "cuda":
            idx = idx.pin_memory()
        idx = idx.to(self.dev, non_blocking=True)  # no host sync per step
        L, P = self.L[idx], self.P[idx]
        pos = torch.minimum(torch.arange(T, device=self.dev)[None], L[:, None] - 1) + self.O[idx][:, None]
        soft = (self.soft[0][pos], self.soft[1][pos]) if self.soft is not None else None
        return self.tokens[pos], self.feats[pos], L, P, soft


def sample_anchors(L, P, K, generator=None):
    """K anchors per sequence, uniform over response positions P .. L-2 (the
    last token has nothing after it to predict); with replacement, so short
    responses simply repeat anchors."""
    u = torch.rand(L.shape[0], K, device=L.device, generator=generator)
    return P[:, None] + (u * (L - 1 - P)[:, None]).long()
