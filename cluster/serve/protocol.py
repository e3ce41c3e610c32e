"""OpenAI wire format: request models, validation, response and chunk
builders, and errors in OpenAI's shape.

Only the fields specray implements are accepted. Fields OpenAI defines but
specray does not implement get a 400 that names them (``best_of``,
``tools``, ...); unknown fields get OpenAI's own
"Unrecognized request argument" 400. Extensions (vLLM's names): ``top_k``,
``ignore_eos``, ``stop_token_ids``, ``min_tokens``, ``repetition_penalty``,
``return_token_ids``, and ``timeout`` (seconds).
Log probabilities are vLLM's raw ones: the model's distribution before
temperature, top-k / top-p and the min_tokens mask.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from specray.request import PromptTooLong, RequestOutput, TokenLogprobs
from specray.sampling import MAX_LOGPROBS, SamplingParams


# ------------------------------------------------------------------ errors
class APIError(Exception):
    """An error with an HTTP status, rendered as OpenAI's error JSON."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def unsupported(param: str, detail: str) -> APIError:
    return APIError(400, f"'{param}' is not supported by this server: {detail}", "invalid_request_error",
                    param, "unsupported_parameter")


_TYPE_TAG = re.compile(r"(str|int|float|bool|none|list\[.*\]|dict\[.*\]|function-.*)")


def from_validation_error(e: ValidationError | list[dict]) -> APIError:
    """The first pydantic error as an OpenAI 400."""
    errors = e if isinstance(e, list) else e.errors()
    err = errors[0]
    # pydantic names the member of a union each error is about ("prompt.str"):
    # the client sent one field, not a type; the members' messages go together.
    param = _param(err)
    msgs = [x.get("msg", "") for x in errors if _param(x) == param]
    if err.get("type") == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: {param}", "invalid_request_error",
                        param, "unrecognized_argument")
    if err.get("type") == "missing":
        return bad_request(f"Missing required parameter: '{param}'.", param, "missing_required_parameter")
    msg = err.get("msg", "invalid value")
    for other in dict.fromkeys(msgs[1:]):
        if other != msg:
            msg += " or " + other.removeprefix("Input should be ")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    got = err.get("input")
    shown = _shown(got)
    return bad_request(f"Invalid value for '{param}': {msg} (got {shown}).", param, "invalid_value")


def _param(err: dict) -> str | None:
    return ".".join(str(p) for p in err.get("loc", ()) if not _TYPE_TAG.fullmatch(str(p))) or None


def _shown(x) -> str:
    # A value nested to the parser's depth limit, walked again a few frames
    # deeper, overflows the stack: that must stay a 400 (it was a 500).
    for show in (json.dumps, repr):
        try:
            return show(x)[:200]
        except (TypeError, ValueError, RecursionError):
            continue
    return f"a {type(x).__name__} nested too deeply to show"


def prompt_error(e: ValueError, param: str) -> APIError:
    """The engine's refusal of a prompt (too long, empty, ids outside the
    vocabulary) as a 400 with OpenAI's codes."""
    return bad_request(str(e), param, "context_length_exceeded" if isinstance(e, PromptTooLong) else "invalid_value")


def sampling_error(e: ValueError) -> APIError:
    """SamplingParams' messages start with the parameter's name."""
    msg = str(e)
    first = msg.split(" ", 1)[0]
    param = first if first in {"max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                               "stop_token_ids", "min_tokens", "logprobs", "presence_penalty",
                               "frequency_penalty", "repetition_penalty"} else None
    return bad_request(msg, param, "invalid_value")


