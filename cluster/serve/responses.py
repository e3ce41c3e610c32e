"""OpenAI's response bodies and streaming chunks, built from the engine's
``RequestOutput``s, with the ``specray`` extension field (speculative
decoding figures)."""

from __future__ import annotations

import json
import time

from specray.request import RequestOutput, TokenLogprobs, engine_times
from specray.serve.errors import output_error


def finish_reason(out: RequestOutput) -> str | None:
    return out.finish_reason if out.finish_reason in ("stop", "length") else None

def usage(outs: list[RequestOutput]) -> dict:
    """One prompt, every choice's tokens (OpenAI's count for ``n`` > 1)."""
    p, c = len(outs[0].prompt_token_ids), sum(len(o.token_ids) for o in outs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def spec_stats(outs: list[RequestOutput]) -> dict:
    """The ``specray`` extension field: speculative decoding figures (of
    all choices together: their steps in choice order)."""
    steps = [a for o in outs for a in o.metrics.acceptance_lengths]
    drafted = [o for o in outs if o.metrics.num_draft_tokens]
    per_pos: list[int] = []
    for o in outs:
        for i, c in enumerate(o.metrics.accepted_per_position):
            per_pos.extend([0] * (i + 1 - len(per_pos)))
            per_pos[i] += c
    ttfts = [o.metrics.ttft for o in outs if o.metrics.ttft is not None]
    return {
        "mean_acceptance_length": round(sum(steps) / len(steps), 4) if steps else 0.0,
        "acceptance_lengths": steps,
        "num_drafts": sum(len(o.metrics.acceptance_lengths) for o in drafted),
        "num_draft_tokens": sum(o.metrics.num_draft_tokens for o in outs),
        "num_accepted_tokens": sum(o.metrics.num_accepted_tokens for o in outs),
        "accepted_per_position": per_pos,
        "ttft_s": round(min(ttfts), 6) if ttfts else None,
        "engine_times": engine_times(outs),
    }


def _response(rid: str, model: str, obj: str, choices: list[dict], outs: list[RequestOutput],
              return_token_ids: bool) -> dict:
    body = {"id": rid, "object": obj, "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage(outs), "system_fingerprint": None, "specray": spec_stats(outs)}
    if return_token_ids:
        for choice, out in zip(choices, outs):
            choice["token_ids"] = list(out.token_ids)
        body["prompt_token_ids"] = list(outs[0].prompt_token_ids)
    return body


class LogprobWriter:
    """OpenAI's ``logprobs`` objects for one choice's tokens: chat's
    ``{"content": [...]}`` or the completions API's parallel lists (whose
    ``text_offset`` runs on across a stream's chunks). A token's text is its
    id decoded alone, as vLLM reports it (a piece of a multi-byte character
    reads as U+FFFD); without a tokenizer, vLLM's ``token_id:N``."""

    def __init__(self, tokenizer, chat: bool):
        self.tokenizer, self.chat = tokenizer, chat
        self.text_offset = 0

    def _text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    @staticmethod
    def _value(logprob: float) -> float:
        return max(logprob, -9999.0)  # JSON has no -inf; OpenAI's floor

    def _chat_entry(self, token_id: int, logprob: float) -> dict:
        text = self._text(token_id)
        return {"token": text, "logprob": self._value(logprob), "bytes": list(text.encode("utf-8"))}

    def render(self, entries: list[TokenLogprobs]) -> dict:
        if self.chat:
            return {"content": [{**self._chat_entry(e.token_id, e.logprob),
                                 "top_logprobs": [self._chat_entry(t, v) for t, v in e.top]} for e in entries],
                    "refusal": None}
        tokens, offsets, tops = [], [], []
        for e in entries:
            text = self._text(e.token_id)
            tokens.append(text)
            offsets.append(self.text_offset)
            self.text_offset += len(text)
            # The sampled token is always there, so up to k + 1 entries (OpenAI's rule).
            top = {self._text(t): self._value(v) for t, v in e.top}
            top.setdefault(text, self._value(e.logprob))
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": [self._value(e.logprob) for e in entries],
                "top_logprobs": tops, "text_offset": offsets}


def completion_response(rid: str, model: str, outs: list[RequestOutput], return_token_ids: bool,
                        logprobs: list[LogprobWriter | None]) -> dict:
    choices = [{"index": i, "text": out.text, "logprobs": lp.render(out.logprobs) if lp else None,
                "finish_reason": finish_reason(out)} for i, (out, lp) in enumerate(zip(outs, logprobs))]
    return _response(rid, model, "text_completion", choices, outs, return_token_ids)


def chat_response(rid: str, model: str, outs: list[RequestOutput], return_token_ids: bool,
                  logprobs: list[LogprobWriter | None]) -> dict:
    choices = [{"index": i, "message": {"role": "assistant", "content": out.text, "refusal": None},
                "logprobs": lp.render(out.logprobs) if lp else None, "finish_reason": finish_reason(out)}
               for i, (out, lp) in enumerate(zip(outs, logprobs))]
    return _response(rid, model, "chat.completion", choices, outs, return_token_ids)


def sse(data: dict | str) -> bytes:
    if isinstance(data, str):
        return f"data: {data}\n\n".encode()
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


class ChunkWriter:
    """OpenAI's streaming chunks for one request (chat or completion) and
    its choices, each chunk naming its choice's index."""

    def __init__(self, kind: str, rid: str, model: str, include_usage: bool, return_token_ids: bool,
                 logprobs: list[LogprobWriter | None], received: float | None = None):
        self.chat = kind == "chat"
        # When the replica took the request, saw its first tokens and its end
        # (time.monotonic): the last chunk's ``specray.replica_times``, which
        # split the transport's legs at the replica (``specray bench serve``).
        self.replica_times = None if received is None else {"received": received}
        self.rid, self.model = rid, model
        self.include_usage, self.return_token_ids = include_usage, return_token_ids
        self.logprobs = logprobs  # one per choice
        self.created = int(time.time())
        self.sent_role = [False] * len(logprobs)

    def _chunk(self, choices: list, **extra) -> dict:
        body = {"id": self.rid, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "system_fingerprint": None, "choices": choices}
        if self.include_usage:
            body["usage"] = None
        body.update(extra)
        return body

    def _choice(self, index: int, text: str | None, token_ids: list[int], reason: str | None,
                entries: list[TokenLogprobs] | None = None) -> dict:
        lp = self.logprobs[index]
        logprobs = lp.render(entries) if lp and entries else None
        if self.chat:
            delta: dict = {}
            if not self.sent_role[index]:
                delta = {"role": "assistant", "content": ""}
                self.sent_role[index] = True
            if text:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": reason}
        if self.return_token_ids:
            choice["token_ids"] = list(token_ids)
        return choice

    def _has_news(self, index: int, out: RequestOutput) -> bool:
        # A token whose text is held back (a stop string's prefix, half a
        # character) still brings its ids and log probabilities.
        return bool(out.delta_text or (out.delta_token_ids and (self.return_token_ids or self.logprobs[index])))

    def start(self) -> list[bytes]:
        """Chat streams open each choice with the assistant role (as OpenAI's do)."""
        if self.chat:
            return [sse(self._chunk([self._choice(i, None, [], None)])) for i in range(len(self.logprobs))]
        return []

    def delta(self, index: int, out: RequestOutput) -> list[bytes]:
        """Choice ``index``'s chunks for ``out``; the last one (finished)
        carries its finish reason and speculative figures. A choice that
        ended early gets an error event, and the stream ends there (no
        ``[DONE]``: the stream did not complete)."""
        chunks = []
        entries = out.delta_logprobs if self.logprobs[index] else None
        times = self.replica_times
        if times is not None:
            if out.delta_token_ids:
                times.setdefault("first_output", time.monotonic())
            if out.finished:
                times["finished_output"] = time.monotonic()
        if not out.finished:
            if self._has_news(index, out):
                chunks.append(sse(self._chunk([self._choice(index, out.delta_text, out.delta_token_ids, None,
                                                            entries)])))
            return chunks
        reason = finish_reason(out)
        if reason is None:  # aborted or failed inside the engine: an error event ends the stream
            chunks.append(sse(output_error(out).body()))
            return chunks
        stats = spec_stats([out])
        if times is not None:
            stats["replica_times"] = dict(times)
        if self.chat and self._has_news(index, out):
            # content first, then an empty delta carrying the finish reason
            chunks.append(sse(self._chunk([self._choice(index, out.delta_text, out.delta_token_ids, None,
                                                        entries)])))
            chunks.append(sse(self._chunk([self._choice(index, None, [], reason)], specray=stats)))
        else:
            chunks.append(sse(self._chunk([self._choice(index, out.delta_text, out.delta_token_ids, reason,
                                                        entries)], specray=stats)))
        return chunks

    def end(self, outs: list[RequestOutput]) -> list[bytes]:
        """After every choice finished: the usage chunk (when asked for), then [DONE]."""
        chunks = [sse(self._chunk([], usage=usage(outs)))] if self.include_usage else []
        return chunks + [sse("[DONE]")]
