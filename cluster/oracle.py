"""Oracle acceptance: system throughput at a chosen acceptance, without a
trained drafter (scale benchmarks only: ``bench/concurrency_sweep.py``).

A random-weight target of a real shape (Qwen3-8B, Qwen3-32B) with a
random drafter accepts ~1 token a step, so its speculative throughput says
nothing about a deployment. In oracle mode:

1. **Record.** The target alone decodes the prompts greedily; each prompt's
   continuation is kept (:meth:`Oracle.record`).
2. **Replay.** The speculative engine runs with the drafter's real forward
   (its cost is real: same shapes, same kernels, same graphs), but each
   row's drafts are replaced by the recorded continuation at the block's
   positions, cut by a per-position acceptance profile: the block at
   position ``p`` of a request keeps ``k`` correct drafts, ``k`` drawn from
   the profile with one counter-based uniform hashed from (the request's
   prompt, ``p``), so runs are reproducible and the sync and asynchronous
   paths draw the same ``k``. Drafts after the ``k``-th are the recorded
   token + 1 (mod vocab): wrong on purpose, so verification rejects there.

The target verifies as always, so the output is still exactly the target's
greedy output (a rejected draft costs acceptance, never tokens). As long as
the replay's tokens are the recorded ones (the verify rows give the
decode rows' bits: architecture.md section 8), every correct draft is
accepted and the measured mean acceptance length is the profile's
expectation (``AcceptanceProfile.expected_length``; lower near
``max_tokens``, where blocks are cut short). A request whose tokens leave
the recording (a near-tie argmax decided otherwise) is counted
(``OracleStats.diverged``) and drafts with the drafter's real proposals from
then on.

What this is not: a measure of speculation quality. It measures what the
system does with a given acceptance (step costs, batching, scheduling);
the acceptance itself is an input. Greedy (T=0) only, chains only (no
draft trees, no prompt lookups), in-process engines only. The adaptive
policy's autoregressive steps (spec_policy.py) verify no drafts; the draws
go by position, so a speculative step after them draws what it would have.
"""

from __future__ import annotations

import zlib
from array import array
from dataclasses import dataclass, field

import torch

from specray.config import ConfigError
from specray.plan import DraftBatch, DraftOutput
from specray.sampling import hash_uniform

STREAM_ORACLE = 11  # the hash stream of the oracle's draws (sampling uses 1..3)

# The engine settings oracle mode needs: drafts are chains the oracle
# rewrites, so no prompt lookups (they replace drafts) and no draft trees.
ORACLE_ENGINE_SETTINGS = dict(prompt_lookup_min=0, draft_tree=False)


@dataclass(frozen=True)
class AcceptanceProfile:
    """``survival[i - 1]`` = P(at least ``i`` drafts of a block are
    accepted), non-increasing in [0, 1]; positions past the list accept
    nothing."""

    name: str
    survival: tuple[float, ...]
    source: str = ""

    def __post_init__(self):
        s = self.survival
        if any(not 0.0 <= x <= 1.0 for x in s) or any(b > a for a, b in zip(s, s[1:])):
            raise ValueError(f"acceptance profile {self.name!r}: survival must be non-increasing in [0, 1], got {s}")

    def survival_for(self, num_drafts: int) -> list[float]:
        return (list(self.survival) + [0.0] * num_drafts)[:num_drafts]

    def expected_length(self, num_drafts: int) -> float:
        """Mean tokens a step emits (accepted drafts + the bonus) with blocks
        of ``num_drafts`` drafts."""
        return 1.0 + sum(self.survival_for(num_drafts))

    def accept_counts(self, keys: torch.Tensor, positions: torch.Tensor, num_drafts: int,
                      survival: torch.Tensor | None = None) -> torch.Tensor:
        """``[n]`` int64: correct drafts of the blocks at ``positions`` of the
        requests with hash ``keys`` (one uniform ``u`` each, ``k`` = the
        number of positions ``i`` with ``u < survival[i]``: P(k >= i) =
        survival[i], the survival being non-increasing). Host or device
        tensors alike, the same draws."""
        u = hash_uniform(keys, positions, STREAM_ORACLE)
        if survival is None:  # (a graph being captured takes it made beforehand: no copy inside)
            survival = torch.tensor(self.survival_for(num_drafts), dtype=torch.float64, device=u.device)
        return (u[:, None] < survival[None, :]).sum(1)


