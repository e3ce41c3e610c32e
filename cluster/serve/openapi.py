"""The request and error schemas the app publishes at ``/openapi.json``.

The handlers read their bodies themselves (size and time limits first, then
the JSON), so FastAPI sees no body parameter and would publish none: the
operations get the pydantic models' schemas here, with the bounds of
:mod:`specray.serve.limits` and the context length of the replica, so that
clients and schema fuzzers see what the server takes.
"""

from __future__ import annotations

import copy

from specray.sampling import MAX_LOGPROBS
from specray.serve import limits as L
from specray.serve import protocol as P

ROLES = ["system", "developer", "user", "assistant"]

ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}
_ERRORS = {400: "Invalid request", 401: "Missing or wrong API key", 404: "Unknown model",
           408: "The body did not arrive in time", 413: "Request body too large",
           415: "The body is not JSON", 429: "At capacity: retry after Retry-After seconds",
           500: "The engine failed", 503: "The engine is unavailable"}


def _inline(node, defs: dict):
    if isinstance(node, dict):
        ref = node.get("$ref", "")
        if ref.startswith("#/$defs/"):
            return _inline(copy.deepcopy(defs[ref.removeprefix("#/$defs/")]), defs)
        return {k: _inline(v, defs) for k, v in node.items() if k != "$defs"}
    if isinstance(node, list):
        return [_inline(v, defs) for v in node]
    return node


# A message's extra fields: only empty ones (an earlier answer sent back).
EMPTY = {"anyOf": [{"type": "null"}, {"const": ""}, {"type": "array", "maxItems": 0},
                   {"type": "object", "maxProperties": 0}]}
TEXT_PART = {"type": "object", "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
             "required": ["type", "text"], "additionalProperties": False}
_RANGES = {"presence_penalty": {"minimum": -2, "maximum": 2}, "frequency_penalty": {"minimum": -2, "maximum": 2},
           "repetition_penalty": {"exclusiveMinimum": 0, "maximum": 10}, "n": {"minimum": 1},
           "best_of": {"minimum": 1, "maximum": 1}, "seed": {"minimum": -2**63, "maximum": 2**63 - 1}}
# Fields that need another: stream_options a stream, top_logprobs > 0 logprobs.
_DEPENDENT = {
    "stream_options": {"anyOf": [{"properties": {"stream_options": {"type": "null"}}},
                                 {"properties": {"stream": {"const": True}}, "required": ["stream"]}]},
    "top_logprobs": {"anyOf": [{"properties": {"top_logprobs": {"enum": [None, 0]}}},
                               {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]}]},
}
# Fields the server takes only at their neutral value.
_NEUTRAL = {"echo": {"boolean": {"const": False}}, "suffix": {"string": {"maxLength": 0}},
            "logit_bias": {"object": {"maxProperties": 0}}, "tools": {"array": {"maxItems": 0}},
            "functions": {"array": {"maxItems": 0}},
            "response_format": {"object": {"properties": {"type": {"const": "text"}}}}}


def _supported_only(props: dict) -> None:
    for name, bounds in _RANGES.items():
        for v in _variants(props.get(name, {})):
            if v.get("type") in ("number", "integer"):
                v.update(bounds)
    for name, by_type in _NEUTRAL.items():
        for v in _variants(props.get(name, {})):
            v.update(by_type.get(v.get("type"), {}))
    for name in ("tool_choice", "function_call"):
        if name in props:
            props[name] = {"anyOf": [{"type": "null"}, {"const": "none"}]}
    for v in _variants(props.get("prompt", {})):
        if v.get("type") == "string":
            v["minLength"] = 1
        elif v.get("type") == "array":
            v["minItems"] = 1
            items = v["items"]
            if items.get("type") == "integer":
                items["minimum"] = 0
                continue
            v["maxItems"] = 1  # a batch of one prompt
            if items.get("type") == "string":
                items["minLength"] = 1
            else:
                items.update(minItems=1, items={"type": "integer", "minimum": 0})


def _variants(prop: dict) -> list[dict]:
    return prop.get("anyOf", [prop])


class _Operation(dict):
    """An operation's ``openapi_extra``. Serve hands the replica a pickled
    copy of the FastAPI app, made at import, so the replica cannot reach
    these dicts to add its context length; FastAPI reads them through
    ``items()`` when it first builds the document, in the replica, where
    :func:`publish_context` has set the context by then."""

    def items(self):
        if _CONTEXT:
            _bound_by_context(self, _CONTEXT["max_model_len"])
        return super().items()


_CONTEXT: dict = {}


def _operation(model_cls) -> _Operation:
    schema = model_cls.model_json_schema()
    schema = _inline(schema, schema.get("$defs", {}))
    props = schema["properties"]
    for v in _variants(props["stop"]):
        if v.get("type") == "string":
            v["maxLength"] = L.MAX_STOP_CHARS
        elif v.get("type") == "array":
            v.update(maxItems=L.MAX_STOP, items={"type": "string", "maxLength": L.MAX_STOP_CHARS})
    for name, limit in L.MAX_ITEMS.items():
        for v in _variants(props.get(name, {})):
            if v.get("type") == "array":
                v.setdefault("maxItems", limit)
            elif v.get("type") == "object":
                v.setdefault("maxProperties", limit)
    for name in ("logprobs", "top_logprobs"):
        for v in _variants(props.get(name, {})):
            if v.get("type") == "integer":
                v.update(minimum=0, maximum=MAX_LOGPROBS)
    _supported_only(props)
    for v in _variants(props["stream_options"]):
        if v.get("type") == "object":
            v["properties"]["continuous_usage_stats"] = {"type": "boolean", "const": False}
    schema["dependentSchemas"] = {k: v for k, v in _DEPENDENT.items() if k in props}
    if "messages" in props:
        message = props["messages"]["items"]
        message["properties"]["role"]["enum"] = ROLES
        message["additionalProperties"] = EMPTY
        for v in _variants(message["properties"]["content"]):
            if v.get("type") == "array":
                v["items"] = TEXT_PART
    responses = {str(code): {"description": what, "content": {"application/json": {"schema": ERROR_SCHEMA}}}
                 for code, what in _ERRORS.items()}
    return _Operation(requestBody={"required": True, "content": {"application/json": {"schema": schema}}},
                      responses=responses)


completions = _operation(P.CompletionRequest)
chat_completions = _operation(P.ChatCompletionRequest)


def publish_context(max_model_len: int) -> None:
    """The replica's context length, for the bounds it sets on
    ``max_tokens`` and on a token-id prompt."""
    _CONTEXT["max_model_len"] = max_model_len


def _bound_by_context(op: dict, max_model_len: int) -> None:
    props = dict.__getitem__(op, "requestBody")["content"]["application/json"]["schema"]["properties"]
    for name in ("max_tokens", "max_completion_tokens", "min_tokens"):
        for v in _variants(props.get(name, {})):
            if v.get("type") == "integer":
                v["maximum"] = max_model_len - 1
    for v in _variants(props.get("prompt", {})):
        if v.get("type") == "array" and v.get("items", {}).get("type") == "integer":
            v["maxItems"] = max_model_len - 1
