"""OpenAI wire format: request models and their validation (and, re-exported,
errors in OpenAI's shape and the response and chunk builders).

Only the fields specray implements are accepted. Fields OpenAI defines but
specray does not implement get a 400 that names them (``best_of``,
``tools``, ...); unknown fields get OpenAI's own
"Unrecognized request argument" 400. Extensions (vLLM's names): ``top_k``,
``ignore_eos``, ``stop_token_ids``, ``min_tokens``, ``repetition_penalty``,
``return_token_ids``, and ``timeout`` (seconds).
Log probabilities are vLLM's raw ones: the model's distribution before
temperature, top-k / top-p and the min_tokens mask.

Errors (``specray.serve.errors``) and response bodies / stream chunks
(``specray.serve.responses``) live apart, each its own job; they are
re-exported here so that ``protocol`` stays the one name the front ends
(HTTP, gRPC, OpenAPI) use for the wire format.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from specray.sampling import MAX_LOGPROBS, SamplingParams
from specray.serve.errors import (
    APIError,
    bad_request,
    exception_error,
    from_validation_error,
    output_error,
    prompt_error,
    sampling_error,
    unsupported,
)
from specray.serve.responses import (
    ChunkWriter,
    LogprobWriter,
    chat_response,
    completion_response,
    finish_reason,
    spec_stats,
    sse,
    usage,
)

__all__ = [
    # requests
    "parse_json", "parse", "StreamOptions", "CompletionRequest", "ChatCompletionRequest", "ChatMessage",
    "TextPart", "new_id", "choice_params",
    # errors
    "APIError", "bad_request", "unsupported", "from_validation_error", "prompt_error", "sampling_error",
    "output_error", "exception_error",
    # responses
    "finish_reason", "usage", "spec_stats", "LogprobWriter", "completion_response", "chat_response", "sse",
    "ChunkWriter",
]


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


# ---------------------------------------------------------------- ids, seeds
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice ``index`` of ``n``: its own stream of random numbers where a
    seed is given (``seed + index``, vLLM's rule), a fresh one where not."""
    if params.seed is None or index == 0:
        return params
    return dataclasses.replace(params, seed=(params.seed + index + 2**63) % 2**64 - 2**63)