# ---------------------------------------------------------------- requests
# A \uD800-\uDFFF escape: half of a surrogate pair, or a lone one, which no
# UTF-8 text (the tokenizer's input, the response) can hold.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def parse_json(raw: bytes) -> Any:
    """The request body as JSON, or a 400 saying why not."""
    try:
        # Strict decoding: json.loads(bytes) would let encoded surrogates through.
        text = raw.decode(json.detect_encoding(raw)) if raw else "null"
        body = json.loads(text)
    except (ValueError, RecursionError) as e:  # not JSON / not Unicode (ValueErrors); nested too deep
        raise bad_request(f"We could not parse the JSON body of your request ({type(e).__name__}: {e}). "
                          "The body must be valid JSON.", None, "invalid_json") from None
    # Decoded strictly, only an escape can have made a lone surrogate.
    if _SURROGATE_ESCAPE.search(text):
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise bad_request("The request body contains invalid Unicode: an unpaired surrogate escape "
                              "(\\ud800-\\udfff without its pair).", None, "invalid_unicode") from None
        except RecursionError:
            raise bad_request("We could not parse the JSON body of your request: it is nested too deeply.", None,
                              "invalid_json") from None
    return body


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's; accepted, only False


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False  # OpenAI's schema allows null (= false)
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored
    store: bool | None = None  # accepted and ignored (vLLM does the same)
    metadata: dict[str, str] | None = None  # accepted and ignored
    service_tier: str | None = None  # accepted and ignored
    # extensions
    top_k: int | None = Field(None, ge=-1)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    min_tokens: int | None = Field(None, ge=0)
    return_token_ids: bool = False
    # seconds the request may take (the server's request_timeout_s caps it)
    timeout: float | None = Field(None, gt=0, allow_inf_nan=False)
    # OpenAI fields accepted only at their neutral value (checked below)
    n: int | None = None
    best_of: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    def _check_common(self) -> None:
        if self.n is not None and self.n < 1:
            raise bad_request(f"n must be at least 1, got {self.n}", "n", "invalid_value")
        if self.best_of not in (None, 1):
            raise unsupported("best_of", "only best_of=1 is supported")
        if self.logit_bias:
            raise unsupported("logit_bias", "logit bias is not implemented")
        if self.stream_options is not None:
            if not self.stream:
                raise bad_request("The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                                  "stream_options")
            if self.stream_options.continuous_usage_stats:
                raise unsupported("stream_options.continuous_usage_stats", "only the final usage chunk is sent")
        if isinstance(self.stop, list) and not all(isinstance(s, str) for s in self.stop):
            raise bad_request("stop must be a string or a list of strings", "stop")

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def num_logprobs(self) -> int | None:
        """``SamplingParams.logprobs``: None, or how many alternatives."""
        return None

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=self.top_k or 0,
                seed=self.seed,
                stop=self.stop,
                stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos,
                min_tokens=self.min_tokens or 0,
                logprobs=self.num_logprobs(),
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            )
        except ValueError as e:
            raise sampling_error(e) from None


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError("batches of several prompts are not supported: send one request per prompt")
            v = v[0]
        if isinstance(v, list) and not v:
            raise ValueError("prompt is empty")
        return v

    def check(self) -> None:
        self._check_common()
        if self.echo:
            raise unsupported("echo", "echoing the prompt is not implemented")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad_request(f"logprobs must be from 0 to {MAX_LOGPROBS}, got {self.logprobs}", "logprobs",
                              "invalid_value")
        if self.suffix:
            raise unsupported("suffix", "insertion (suffix) is not implemented")

    def num_logprobs(self) -> int | None:
        return self.logprobs  # 0 still asks for the sampled tokens' own

    def max_new_tokens(self) -> int:
        return self.max_tokens or 16  # OpenAI's default for completions


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict] | None = None
    name: str | None = None

    @field_validator("role")
    @classmethod
    def _role(cls, v):
        if v not in ("system", "developer", "user", "assistant"):
            raise ValueError("role must be one of system, developer, user, assistant")
        return v

    def text(self, i: int) -> str:
        # Clients send an earlier response's message back as it came
        # (``refusal: null``, ``tool_calls: []``, ...): empty fields are no request.
        extra = {k for k, v in (self.model_extra or {}).items() if v not in (None, "", [], {})}
        if extra:
            field = sorted(extra)[0]
            raise unsupported(f"messages.{i}.{field}", "tool calls and other message fields are not implemented")
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        out = []
        for j, part in enumerate(self.content):
            if part.get("type") != "text":
                raise unsupported(f"messages.{i}.content.{j}.type",
                                  f"content part type {part.get('type')!r} (only 'text' parts are accepted)")
            try:
                out.append(TextPart.model_validate(part).text)
            except ValidationError as e:
                raise bad_request(f"messages.{i}.content.{j}: {e.errors()[0]['msg']}",
                                  f"messages.{i}.content.{j}") from None
        return "\n".join(out)  # vLLM's separator: the same parts make the same prompt


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict | None = None

    def check(self) -> None:
        self._check_common()
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise bad_request(f"top_logprobs must be from 0 to {MAX_LOGPROBS}, got {self.top_logprobs}",
                                  "top_logprobs", "invalid_value")
            if self.top_logprobs and not self.logprobs:
                raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs", "invalid_value")
        if self.tools or self.functions:
            raise unsupported("tools" if self.tools else "functions", "tool / function calling is not implemented")
        if self.tool_choice not in (None, "none") or self.function_call not in (None, "none"):
            raise unsupported("tool_choice" if self.tool_choice not in (None, "none") else "function_call",
                              "tool / function calling is not implemented")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise unsupported("response_format", f"type {self.response_format.get('type')!r} (only 'text')")

    def chat_messages(self) -> list[dict]:
        out = []
        for i, m in enumerate(self.messages):
            role = "system" if m.role == "developer" else m.role
            out.append({"role": role, "content": m.text(i)})
        return out

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def max_new_tokens(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default


def _integral(x, depth: int = 0):
    """Integral floats as ints, in the body's fields and their lists
    (prompt ids, a batch of one)."""
    if isinstance(x, float) and x.is_integer():
        return int(x)
    if isinstance(x, list) and depth < 3:
        return [_integral(v, depth + 1) for v in x]
    if isinstance(x, dict) and depth == 0:
        return {k: _integral(v, 1) for k, v in x.items()}
    return x


def parse(model_cls, body: Any):
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    try:
        # Strict: JSON's types as the schema has them; lax pydantic read
        # true as the token id 1, "5" as 5 and 1 as true. JSON has one
        # number type: 5.0 is the integer 5 (JSON Schema's rule, and what
        # clients that compute max_tokens as a float send).
        req = model_cls.model_validate(_integral(body), strict=True)
    except ValidationError as e:
        raise from_validation_error(e) from None
    req.check()
    return req


# --------------------------------------------------------------- responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice ``index`` of ``n``: its own stream of random numbers where a
    seed is given (``seed + index``, vLLM's rule), a fresh one where not."""
    if params.seed is None or index == 0:
        return params
    return dataclasses.replace(params, seed=(params.seed + index + 2**63) % 2**64 - 2**63)


def finish_reason(out: RequestOutput) -> str | None:
    return out.finish_reason if out.finish_reason in ("stop", "length") else None


def _last_line(text: str | None) -> str:
    lines = [line for line in (text or "").strip().splitlines() if line.strip()]
    return lines[-1].strip()[:300] if lines else ""


def output_error(out: RequestOutput) -> APIError:
    """The error of a request the engine ended without a finish reason: 503
    where the engine failed under it (a lost worker, a shutdown: retry), 504
    for its timeout, 500 where it failed alone."""
    kind = out.error_kind or ("engine" if out.finish_reason == "abort" else "request")
    if kind == "engine":
        return APIError(503, "The engine lost a worker while generating this request; retry it. "
                             f"({_last_line(out.error) or out.finish_reason})", "server_error", None,
                        "engine_unavailable")
    if kind == "timeout":
        return APIError(504, _last_line(out.error) or "the request timed out", "server_error", None, "timeout")
    return APIError(500, f"This request failed inside the engine: {_last_line(out.error)}", "server_error", None,
                    "request_failed")


def exception_error(e: BaseException) -> APIError:
    """What a failed engine stream raised, as the API's error."""
    from specray.async_engine import RequestTimeout
    from specray.faults import EngineUnavailable

    if isinstance(e, EngineUnavailable):
        return APIError(503, f"The engine is unavailable; retry the request. ({_last_line(str(e))})", "server_error",
                        None, "engine_unavailable")
    if isinstance(e, RequestTimeout):
        return APIError(504, str(e), "server_error", None, "timeout")
    return APIError(500, str(e), "server_error")


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
                 logprobs: list[LogprobWriter | None]):
        self.chat = kind == "chat"
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
        if not out.finished:
            if self._has_news(index, out):
                chunks.append(sse(self._chunk([self._choice(index, out.delta_text, out.delta_token_ids, None,
                                                            entries)])))
            return chunks
        reason = finish_reason(out)
        if reason is None:  # aborted or failed inside the engine: an error event ends the stream
            chunks.append(sse(output_error(out).body()))
            return chunks
        if self.chat and self._has_news(index, out):
            # content first, then an empty delta carrying the finish reason
            chunks.append(sse(self._chunk([self._choice(index, out.delta_text, out.delta_token_ids, None,
                                                        entries)])))
            chunks.append(sse(self._chunk([self._choice(index, None, [], reason)], specray=spec_stats([out]))))
        else:
            chunks.append(sse(self._chunk([self._choice(index, out.delta_text, out.delta_token_ids, reason,
                                                        entries)], specray=spec_stats([out]))))
        return chunks

    def end(self, outs: list[RequestOutput]) -> list[bytes]:
        """After every choice finished: the usage chunk (when asked for), then [DONE]."""
        chunks = [sse(self._chunk([], usage=usage(outs)))] if self.include_usage else []
        return chunks + [sse("[DONE]")]
