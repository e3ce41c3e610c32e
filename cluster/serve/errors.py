"""Errors in OpenAI's shape: the API's refusals of a request (400s naming
the parameter, as OpenAI's do) and the engine's failures of one (503 where a
retry can succeed, 504 for a timeout, 500 where the request failed alone),
shared by HTTP (JSON bodies, SSE error events) and gRPC (status codes)."""

from __future__ import annotations

import json
import re

from pydantic import ValidationError

from specray.request import PromptTooLong, RequestOutput


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