def _paper_qwen3_8b_gsm8k() -> tuple[float, ...]:
    # CONSTRUCTED, an approximation: the DFlash paper (arXiv 2602.06036)
    # reports a mean acceptance length tau ~ 6.5 for Qwen3-8B on GSM8K at
    # temperature 0 with block size 16; we do not have its per-position
    # numbers. This curve has the shape such profiles take (high early
    # acceptance, decaying with depth): the conditional acceptance of draft
    # i is 0.97 - b (i - 1), b = 0.035138 solved so that 1 + sum = 6.50.
    a, b, s, out = 0.97, 0.0351379634742193, 1.0, []
    for i in range(15):
        s *= a - b * i
        out.append(s)
    return tuple(out)


# Measured: the embedded pair (SmolLM2-135M + its stage-six DFlash drafter),
# chains with plain 2..4 prompt lookups, async steps, 48 eval prompts, T=0,
# 128 tokens, H200: results/h200_plain_eval_b1_t0.json,
# by_temperature["0.0"].per_position_acceptance (mean acceptance 2.445).
_EMBEDDED_EVAL = (0.6072300928187592, 0.353199804592086, 0.1885686370297997, 0.1084513922813874,
                  0.06448461162677088, 0.04201270151441133, 0.02784562774792379, 0.01612115290669272,
                  0.012212994626282364, 0.010258915486077186, 0.0073277967757694185, 0.006350757205666829,
                  0.005862237420615535, 0.004885197850512946, 0.004396678065461651)

PROFILES = {
    "paper-qwen3-8b-gsm8k": AcceptanceProfile(
        "paper-qwen3-8b-gsm8k", _paper_qwen3_8b_gsm8k(),
        "constructed to tau 6.5 at block 16 (DFlash paper, Qwen3-8B, GSM8K, T=0); not the paper's per-position data"),
    "embedded-eval": AcceptanceProfile(
        "embedded-eval", _EMBEDDED_EVAL,
        "measured: embedded pair, eval prompts, T=0, chains (results/h200_plain_eval_b1_t0.json)"),
}


def get_profile(name: str) -> AcceptanceProfile:
    """A registered profile, or ``const:P``: every draft is accepted with
    probability ``P`` given the ones before it (P(k >= i) = P^i)."""
    if name in PROFILES:
        return PROFILES[name]
    if name.startswith("const:"):
        try:
            p = float(name[len("const:"):])
        except ValueError:
            p = -1.0
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"oracle acceptance {name!r}: const:P needs 0 <= P <= 1")
        return AcceptanceProfile(name, tuple(p ** i for i in range(1, 257)), f"constant conditional acceptance {p}")
    raise ValueError(f"unknown oracle acceptance profile {name!r}: one of {sorted(PROFILES)} or const:P")


@dataclass
class OracleStats:
    # Counted on the host: synchronous steps, and asynchronous chains' first
    # steps (their later steps draft on the device).
    steps: int = 0  # synchronous steps' block rows the oracle drafted
    correct_drafts: int = 0  # the correct drafts it gave them (their k's)
    diverged: set = field(default_factory=set)  # requests whose tokens left the recording
    unrecorded: int = 0  # rows of prompts never recorded (the drafter's own drafts)
    sampled: int = 0  # rows at T > 0 (the drafter's own drafts)

    def as_dict(self) -> dict:
        return {"sync_rows": self.steps, "sync_correct_drafts": self.correct_drafts,
                "diverged_requests": len(self.diverged), "unrecorded_rows": self.unrecorded,
                "sampled_rows": self.sampled}


