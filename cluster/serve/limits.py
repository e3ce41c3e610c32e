"""Bounds a request must meet before the replica spends real work on it.

The replica's event loop parses and validates every request, and its one
tokenizing thread renders and encodes every chat prompt, so a request that
is merely large can stall every stream of the replica before it is refused:
a million empty chat messages took pydantic 18 s to validate, a 2 MB prompt
took the tokenizer 4.5 s to count. The checks here run on the parsed JSON
(before pydantic) and on the prompt's size in bytes (before tokenizing), so
such requests get their 4xx in milliseconds. Limits that OpenAI documents
are OpenAI's (2048 messages, 16 metadata pairs); the others are sized far
above what a real client sends.
"""

from __future__ import annotations

import asyncio

from specray.serve.protocol import APIError, bad_request

MAX_MESSAGES = 2048  # OpenAI's bound
MAX_CONTENT_PARTS = 4096  # text parts over all messages
# Every stop string is searched at every step of its request, and the
# longest one sets how much of a stream is held back.
MAX_STOP = 64
MAX_STOP_CHARS = 1024
# The stop ids become a set at every step of the request.
MAX_STOP_TOKEN_IDS = 1024
# Length bounds of the top-level lists and objects (prompt aside: its bound
# is the context); fields not named here get DEFAULT_ITEMS.
MAX_ITEMS = {"messages": MAX_MESSAGES, "stop": MAX_STOP, "stop_token_ids": MAX_STOP_TOKEN_IDS, "metadata": 16}
DEFAULT_ITEMS = 256

JSON_MEDIA_TYPES = ("application/json",)


def check_content_type(value: str | None) -> None:
    """A body declared as anything but JSON gets a 415 (a missing header is
    taken as JSON: clients that send none mean it)."""
    if not value:
        return
    media = value.split(";", 1)[0].strip().lower()
    if media in JSON_MEDIA_TYPES or media.endswith("+json"):
        return
    raise APIError(415, f"Unsupported Content-Type {value[:100]!r}: the body must be JSON, sent as "
                        "'Content-Type: application/json'.", "invalid_request_error", None,
                   "unsupported_media_type")


def _too_long(param: str, n: int, limit: int) -> APIError:
    return bad_request(f"Invalid '{param}': array too long. Expected an array with maximum length {limit}, "
                       f"but got an array with length {n} instead.", param, "array_above_max_length")


def check_max_tokens(value, max_model_len: int, param: str = "max_tokens") -> None:
    """No prompt leaves room for ``max_model_len`` new tokens or more (the
    prompt takes one at least): OpenAI's and vLLM's 400, rather than a
    request that runs to the end of the context."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= max_model_len:
        shown = str(value) if isinstance(value, float) or value < 10**30 else \
            f"{str(value)[:12]}... ({len(str(value))} digits)"
        raise bad_request(f"{param} is too large: {shown}. This model's maximum context length is {max_model_len} "
                          f"tokens, so it generates at most {max_model_len - 1} (after a one-token prompt).",
                          param, "invalid_value")


def check_body(body, max_model_len: int) -> None:
    """Bounds on the parsed body of a completion or chat request, before
    pydantic walks it. Wrong types are left to pydantic (its messages name
    them)."""
    if not isinstance(body, dict):
        return
    for key, value in body.items():
        if key == "prompt":
            _check_prompt_items(value, max_model_len)
        elif isinstance(value, (list, dict)):
            limit = MAX_ITEMS.get(key, DEFAULT_ITEMS)
            if len(value) > limit:
                raise _too_long(key, len(value), limit)
    for key in ("max_tokens", "max_completion_tokens"):
        check_max_tokens(body.get(key), max_model_len, key)
    stop = body.get("stop")
    for s in [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else ():
        if isinstance(s, str) and len(s) > MAX_STOP_CHARS:
            raise bad_request(f"Invalid 'stop': a stop string has {len(s)} characters; at most {MAX_STOP_CHARS} "
                              "are taken.", "stop", "string_above_max_length")
    messages = body.get("messages")
    if isinstance(messages, list):
        parts = sum(len(m["content"]) for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list))
        if parts > MAX_CONTENT_PARTS:
            raise bad_request(f"Invalid 'messages': {parts} content parts; at most {MAX_CONTENT_PARTS} are taken.",
                              "messages", "array_above_max_length")


def _check_prompt_items(prompt, max_model_len: int) -> None:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]  # a batch of one
    if not isinstance(prompt, list) or len(prompt) < max_model_len:
        return
    if isinstance(prompt[0], int):
        raise bad_request(f"prompt has {len(prompt)} tokens; this model takes at most {max_model_len - 1} "
                          f"(max_model_len {max_model_len}, minus one token to generate)", "prompt",
                          "context_length_exceeded")
    raise _too_long("prompt", len(prompt), max_model_len - 1)


def check_prompt_bytes(text: str, max_bytes: float, max_model_len: int, param: str) -> None:
    """A text longer in UTF-8 than ``max_bytes`` (``max_prompt_bytes`` of the
    tokenizer) cannot fit in the context: refused without tokenizing."""
    if len(text) * 4 <= max_bytes:  # four bytes a character at most
        return
    size = len(text) if len(text) > max_bytes else len(text.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens; the {param} "
                          f"has {'at least ' if size == len(text) else ''}{size} bytes of text, more than "
                          f"{max_model_len - 1} tokens can spell (at most {int(max_bytes)} bytes).", param,
                          "context_length_exceeded")


def check_grpc(request, max_model_len: int) -> None:
    """The same bounds for a specray.v1 GenerateRequest."""
    if request.WhichOneof("input") == "messages" and len(request.messages.messages) > MAX_MESSAGES:
        raise _too_long("messages", len(request.messages.messages), MAX_MESSAGES)
    p = request.params
    if len(p.stop) > MAX_STOP:
        raise _too_long("stop", len(p.stop), MAX_STOP)
    if len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise _too_long("stop_token_ids", len(p.stop_token_ids), MAX_STOP_TOKEN_IDS)
    if any(len(s) > MAX_STOP_CHARS for s in p.stop):
        raise bad_request(f"Invalid 'stop': a stop string is longer than {MAX_STOP_CHARS} characters.", "stop",
                          "string_above_max_length")
    if p.HasField("max_tokens"):
        check_max_tokens(p.max_tokens, max_model_len)


async def read_body(request, limit: int, timeout: float) -> bytes:
    """The body, within the size and time limits: a client that sends its
    body slowly (or never) holds one of the replica's request slots, which
    /health shares, until the timeout frees it."""
    from starlette.requests import ClientDisconnect

    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"The request body has {declared} bytes; this server takes at most {limit}.",
                       "invalid_request_error", None, "request_too_large")

    async def read() -> bytes:
        parts, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"The request body exceeds {limit} bytes.", "invalid_request_error",
                               None, "request_too_large")
            parts.append(chunk)
        return b"".join(parts)

    try:
        return await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        raise APIError(408, f"The request body did not arrive within {timeout:g} s.",
                       "invalid_request_error", None, "request_timeout") from None
    except ClientDisconnect:
        raise APIError(499, "The client closed the connection before sending its body.",
                       "invalid_request_error", None, "client_closed_request") from None
