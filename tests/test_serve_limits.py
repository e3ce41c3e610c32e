"""specray.serve.limits, the byte bound on prompts and the published
OpenAPI schema, without a server: each check is cheap, refuses what it must
and nothing that fits (the end-to-end cases are in test_fuzz_http.py)."""

import json
import time

import pytest

from factories import add_tokenizer
from specray.detokenizer import load_tokenizer, max_prompt_bytes, max_prompt_chars
from specray.serve import limits as L
from specray.serve import protocol as P


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    add_tokenizer(d, 320)
    return load_tokenizer(d)


def _refused(fn, *args) -> P.APIError:
    with pytest.raises(P.APIError) as e:
        fn(*args)
    assert set(e.value.body()["error"]) == {"message", "type", "param", "code"}
    return e.value


def test_byte_bound_holds_for_texts_that_tokenize_longest(tok):
    """No text longer than max_prompt_bytes fits in max_tokens: texts made of
    the vocabulary's longest entries, of spaces, of multi-byte characters,
    of special tokens all take at least bytes / longest-token-bytes tokens."""
    vocab = tok.get_vocab()
    longest = max(vocab, key=len)
    bound = max_prompt_bytes(tok, 100)
    assert bound == len(longest) * 100  # no normaliser: no margin; byte-level entries spell a byte a character
    assert bound < max_prompt_chars(tok, 100)
    readable = tok.convert_tokens_to_string([longest])
    for text in (readable * 50, " " * 5000, "\u00e9\u4e2d\U0001f600" * 500, "<s></s>" * 300, "The capital" * 300):
        n = len(tok.encode(text, add_special_tokens=False))
        assert len(text.encode()) <= max_prompt_bytes(tok, n), text[:40]


def test_byte_bound_is_void_where_text_can_shrink(tok):
    """Normalisers and pre-tokenizers that drop text (Strip, a Replace that
    deletes, a whitespace split) make any length fit: no bound then; NFKC
    only composes (a 4-byte letter into one ASCII byte): the margin of 8."""
    from tokenizers import normalizers, pre_tokenizers

    backend = tok.backend_tokenizer
    plain = max_prompt_bytes(tok, 10)
    try:
        backend.normalizer = normalizers.NFKC()
        assert max_prompt_bytes(tok, 10) == 8 * plain
        text = "\U0001d400" * 400  # MATHEMATICAL BOLD CAPITAL A: NFKC makes it "A"
        assert len(text.encode()) <= max_prompt_bytes(tok, len(tok.encode(text, add_special_tokens=False)))
        for norm in (normalizers.Strip(), normalizers.Sequence([normalizers.NFC(), normalizers.Replace("a", "")]),
                     normalizers.BertNormalizer()):
            backend.normalizer = norm
            assert max_prompt_bytes(tok, 10) == float("inf") == max_prompt_chars(tok, 10), norm
        backend.normalizer = normalizers.Replace(" ", "\u2581")  # Llama's: grows the text
        assert max_prompt_bytes(tok, 10) == 8 * plain
        backend.normalizer = None
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                         pre_tokenizers.ByteLevel(add_prefix_space=False)])
        assert len(tok.encode(" " * 10_000 + "a", add_special_tokens=False)) == 1
        assert max_prompt_bytes(tok, 10) == float("inf")
    finally:
        backend.normalizer = None
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    assert max_prompt_bytes(tok, 10) == plain
    assert max_prompt_bytes(None, 10) == float("inf")


def test_a_2mb_prompt_is_refused_by_its_bytes_in_milliseconds():
    t = time.perf_counter()
    for text in ("a " * (1 << 20), "\u00e9" * (1 << 20)):
        e = _refused(L.check_prompt_bytes, text, 663_471, 8192, "prompt")
        assert e.status == 400 and e.code == "context_length_exceeded" and "bytes" in e.message
    assert time.perf_counter() - t < 0.1
    L.check_prompt_bytes("\u00e9" * 600, 1200, 8192, "prompt")  # 1200 bytes: fits
    _refused(L.check_prompt_bytes, "\u00e9" * 601, 1200, 8192, "prompt")  # 601 characters, 1202 bytes


def test_the_embedded_tokenizer_refuses_2mb_untokenized():
    """The embedded target (SmolLM2, 8192 positions): its bound is 81 bytes
    a token, so 2 MB is over by a factor of 3 and never reaches the
    tokenizer (it took 4.5 s there)."""
    from specray.default_model import default_cache_dir

    d = default_cache_dir()
    if not (d / "tokenizer.json").is_file():
        pytest.skip("the embedded target is not converted here")
    bound = max_prompt_bytes(load_tokenizer(d), 8191)
    assert bound == 81 * 8191 < 2 << 20