class Oracle:
    """Recorded greedy continuations, by prompt, and the profile that cuts
    them into drafts."""

    def __init__(self, profile: AcceptanceProfile | str, vocab_size: int, seed: int = 0):
        self.profile = get_profile(profile) if isinstance(profile, str) else profile
        self.vocab_size = vocab_size
        self.seed = seed
        self.sequences: dict[tuple[int, ...], list[int]] = {}  # prompt -> prompt + continuation
        self.stats = OracleStats()
        self._rows: dict[tuple[int, ...], torch.Tensor] = {}  # the sequences as tensors (chain uploads)
        self._survival: dict[tuple, torch.Tensor] = {}
        self._keys: dict[tuple[int, ...], int] = {}

    @property
    def name(self) -> str:
        return self.profile.name

    def record(self, prompt_ids, output_ids) -> None:
        """Keep a greedy continuation (the longest seen for the prompt)."""
        key = tuple(int(t) for t in prompt_ids)
        seq = list(key) + [int(t) for t in output_ids]
        if len(seq) > len(self.sequences.get(key, ())):
            self.sequences[key] = seq

    def record_outputs(self, outputs) -> None:
        for o in outputs:
            self.record(o.prompt_token_ids, o.token_ids)

    def key(self, prompt_ids) -> int:
        """The request's hash key: its prompt's (and the oracle's seed)."""
        prompt = tuple(prompt_ids)
        if prompt not in self._keys:
            crc = zlib.crc32(array("q", [int(t) for t in prompt]).tobytes())
            self._keys[prompt] = (crc ^ (self.seed * 0x9E3779B97F4A7C15)) & 0x3FFFFFFFFFFFFFFF
        return self._keys[prompt]

    def drafts(self, requests, starts: list[int], num_drafts: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[n, G]`` drafts of the blocks at ``starts`` (the position of each
        block's last token), and ``[n]`` bool: the rows the oracle drafts
        (the others keep the drafter's: unrecorded prompts, sampled rows,
        requests that left the recording)."""
        n, G = len(requests), num_drafts
        rec = torch.zeros(n, G, dtype=torch.int64)
        use = torch.zeros(n, dtype=torch.bool)
        keys = torch.zeros(n, dtype=torch.int64)
        for s, (r, p) in enumerate(zip(requests, starts)):
            seq = self._follows(r, p)
            if seq is None:
                continue
            ahead = seq[p + 1 : p + 1 + G]
            rec[s, : len(ahead)] = torch.tensor(ahead, dtype=torch.int64)
            use[s] = True
            keys[s] = self.key(r.prompt_token_ids)
        k = self.profile.accept_counts(keys, torch.tensor(starts, dtype=torch.int64), G)
        out = torch.where(torch.arange(G)[None, :] < k[:, None], rec, (rec + 1) % self.vocab_size)
        st = self.stats
        st.steps += int(use.sum())
        st.correct_drafts += int(k[use].sum())
        return out, use

    def _follows(self, r, p: int) -> list[int] | None:
        """The recorded sequence of request ``r`` if the oracle drafts its
        block at ``p`` (counting the rows it does not draft)."""
        st = self.stats
        if not r.params.greedy:
            st.sampled += 1
            return None
        seq = self.sequences.get(tuple(r.prompt_token_ids))
        if seq is None:
            st.unrecorded += 1
            return None
        if r.request_id in st.diverged:
            return None
        if p >= len(seq):  # past the recording (a longer max_tokens than pass 1's)
            st.unrecorded += 1
            return None
        tokens = r.all_token_ids
        # (A chain launched from a prefill opens with a token the host has
        # not read yet: the device checks it.)
        if p < len(tokens) and seq[p] != tokens[p]:
            st.diverged.add(r.request_id)
            return None
        return seq

    # ----------------------------------------- asynchronous step graphs
    # A chain's first step uploads, per row, the recorded sequence, the
    # hash key and whether the oracle drafts the row; every step of the
    # chain drafts on the device from the row's block start (step_parts.py),
    # with the same draws as a synchronous step at that position.
    @staticmethod
    def _device_key(device) -> str:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return str(device)

    def prepare(self, device, num_drafts: int) -> None:
        """Make the profile's tensor on ``device`` before a graph is captured."""
        key = (self._device_key(device), num_drafts)
        if key not in self._survival:
            self._survival[key] = torch.tensor(self.profile.survival_for(num_drafts), dtype=torch.float64,
                                               device=device)

    def chain_inputs(self, requests, starts: list[int]) -> dict[str, torch.Tensor]:
        """``oracle_seq`` ``[S, L]`` (zero-padded), ``oracle_key`` ``[S]``,
        ``oracle_use`` ``[S]`` for a chain's first step."""
        rows, keys, use = [], [], []
        for r, p in zip(requests, starts):
            seq = self._follows(r, p)
            prompt = tuple(r.prompt_token_ids)
            if seq is not None and prompt not in self._rows:
                self._rows[prompt] = torch.tensor(seq, dtype=torch.int64)
            rows.append(self._rows[prompt] if seq is not None else torch.zeros(1, dtype=torch.int64))
            keys.append(self.key(prompt) if seq is not None else 0)
            use.append(seq is not None)
        return {"oracle_seq": torch.nn.utils.rnn.pad_sequence(rows, batch_first=True),
                "oracle_key": torch.tensor(keys, dtype=torch.int64), "oracle_use": torch.tensor(use)}

    def device_drafts(self, bufs: dict, n: int, start: torch.Tensor, last: torch.Tensor,
                      drafts: torch.Tensor) -> torch.Tensor:
        """Inside a step graph: the drafts ``[n, G]`` of rows whose blocks
        open with ``last`` at ``start``; rows the oracle does not draft (or
        whose token at ``start`` left the recording) keep ``drafts``."""
        G, dev = drafts.shape[1], drafts.device
        seq = bufs["oracle_seq"][:n]
        L = seq.shape[1]
        use = bufs["oracle_use"][:n] & (seq.gather(1, start.clamp(max=L - 1)[:, None])[:, 0] == last)
        cols = torch.arange(G, device=dev)[None, :]
        rec = seq.gather(1, (start[:, None] + 1 + cols).clamp(max=L - 1))
        # Made by prepare() before the graph (a copy inside a capture would fail).
        survival = self._survival[(self._device_key(dev), G)]
        k = self.profile.accept_counts(bufs["oracle_key"][:n], start, G, survival)
        mine = torch.where(cols < k[:, None], rec, (rec + 1) % self.vocab_size)
        return torch.where(use[:, None], mine, drafts)


class OracleProposer:
    """``propose`` of a drafter in oracle mode: the drafter's real forward
    (and sampling), then the oracle's drafts in place of its tokens."""

    def __init__(self, propose, oracle: Oracle):
        self.propose = propose
        self.oracle = oracle

    def __call__(self, batch: DraftBatch) -> DraftOutput:
        out = self.propose(batch)
        if batch.requests is None or out.tree is not None:  # a restarted drafter, or a tree: its own drafts
            self.oracle.stats.unrecorded += batch.block_ids.shape[0]
            return out
        tokens, use = self.oracle.drafts(batch.requests, batch.ctx_lens.tolist(), out.tokens.shape[1])
        if bool(use.any()):
            dev = out.tokens.device
            tokens = torch.where(use.to(dev)[:, None], tokens.to(dev, non_blocking=True), out.tokens)
            return DraftOutput(tokens, out.draft_idx, out.draft_q, None)
        return out


def oracle_unsupported(engine) -> str | None:
    """Why ``engine`` (an in-process EngineCore) cannot run in oracle mode,
    or None."""
    if engine.drafter is None:
        return "needs a drafter (its forward runs at its real shape)"
    if engine.drafter_apart():
        return "needs the drafter in this process (the in-process backend)"
    if engine.tree is not None:
        return "drafts chains only: build the engine with draft_tree=False"
    if engine.config.prompt_lookup_min:
        return "prompt lookups replace drafts: build the engine with prompt_lookup_min=0"
    if engine._step_graphs:
        return "must be installed before the engine's first step graphs are built"
    return None


def install_oracle(engine, oracle: Oracle) -> None:
    """Oracle mode for an in-process EngineCore built with
    ``ORACLE_ENGINE_SETTINGS`` (raises ConfigError naming what is missing)."""
    reason = oracle_unsupported(engine)
    if reason:
        raise ConfigError(f"oracle acceptance {reason}")
    drafter = engine.drafter
    # A fault guard keeps the patch (it runs inside the guard); the rows'
    # requests come with each DraftBatch (step_batch.py) for a drafter
    # that asks.
    drafter.propose = OracleProposer(drafter.propose, oracle)
    drafter.wants_requests = True
    # Asynchronous steps: the step graphs built from now on draft on the
    # device from each row's recorded sequence (step_parts.propose).
    drafter.oracle = oracle
    engine.oracle = oracle
