"""Sampling parameters, greedy verification and lossless speculative
rejection sampling.

Randomness is counter-based: every uniform is a hash of (request seed,
absolute token position, stream). Outputs therefore do not depend on batch
composition, step boundaries or which process samples, and a request
recomputed after preemption reproduces itself. It stays exact: a step's
emitted tokens depend only on the uniforms of positions up to the first
rejection, so the uniforms the next step uses are still fresh.

A step can only touch the ``W`` positions after each request's start (its
verify block), so the host hashes exactly those, with numpy, once a step,
and ships them as ``SamplingTensors.uniforms`` ``[3, S, W]``: on a GPU
each of the hash's small integer operators would be a kernel launch.

The draft distribution ``q`` is the drafter's filtered distribution
restricted to its top ``K`` tokens and renormalised. Rejection sampling is
exact for any ``q`` that is known exactly, and ``[K]`` indices + probs per
draft row are cheap to ship from a drafter on another GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from specray.kernels import ops
from specray.staging import host_to_device

STREAM_DRAFT = 1  # drafter samples a draft token
STREAM_ACCEPT = 2  # accept / reject a draft token
STREAM_TOKEN = 3  # target samples an emitted token (bonus, residual, AR)

_M32 = 0xFFFFFFFF
GREEDY_BELOW = 1e-5  # a temperature below this decodes greedily
# Most alternatives a token reports (vLLM's default max_logprobs; OpenAI's top_logprobs bound).
MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """Per-request sampling settings, validated on construction."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1): no top-k
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # Tokens generated before a stop token (EOS, stop_token_ids) or a stop
    # string may end the request; vLLM's rule: until then stop tokens get no
    # probability.
    min_tokens: int = 0
    # Log probabilities of each generated token under the target (vLLM's
    # raw logprobs: before temperature, top-k / top-p and the min_tokens
    # mask), with this many most likely alternatives; None: none.
    logprobs: int | None = None
    # vLLM's (and OpenAI's) penalties on the target's logits, before
    # temperature: presence and frequency subtract, for each token, its
    # presence in / count over the generated tokens so far; repetition
    # divides a positive logit (multiplies a negative one) of every token
    # in the prompt or the output.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self):
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise ValueError(f"max_tokens must be an integer, got {self.max_tokens!r}")
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not _finite_number(self.temperature):
            raise ValueError(f"temperature must be a finite number, got {_short(self.temperature)}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if self.temperature < GREEDY_BELOW:
            # Logits divided by so small a temperature overflow float32; the
            # distribution is the argmax's anyway (vLLM's rule too).
            self.temperature = 0.0
        if not _finite_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {_short(self.top_p)}")
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be a non-negative integer (or -1 for none), got {self.top_k!r}")
        # Any k beyond a vocabulary keeps it whole; an int64 tensor holds this one.
        self.top_k = min(self.top_k, 2**31 - 1)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise ValueError(f"seed must fit in a signed 64-bit integer, got {_short(self.seed)}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None:
            self.stop = []
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {_short(self.stop)}")
        self.stop = [s for s in self.stop if s]
        if not isinstance(self.stop_token_ids or [], (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of integers, got {_short(self.stop_token_ids)}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be a list of integers")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or \
                not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer from 0 to max_tokens ({self.max_tokens}), "
                             f"got {_short(self.min_tokens)}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer from 0 to {MAX_LOGPROBS} (or unset), "
                             f"got {_short(self.logprobs)}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _finite_number(v) or not -2 <= v <= 2:
                raise ValueError(f"{name} must be a number from -2 to 2, got {_short(v)}")
        if not _finite_number(self.repetition_penalty) or not 0 < self.repetition_penalty <= 10:
            raise ValueError(f"repetition_penalty must be a number in (0, 10], got {_short(self.repetition_penalty)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)


def _finite_number(x) -> bool:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:  # an int beyond any float
        return False


def _short(x) -> str:
    r = repr(x)
    return r if len(r) <= 40 else r[:37] + "..."


@dataclass
class SamplingTensors:
    """Per-row sampling settings of a batch, as tensors on the sampling
    device."""

    temperature: torch.Tensor  # [S] fp32; 0 = greedy
    top_p: torch.Tensor  # [S] fp32
    top_k: torch.Tensor  # [S] int64; 0 = off
    # [3, S, W] float64: row ``stream - 1``, column j = the uniform of
    # position start + 1 + j (host_uniforms); [3, S, 0] when all greedy.
    uniforms: torch.Tensor
    all_greedy: bool = field(default=True)
    # Some row has top-k or top-p < 1: without them a plain softmax is the
    # distribution, and the full-vocabulary sort is skipped.
    any_filter: bool = field(default=True)

    @staticmethod
    def build(params: list[SamplingParams], seeds: list[int], starts: list[int], width: int,
              device="cpu", vocab_size: int | None = None) -> "SamplingTensors":
        """Settings of ``params``, and the uniforms of positions ``start + 1
        .. start + width`` of each row (a step that verifies ``width - 1``
        drafts reads no others). An all-greedy batch stays on the host:
        nothing reads its tensors. With ``vocab_size``, a top-k that keeps
        the whole vocabulary counts as no filter."""
        all_greedy = all(p.greedy for p in params)
        st = SamplingTensors(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64),
            # Greedy rows draw no uniforms: an all-greedy step hashes nothing.
            uniforms=torch.zeros(3, len(seeds), 0, dtype=torch.float64) if all_greedy
            else host_uniforms(seeds, starts, width),
            all_greedy=all_greedy,
            any_filter=any_filter(params, vocab_size),
        )
        return st.to(device)

    def to(self, device) -> "SamplingTensors":
        """On ``device``; an all-greedy batch stays where it is (greedy
        drafting and verification read none of its tensors: no copies).
        Copies go through pinned memory without waiting for the device."""
        if self.all_greedy:
            return self
        move = lambda t: host_to_device(t, device)  # noqa: E731
        return SamplingTensors(move(self.temperature), move(self.top_p), move(self.top_k), move(self.uniforms),
                               self.all_greedy, self.any_filter)


def any_filter(params: list[SamplingParams], vocab_size: int | None = None) -> bool:
    """Whether a sampled row of ``params`` restricts its distribution (top-k
    below the vocabulary, top-p below 1)."""
    max_k = vocab_size if vocab_size is not None else float("inf")
    return any(not p.greedy and (0 < p.top_k < max_k or p.top_p < 1) for p in params)


# ---------------------------------------------------------------- randomness
def _mix32(x: torch.Tensor) -> torch.Tensor:
    # 32-bit avalanche in int64 lanes; multipliers stay below 2**31 so no
    # product overflows int64.
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _M32
    return x ^ (x >> 16)


def seed_keys(seeds) -> np.ndarray:
    """The seed half of the hash, ``[S]`` -> ``[3, S]`` int64 (row ``stream -
    1``)."""
    s = np.asarray(seeds, dtype=np.int64).reshape(1, -1)
    streams = np.array([[STREAM_DRAFT], [STREAM_ACCEPT], [STREAM_TOKEN]], dtype=np.int64)
    return _seed_half(s, streams)


def host_uniforms(seeds, starts, width: int) -> torch.Tensor:
    """``[3, S, width]`` float64: the uniform of stream ``k + 1`` at
    position ``starts[s] + 1 + j`` in ``[k, s, j]``; the same values as
    :func:`hash_uniform`, computed with numpy on the host."""
    keys = seed_keys(seeds)[:, :, None]  # [3, S, 1]
    pos = np.asarray(starts, dtype=np.int64).reshape(-1, 1) + 1 + np.arange(width, dtype=np.int64)[None]  # [S, W]
    return torch.from_numpy(_open_unit(_position_half(keys, pos).astype(np.float64)))


# The two halves of the hash are operators only: the same code hashes numpy
# arrays (host_uniforms) and tensors (hash_uniform).
def _seed_half(seeds, stream):
    x = _mix32((seeds & _M32) ^ ((stream * 0x9E3779B9) & _M32))
    return _mix32(x ^ ((seeds >> 32) & _M32))


def _position_half(keys, positions):
    x = _mix32(keys ^ (positions & _M32))
    return _mix32(x ^ ((positions >> 32) & _M32) ^ 0x5BD1E995)


def _open_unit(x):
    """A 32-bit hash (float64) -> the open interval (0, 1)."""
    return (x + 0.5) / 4294967296.0


def position_uniforms(keys: torch.Tensor, starts: torch.Tensor, width: int) -> torch.Tensor:
    """:func:`host_uniforms` from tensors already on the device: ``keys``
    ``[3, S]`` (:func:`seed_keys`), ``starts`` ``[S]`` -> ``[3, S, width]``
    float64, for steps whose starts only the device knows (asynchronous
    steps). One Triton kernel on a GPU, these operators elsewhere."""
    if starts.is_cuda:
        try:
            from specray.kernels.uniforms_triton import position_uniforms as kernel
        except ImportError:
            kernel = None
        if kernel is not None:
            return kernel(keys, starts, width)
    pos = starts.long()[:, None] + 1 + torch.arange(width, device=starts.device)[None]
    return _open_unit(_position_half(keys.long()[:, :, None], pos[None]).double())


def hash_uniform(seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """A uniform in the open interval (0, 1) (float64) for every (seed,
    position) pair, broadcast together, in ``stream``: the definition, in
    torch (the reference :func:`host_uniforms` is tested against)."""
    x = _position_half(_seed_half(seeds.to(torch.int64), stream), positions.to(torch.int64))
    return _open_unit(x.double())


def sample_inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` ``[N, V]`` (need not be normalised),
    driven by ``u`` ``[N]`` in (0, 1). A token of probability 0 is not
    drawn (short of ``u`` landing within a float64 rounding of the
    cumulative sum, as with any parallel scan)."""
    cdf = cumsum_rows(probs.double())
    x = (u * cdf[:, -1]).unsqueeze(-1)
    idx = torch.searchsorted(cdf, x).squeeze(-1)
    return idx.clamp_(max=probs.shape[-1] - 1)


# ------------------------------------------------------------ distributions
def filtered_probs(logits: torch.Tensor, st: SamplingTensors, rows_per_seq: int = 1,
                   argmax: torch.Tensor | None = None, greedy_rows: bool = True) -> torch.Tensor:
    """Softmax of ``logits`` ``[S * rows_per_seq, V]`` at each row's
    temperature, restricted to its top-k then top-p set (the same rule as
    the DFlash reference). Greedy rows come back as one-hot argmax (pass
    ``argmax`` ``[S * rows_per_seq]`` where the caller has it: it is a
    full pass over the vocabulary), or with ``greedy_rows=False``, for a
    caller that overrides them, as the softmax at temperature 1 (two full
    passes fewer)."""
    expand = (lambda t: t.repeat_interleave(rows_per_seq)) if rows_per_seq > 1 else (lambda t: t)
    temp, top_p, top_k = expand(st.temperature), expand(st.top_p), expand(st.top_k)
    greedy = temp == 0
    safe_temp = torch.where(greedy, torch.ones_like(temp), temp)
    probs = (logits.float() / safe_temp[:, None]).softmax(-1)
    if st.any_filter:
        # Only the rows that filter take the sorted path: its float32
        # cumulative sum can reach top_p = 1 before the tail and drop it, and
        # a row's distribution must not depend on what its batch mates ask.
        V = logits.shape[-1]
        filters = ((top_k > 0) & (top_k < V)) | (top_p < 1)
        probs = torch.where(filters[:, None], _top_k_top_p(logits, safe_temp, top_k, top_p), probs)
    if not greedy_rows:
        return probs
    # Unconditional: testing greedy.any() would wait for the device.
    argmax = ops.argmax(logits) if argmax is None else argmax
    onehot = torch.zeros_like(probs).scatter_(-1, argmax.reshape(-1, 1), 1.0)
    return torch.where(greedy[:, None], onehot, probs)


def _top_k_top_p(logits: torch.Tensor, temp: torch.Tensor, top_k: torch.Tensor,
                 top_p: torch.Tensor) -> torch.Tensor:
    """Softmax of ``logits / temp`` restricted to the top-k (0: all), then
    to the smallest prefix whose mass reaches top-p, renormalised."""
    V = logits.shape[-1]
    # Sorting the logits in their own dtype orders them as the scores (the
    # temperature is positive) with half the radix passes of float32 in bf16.
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    sorted_scores = sorted_logits.float() / temp[:, None]
    ranks = torch.arange(V, device=logits.device)[None]
    k = torch.where(top_k > 0, top_k.clamp(max=V), torch.full_like(top_k, V))
    sorted_scores = sorted_scores.masked_fill(ranks >= k[:, None], float("-inf"))
    sorted_probs = sorted_scores.softmax(-1)
    # The most likely token always stays: a top_p that rounds to 0 in
    # float32 would otherwise keep nothing.
    keep = ((cumsum_rows(sorted_probs) - sorted_probs) < top_p[:, None]) | (ranks == 0)
    sorted_probs = sorted_probs * keep
    sorted_probs = sorted_probs / sorted_probs.sum(-1, keepdim=True)
    return torch.zeros_like(sorted_probs).scatter_(-1, order, sorted_probs)


def cumsum_rows(x: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """``x.cumsum(-1)`` for ``x`` ``[N, V]`` in two levels (within chunks of
    ``chunk``, then the chunks' totals): a GPU scan of a few vocabulary-long
    rows runs a row per block (62 us for 16 rows of 49 152 on the H200); the
    chunks keep the whole GPU busy. Sums in another order than one scan."""
    N, V = x.shape
    if V <= chunk:
        return x.cumsum(-1)
    pad = (-V) % chunk
    inner = F.pad(x, (0, pad)).view(N, -1, chunk).cumsum(-1)
    before = F.pad(inner[:, :-1, -1].cumsum(-1), (1, 0))  # the chunks before each
    return (inner + before[:, :, None]).view(N, -1)[:, :V]


def sparse_draft(logits: torch.Tensor, st: SamplingTensors, rows_per_seq: int,
                 k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft distribution of the rows ``logits`` ``[N, V]``: each row's
    temperature softmax over its ``k`` most likely tokens, then the row's
    top-k / top-p within those, renormalised: ``(indices [N, k] int64,
    q [N, k] fp32)``. Rejection sampling is exact for any q; filtering after
    the restriction spares the drafts the full-vocabulary softmax and sort
    (the target's side still filters over the whole vocabulary)."""
    k = min(k, logits.shape[-1])
    top, idx = logits.topk(k, dim=-1)  # sorted: column 0 is the argmax
    first = torch.zeros(top.shape[0], dtype=torch.long, device=top.device)
    return idx, filtered_probs(top, st, rows_per_seq=rows_per_seq, argmax=first)


def sample_draft_tokens(
    logits: torch.Tensor, st: SamplingTensors, top_k_sparse: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Draft tokens from draft logits ``[S, G, V]`` for block rows at
    positions ``start + 1 .. start + G`` (``st.uniforms`` built with these
    starts). Greedy rows take the argmax; the others sample from the sparse
    ``q`` whose ``(indices, probs)`` ``[S, G, K]`` are returned for
    verification."""
    S, G, V = logits.shape
    argmax = ops.argmax(logits)
    if st.all_greedy:
        return argmax, None, None
    _check_width(st, G)
    idx, q = sparse_draft(logits.reshape(S * G, V), st, G, top_k_sparse)
    u = st.uniforms[STREAM_DRAFT - 1, :, :G].reshape(-1)
    choice = sample_inverse_cdf(q, u)
    sampled = idx.gather(-1, choice[:, None]).squeeze(-1).view(S, G)
    greedy = (st.temperature == 0)[:, None]
    K = idx.shape[-1]
    return torch.where(greedy, argmax, sampled), idx.view(S, G, K), q.view(S, G, K)


def _check_width(st: SamplingTensors, width: int) -> None:
    # Too few uniform columns would broadcast silently (rows sharing one draw).
    if st.uniforms.shape[-1] < width:
        raise ValueError(f"the sampling uniforms cover {st.uniforms.shape[-1]} positions per row, "
                         f"this step reads {width}")


# ------------------------------------------------------------- verification
@dataclass
class VerifyResult:
    num_accepted: torch.Tensor  # [S] accepted draft tokens
    bonus: torch.Tensor  # [S] the token emitted after them


def verify(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_drafts: torch.Tensor,
    st: SamplingTensors,
    draft_idx: torch.Tensor | None = None,
    draft_q: torch.Tensor | None = None,
) -> VerifyResult:
    """Accept a prefix of each row's drafts and emit one more token.

    ``target_logits`` ``[S, G+1, V]``: row ``i`` is the target's prediction
    for position ``start + i + 1`` given the block up to row ``i``.
    ``draft_tokens`` ``[S, G]`` (block rows 1..G); sequence ``s`` uses only
    its first ``num_drafts[s]`` drafts. Greedy rows accept while the draft
    equals the target argmax; sampled rows run speculative rejection
    sampling against the sparse draft distribution, with ``st.uniforms``
    built for positions ``start + 1 .. start + G + 1``.
    """
    S, G1, V = target_logits.shape
    G = G1 - 1
    device = target_logits.device
    i = torch.arange(G, device=device)[None]
    real = i < num_drafts[:, None]
    rows = torch.arange(S, device=device)
    argmax = ops.argmax(target_logits)  # [S, G+1]
    match = (draft_tokens[:, :G] == argmax[:, :G]) & real
    n_greedy = match.int().cumprod(-1).sum(-1)
    if st.all_greedy:
        return VerifyResult(n_greedy, argmax[rows, n_greedy])

    _check_width(st, G1)
    # Greedy rows take n_greedy and the argmax below whatever p says.
    p = filtered_probs(target_logits.reshape(S * G1, V), st, rows_per_seq=G1, greedy_rows=False).view(S, G1, V)
    if G > 0:
        p_d = p[:, :G].gather(-1, draft_tokens[:, :G, None]).squeeze(-1)
        q_d = (draft_q * (draft_idx == draft_tokens[:, :G, None])).sum(-1)
        u = st.uniforms[STREAM_ACCEPT - 1, :, :G]
        accept = (u * q_d < p_d) & real
        n_sampled = accept.int().cumprod(-1).sum(-1)
    else:
        n_sampled = torch.zeros(S, dtype=torch.long, device=device)
    # Rejected at row n: resample from norm(max(p - q, 0)); all accepted: the
    # bonus comes from p itself.
    p_row = p[rows, n_sampled]
    rejected = n_sampled < num_drafts
    if G > 0:
        at = n_sampled.clamp(max=G - 1)
        q_row = torch.zeros_like(p_row).scatter_add_(-1, draft_idx[rows, at], draft_q[rows, at])
        residual = (p_row - q_row * rejected[:, None]).clamp_min(0)
        total = residual.sum(-1, keepdim=True)
        residual = torch.where(total > 0, residual, p_row)
    else:
        residual = p_row
    u = st.uniforms[STREAM_TOKEN - 1].gather(1, n_sampled[:, None]).squeeze(1)
    sampled_bonus = sample_inverse_cdf(residual, u)

    greedy = st.temperature == 0
    return VerifyResult(
        torch.where(greedy, n_greedy, n_sampled),
        torch.where(greedy, argmax[rows, n_greedy], sampled_bonus),
    )