@pytest.mark.parametrize("body,param,code", [
    ({"messages": [{"role": "user", "content": ""}] * 100_000}, "messages", "array_above_max_length"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": ""}] * 5000}]}, "messages",
     "array_above_max_length"),
    ({"prompt": "x", "stop": [f"s{i}" for i in range(10_000)]}, "stop", "array_above_max_length"),
    ({"prompt": "x", "stop": "y" * 100_000}, "stop", "string_above_max_length"),
    ({"prompt": "x", "stop": ["ok", "y" * 2000]}, "stop", "string_above_max_length"),
    ({"prompt": "x", "stop_token_ids": list(range(100_000))}, "stop_token_ids", "array_above_max_length"),
    ({"prompt": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata", "array_above_max_length"),
    ({"prompt": "x", "logit_bias": {str(i): 1 for i in range(10_000)}}, "logit_bias", "array_above_max_length"),
    ({"prompt": [5] * 256}, "prompt", "context_length_exceeded"),
    ({"prompt": [[5] * 10**6]}, "prompt", "context_length_exceeded"),
    ({"prompt": ["a"] * 10**5}, "prompt", "array_above_max_length"),
    ({"prompt": "x", "max_tokens": 10**12}, "max_tokens", "invalid_value"),
    ({"prompt": "x", "max_tokens": 256}, "max_tokens", "invalid_value"),
    ({"messages": [], "max_completion_tokens": 10**400}, "max_completion_tokens", "invalid_value"),
])
def test_body_bounds_refuse_before_pydantic(body, param, code):
    """Each refused in well under a second; a million-item list reached
    pydantic first (a million chat messages: 18 s of the replica's loop)."""
    t = time.perf_counter()
    e = _refused(L.check_body, body, 256)
    assert time.perf_counter() - t < 0.5
    assert (e.status, e.param, e.code) == (400, param, code), e.message
    if "digits" in e.message:
        assert len(e.message) < 300


def test_body_bounds_take_what_fits():
    for body in ({"prompt": [5] * 255, "max_tokens": 1}, {"prompt": "x", "max_tokens": 255, "stop": ["a"] * 64},
                 {"messages": [{"role": "user", "content": "x"}] * 2048, "metadata": {"a": "b"}},
                 {"prompt": "x", "max_tokens": True}, {"prompt": 5}, "not a dict", None):
        L.check_body(body, 256)  # wrong types are pydantic's to name


def test_content_type():
    for ok in (None, "", "application/json", "application/json; charset=utf-8", "APPLICATION/JSON",
               "application/vnd.api+json"):
        L.check_content_type(ok)
    for bad in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                "application/xml"):
        assert _refused(L.check_content_type, bad).status == 415


@pytest.mark.parametrize("body,param", [
    ({"prompt": [True, 5]}, "prompt"), ({"prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"prompt": "x", "stop_token_ids": [False]}, "stop_token_ids"), ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "x", "stream": 1}, "stream"), ({"prompt": "x", "temperature": "0.5"}, "temperature"),
    ({"prompt": "x", "top_p": True}, "top_p"), ({"prompt": "x", "seed": "12"}, "seed"),
])
def test_json_types_are_taken_strictly(body, param):
    """Lax pydantic read true as the token id 1 (the Python API refuses a
    bool in a token prompt), "5" as 5 and 1 as true."""
    e = _refused(P.parse, P.CompletionRequest, body)
    assert e.status == 400 and e.param.split(".")[0] == param, e.message


def test_strict_parsing_still_takes_what_clients_send():
    req = P.parse(P.ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}],
                                                          "refusal": None}], "temperature": 1, "top_p": 1,
                                            "stream": True, "stream_options": {"include_usage": True},
                                            "metadata": {"k": "v"}, "response_format": {"type": "text"}})
    assert req.temperature == 1.0 and req.chat_messages() == [{"role": "user", "content": "x"}]
    assert P.parse(P.CompletionRequest, {"prompt": [[1, 2]], "presence_penalty": 0}).prompt == [1, 2]
    # JSON has one number type: 36.0 is the integer 36 (JSON Schema's rule;
    # strict parsing first refused it, found by the schema fuzzer)
    req = P.parse(P.CompletionRequest, {"prompt": [5.0, 6.0], "max_tokens": 36.0, "top_k": 4.0,
                                        "stop_token_ids": [2.0]})
    assert (req.prompt, req.max_tokens, req.top_k, req.stop_token_ids) == ([5, 6], 36, 4, [2])
    assert P.parse(P.CompletionRequest, {"prompt": [[7.0]]}).prompt == [7]
    for bad in ({"prompt": "x", "max_tokens": 5.5}, {"prompt": "x", "stream": 1.0}, {"prompt": [5.5]}):
        _refused(P.parse, P.CompletionRequest, bad)
    for big in (1e300, float("inf"), 256.0):  # a float max_tokens is bounded like an int
        assert _refused(L.check_body, {"prompt": "x", "max_tokens": big}, 256).param == "max_tokens"


