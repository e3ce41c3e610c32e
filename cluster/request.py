"""A request's life on the control plane, and what users get back."""

from __future__ import annotations

import dataclasses
import enum
import time
from dataclasses import dataclass, field

from specray.actors.kv_cache import BlockTable
from specray.prompt_lookup import NgramIndex
from specray.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"  # prefilling or decoding
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    """Speculative-decoding and latency figures of one request.

    ``acceptance_lengths`` has one entry per decode step: tokens that step
    produced (accepted drafts + 1), the DFlash paper's definition."""

    acceptance_lengths: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0  # drafts proposed and verified
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_lookup_steps: int = 0  # decode steps drafted by prompt lookup (with trees: holding a lookup branch)

    @property
    def mean_acceptance_length(self) -> float:
        a = self.acceptance_lengths
        return sum(a) / len(a) if a else 0.0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    def record_step(self, num_drafts: int, num_accepted: int, produced: int) -> None:
        self.acceptance_lengths.append(produced)
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_drafts:
            self.accepted_per_position.extend([0] * (num_drafts - len(self.accepted_per_position)))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1


@dataclass
class TokenLogprobs:
    """One generated token's log probability under the target, and the
    ``SamplingParams.logprobs`` most likely tokens at its position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, log probability), most likely first


@dataclass
class RequestOutput:
    """Everything generated so far for one request; ``delta_*`` holds what
    is new since the previous output of the same request."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None
    metrics: RequestMetrics
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    stop_reason: int | str | None = None  # the stop token id or stop string hit
    error: str | None = None  # finish_reason "error": the failed step's traceback
    # finish_reason "error": "request" (this request failed alone), "timeout"
    # (its deadline passed), "engine" (the engine failed under it: retry)
    error_kind: str | None = None
    # Where ``SamplingParams.logprobs`` asked for them: the entries of
    # ``delta_token_ids`` on every output, and of all of ``token_ids`` on the
    # finished one (None before it).
    delta_logprobs: list[TokenLogprobs] | None = None
    logprobs: list[TokenLogprobs] | None = None


def engine_times(outs: list[RequestOutput]) -> dict | None:
    """When the engine took the request, sent its first token and ended
    it: seconds of CLOCK_MONOTONIC on the engine's host (``time.monotonic``),
    so a client on that host can tell its transport's time from the
    engine's (``specray bench serve``; the ``specray`` field of a
    response carries them); None until it ends."""
    m = [o.metrics for o in outs]
    if not m or any(x.finished_time is None for x in m):
        return None
    firsts = [x.first_token_time for x in m if x.first_token_time is not None]
    return {"arrival": min(x.arrival_time for x in m), "first_token": min(firsts) if firsts else None,
            "finished": max(x.finished_time for x in m)}


def take_queued(out: RequestOutput, queue) -> tuple[RequestOutput, BaseException | None]:
    """``out`` merged with the outputs of its request already waiting in the
    asyncio ``queue`` (a stream that fell behind sends them as one), and an
    error met there (the stream's next item)."""
    while not out.finished and not queue.empty():
        item = queue.get_nowait()
        if isinstance(item, BaseException):
            return out, item
        out = merge_outputs(out, item)
    return out, None


def merge_outputs(first: RequestOutput, later: RequestOutput) -> RequestOutput:
    """One output of a request standing for two in a row: ``later``, its
    deltas extended by ``first``'s."""
    lps = None if first.delta_logprobs is None and later.delta_logprobs is None else \
        (first.delta_logprobs or []) + (later.delta_logprobs or [])
    return dataclasses.replace(later, delta_text=first.delta_text + later.delta_text,
                               delta_token_ids=first.delta_token_ids + later.delta_token_ids, delta_logprobs=lps)


def coalesce(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """One output a request, where ``outputs`` hold several of it (at the
    place of its last): a consumer that fell behind the engine (a server
    streaming to many clients) catches up in one chunk, not one a step."""
    last = {o.request_id: i for i, o in enumerate(outputs)}
    if len(last) == len(outputs):
        return list(outputs)
    merged: dict[str, RequestOutput] = {}
    out = []
    for i, o in enumerate(outputs):
        prev = merged.get(o.request_id)
        merged[o.request_id] = o if prev is None else merge_outputs(prev, o)
        if last[o.request_id] == i:
            out.append(merged[o.request_id])
    return out


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    eos_token_ids: tuple[int, ...]
    status: Status = Status.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # Positions whose target KV (and drafter context) are valid. While
    # decoding, exactly the tokens before the last one.
    num_computed: int = 0
    target_blocks: BlockTable | None = None
    draft_blocks: BlockTable | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per output token, when asked for
    lookup_index: NgramIndex | None = None  # prompt-lookup drafts (prompt_lookup.py), built on first use
    # time.monotonic() of the step loop's process past which it fails (faults.py)
    deadline: float | None = None
    timeout_s: float | None = None
    # Its row of the async step graphs' token history, and how many of its
    # tokens that row holds for sure (step_buffers.HistorySlots).
    history_slot: int | None = None
    history_on_device: int = 0
    # The first position whose drafter context a resting drafter skipped
    # (drafter_rest.py); None: stored through num_computed.
    context_gap_from: int | None = None
    # Detokenizer state (see detokenizer.py).
    text: str = ""
    sent_text_len: int = 0
    sent_token_len: int = 0
    detok_prefix_offset: int = 0
    detok_read_offset: int = 0

    def __post_init__(self):
        self.metrics.arrival_time = time.monotonic()

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_from(self, start: int) -> list[int]:
        """``all_token_ids[start:]``, without copying the prompt where the
        slice starts past it (the detokenizer's window, every step)."""
        n = len(self.prompt_token_ids)
        if start >= n:
            return self.output_token_ids[start - n :]
        return self.prompt_token_ids[start:] + self.output_token_ids

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def prefill_len(self) -> int:
        """Positions to compute before decoding starts: the whole prompt, or
        after preemption everything but the last token (already sampled)."""
        return self.num_tokens - 1 if self.output_token_ids else len(self.prompt_token_ids)

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed < self.prefill_len

    @property
    def finished(self) -> bool:
        return self.status == Status.FINISHED

    @property
    def stop_token_ids(self) -> set[int]:
        ids = set(self.params.stop_token_ids)
        if not self.params.ignore_eos:
            ids.update(self.eos_token_ids)
        return ids

    @property
    def min_tokens_left(self) -> int:
        """Tokens still to generate before a stop may end the request."""
        return max(0, self.params.min_tokens - len(self.output_token_ids))

    @property
    def reads_verify_rows(self) -> bool:
        """Whether a step must walk this request's verify rows on the host
        as a chain (min_tokens' mask, log probabilities, penalties): work of
        synchronous steps, over chains, not draft trees."""
        return bool(self.min_tokens_left) or self.params.logprobs is not None or self.params.penalized


class PromptTooLong(ValueError):
    """A prompt that leaves no room to generate within max_model_len (the
    serving layer answers it with OpenAI's ``context_length_exceeded``)."""


def check_prompt_length(prompt, max_model_len: int, max_prompt_chars: float) -> None:
    """Raise PromptTooLong for a prompt its length alone rules out: token ids
    that leave no room to generate, or a text longer than ``max_prompt_chars``
    (more characters than ``max_model_len - 1`` tokens can spell)."""
    if isinstance(prompt, str):
        if len(prompt) > max_prompt_chars:
            raise PromptTooLong(
                f"prompt has {len(prompt)} characters, more than {max_model_len - 1} tokens can spell "
                f"(max_model_len {max_model_len}, minus one token to generate)"
            )
    elif len(prompt) >= max_model_len:
        raise PromptTooLong(
            f"prompt has {len(prompt)} tokens; this model takes at most {max_model_len - 1} "
            f"(max_model_len {max_model_len}, minus one token to generate)"
        )


class PromptsRefused(ValueError):
    """Some prompts of a batch were refused, so none of it ran: ``refused``
    holds (index in the batch, reason) for each."""

    def __init__(self, refused: list[tuple[int, str]]):
        self.refused = refused
        shown = "; ".join(f"prompt {i}: {why}" for i, why in refused[:5])
        more = f" (and {len(refused) - 5} more)" if len(refused) > 5 else ""
        super().__init__(f"{len(refused)} prompt(s) refused, nothing generated{more}: {shown}")