def test_published_schema_carries_the_bounds_and_the_context():
    """The handlers read their own bodies, so FastAPI published no request
    schema; Serve pickles the app at import, so the replica's context length
    reaches the document only through the operations' items()."""
    from ray import cloudpickle

    from specray.serve import openapi
    from specray.serve.app import app

    copy = cloudpickle.loads(cloudpickle.dumps(app))
    openapi.publish_context(256)
    try:
        doc = json.loads(json.dumps(copy.openapi()))
    finally:
        openapi._CONTEXT.clear()
    for path in ("/v1/completions", "/v1/chat/completions"):
        op = doc["paths"][path]["post"]
        schema = op["requestBody"]["content"]["application/json"]["schema"]
        props = schema["properties"]
        assert schema["additionalProperties"] is False and "$defs" not in json.dumps(schema)
        assert props["max_tokens"]["anyOf"][0]["maximum"] == 255
        assert {v.get("maxItems") for v in props["stop"]["anyOf"]} == {None, L.MAX_STOP}
        assert op["responses"]["400"]["content"]["application/json"]["schema"] == openapi.ERROR_SCHEMA
    chat = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert chat["properties"]["messages"]["maxItems"] == L.MAX_MESSAGES
    assert chat["properties"]["messages"]["items"]["properties"]["role"]["enum"] == openapi.ROLES
    assert set(chat["dependentSchemas"]) == {"stream_options", "top_logprobs"}


def test_bodies_drawn_from_the_published_schema_are_what_the_server_takes():
    """Valid bodies drawn from the schema pass the server's checks (bar
    what a schema cannot say: min_tokens against max_tokens) and invalid
    ones do not: the schema describes the server, not a looser API."""
    import sys
    from pathlib import Path

    pytest.importorskip("schemathesis")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import fuzz_http

    from specray.serve import openapi
    from specray.serve.app import app

    openapi.publish_context(128)
    try:
        doc = json.loads(json.dumps(app.openapi()))
    finally:
        openapi._CONTEXT.clear()
        app.openapi_schema = None
    refused = {"positive": [], "negative": []}
    taken = []
    for c in fuzz_http.generate_cases(doc, 40, 7, "m"):
        model = P.CompletionRequest if c["operation"] == "completions" else P.ChatCompletionRequest
        try:
            body = P.parse_json(c["raw"])
            L.check_body(body, 128)
            req = P.parse(model, body)
            req.sampling_params(req.max_new_tokens(16) if model is P.ChatCompletionRequest else req.max_new_tokens())
        except P.APIError as e:
            refused[c["mode"]].append(e.param)
        else:
            if c["mode"] == "negative":
                taken.append((c["operation"], c["raw"]))
    assert taken == [], "bodies outside the schema were taken"
    # Hypothesis may draw fewer than asked (duplicates, rejected draws); the
    # property is that every one drawn is refused, over a fair number.
    assert len(refused["negative"]) >= 60
    assert [p for p in refused["positive"] if p != "min_tokens"] == [], refused["positive"]


def test_grpc_requests_meet_the_same_bounds():
    from specray.serve import specray_pb2 as pb

    def req(**params):
        return pb.GenerateRequest(prompt="x", params=pb.SamplingParams(**params))

    L.check_grpc(req(max_tokens=255, stop=["a"] * 64, stop_token_ids=list(range(1024))), 256)
    L.check_grpc(req(), 256)  # max_tokens unset: the server's default, within the context
    for r, param, code in ((req(max_tokens=256), "max_tokens", "invalid_value"),
                           (req(stop=["a"] * 65), "stop", "array_above_max_length"),
                           (req(stop=["y" * 2000]), "stop", "string_above_max_length"),
                           (req(stop_token_ids=list(range(5000))), "stop_token_ids", "array_above_max_length")):
        e = _refused(L.check_grpc, r, 256)
        assert (e.status, e.param, e.code) == (400, param, code)
    many = pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="")] * 3000))
    assert _refused(L.check_grpc, many, 256).param == "messages"


def test_bodies_nested_to_the_parsers_limit_stay_400s():
    """A body nested just under json.loads' depth limit, in a field that
    fails validation, overflowed the stack when the error message showed the
    value (json.dumps walks it again, a few frames deeper): a 500. So did
    the surrogate check's re-encoding of such a body. Whatever the stack
    depth the request arrives at, every depth must end in a 400."""
    import sys

    def parse_at(frames: int, raw: bytes):
        if frames:
            return parse_at(frames - 1, raw)
        try:
            body = P.parse_json(raw)
            L.check_body(body, 256)
            P.parse(P.CompletionRequest, body)
        except P.APIError as e:
            return e.status
        return 200

    limit = sys.getrecursionlimit()
    t = time.perf_counter()
    for frames in (0, 7, 50):
        for d in range(limit - 150, limit + 5):
            nest = b"[" * d + b"]" * d
            for raw in (b'{"prompt": "hi", "metadata": {"a": ' + nest + b"}}",
                        b'{"prompt": "hi", "stop": ' + b'{"a":' * d + b"1" + b"}" * d + b"}",
                        b'{"prompt": "hi \\ud800", "user": ' + nest + b"}"):
                assert parse_at(frames, raw) == 400, (frames, d, raw[:40])
    assert time.perf_counter() - t < 30
