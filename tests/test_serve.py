"""The Ray Serve front (specray.serve) on a loopback Ray cluster, CPU only:
the OpenAI API's semantics over HTTP and gRPC (models, auth, streaming,
stops, penalties, n, logprobs, bad input) against the in-process engine.
The application (Ray backend: target rank + drafter actor) and its clients:
serve_harness.py; the traffic tests (concurrency, disconnects, limits,
metrics, gRPC): test_serve_traffic.py.
"""

import socket
import time
from pathlib import Path

import pytest
import yaml

from serve_harness import (API_KEY, APP, BODY_LIMIT, BODY_TIMEOUT, LIMIT, MODEL,
                           REPO, deploy, grpc_stub)

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
grpc = pytest.importorskip("grpc")

from ray import serve  # noqa: E402

from specray import LLM, SamplingParams  # noqa: E402
from specray.serve import specray_pb2 as pb  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from deploy(tmp_path_factory)


def test_checked_in_stubs_match_the_proto(tmp_path):
    """The three checked-in stubs were generated from the specray.proto in
    the tree. Only specray_pb2.py was compared: a proto changed without
    regenerating specray_pb2_grpc.py (whose handlers Serve's proxy
    registers) passed."""
    import ast

    protoc = pytest.importorskip("grpc_tools.protoc")
    serve_dir = REPO / "cluster/serve"
    rc = protoc.main(["protoc", f"-Ispecray/serve={serve_dir}", f"--python_out={tmp_path}", f"--pyi_out={tmp_path}",
                      f"--grpc_python_out={tmp_path}", str(serve_dir / "specray.proto")])
    assert rc == 0
    out = tmp_path / "specray/serve"
    text = (out / "specray_pb2.py").read_text()
    literal = text.split("AddSerializedFile(", 1)[1].split(")\n", 1)[0]
    assert ast.literal_eval(literal) == pb.DESCRIPTOR.serialized_pb, "regenerate the stubs (see specray.proto)"

    def lines(path: Path) -> list[str]:  # the generator's version aside (pinned in pyproject)
        return [line for line in path.read_text().splitlines() if not line.startswith("GRPC_GENERATED_VERSION")]

    for name in ("specray_pb2_grpc.py", "specray_pb2.pyi"):
        assert lines(serve_dir / name) == lines(out / name), f"regenerate {name} (see specray.proto)"


def test_yaml_deploys_the_app(server):
    """deploy/ray/serve.yaml (paths filled in) started what the tests use."""
    cfg = yaml.safe_load((REPO / "deploy/ray/serve.yaml").read_text())
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate(cfg)
    app = cfg["applications"][0]
    assert app["import_path"] == "specray.serve:build_app"
    from specray.serve import GRPC_SERVICER_FUNCTIONS

    assert cfg["grpc_options"]["grpc_servicer_functions"] == GRPC_SERVICER_FUNCTIONS
    assert cfg["http_options"]["host"] == "127.0.0.1"
    status = serve.status().applications[APP]
    assert status.status == "RUNNING"
    assert server.request("GET", "/health", key=None)[:1] == (200,)  # /health needs no key


def test_everything_listens_on_loopback(server):
    """Every TCP socket listening in this test's Ray cluster (GCS, raylet,
    workers, Serve's HTTP and gRPC proxies, the engine actors) is on
    loopback."""
    psutil = pytest.importorskip("psutil")
    assert ray.get_runtime_context().gcs_address.startswith("127.0.0.1:")
    me = psutil.Process()
    procs = [me, *me.children(recursive=True)]
    names = {p.name() for p in procs if p.is_running()}
    assert any("ServeReplica" in n or "ray::" in n for n in names) or len(procs) > 5, names
    listening = []
    for p in procs:
        try:
            conns = p.net_connections(kind="tcp")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        listening += [(p.pid, p.name(), c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]
    ports = {port for *_, port in listening}
    assert server.http_port in ports and server.grpc_port in ports
    outside = [x for x in listening if x[2] not in ("127.0.0.1", "::ffff:127.0.0.1", "::1")]
    # The engine's process group meets through a file store on one node and
    # its gloo pairs bind to lo: nothing of it listens elsewhere either.
    assert not outside, outside


def test_models_and_auth(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].max_model_len == 256  # extension fields survive the client
    with pytest.raises(openai.AuthenticationError) as e:
        server.client(key="wrong").models.list()
    assert e.value.body["code"] == "invalid_api_key"
    status, headers, body = server.request("POST", "/v1/completions", {"model": MODEL, "prompt": "x"}, key=None)
    assert status == 401 and set(body["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.AuthenticationError):
        server.client(key="wrong").chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)


def test_server_info_counts_the_engines_steps(server):
    status, _, before = server.request("GET", "/server_info")
    assert status == 200 and before["model"] == MODEL, before
    server.client().completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0)
    _, _, after = server.request("GET", "/server_info")
    assert after["engine"]["num_steps"] > before["engine"]["num_steps"]
    assert after["engine"]["step_time_s"] > before["engine"]["step_time_s"]
    assert "features" in after["engine"] and "pools" in after["engine"]
    status, _, body = server.request("GET", "/server_info", key="wrong")
    assert status == 401 and body["error"]["code"] == "invalid_api_key"


def test_chat_streaming_equals_non_streaming(server):
    client = server.client()
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]
    full = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0)
    choice = full.choices[0]
    assert full.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    assert 0 < full.usage.completion_tokens <= 24
    spec = full.model_extra["specray"]
    assert spec["mean_acceptance_length"] >= 1 and len(spec["acceptance_lengths"]) >= 1
    assert sum(spec["acceptance_lengths"]) == full.usage.completion_tokens - 1  # + the prefill's token

    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == choice.finish_reason
    assert finals[0].model_extra["specray"]["acceptance_lengths"] == spec["acceptance_lengths"]
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == full.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])
    short = client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=3, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert short.usage.completion_tokens == 3 and short.choices[0].finish_reason == "length"


def test_text_completion(server):
    client = server.client()
    out = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12,
                                    temperature=0, stop=["Paris"], seed=3, top_p=0.9,
                                    extra_body={"top_k": 5, "return_token_ids": True})
    assert out.object == "text_completion" and out.choices[0].finish_reason in ("stop", "length")
    want = LLM(server.root / MODEL, server.root / "drafter").generate(
        "The capital of France is", SamplingParams(max_tokens=12, temperature=0, stop=["Paris"]))[0]
    assert out.choices[0].text == want.text
    assert out.choices[0].model_extra["token_ids"] == want.token_ids
    assert out.usage.prompt_tokens == len(want.prompt_token_ids)
    # token-id prompts; streaming text joins to the same thing
    ids = want.prompt_token_ids
    again = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0, stop="Paris")
    assert again.choices[0].text == want.text
    parts = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0, stop="Paris",
                                      stream=True)
    assert "".join(c.choices[0].text for c in parts) == want.text


def test_stop_token_text_is_left_out(server):
    """As in vLLM, a token of stop_token_ids ends the output without its
    text (it still counts in token_ids and usage); it was appended."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(server.root / MODEL)
    client = server.client()
    kw = dict(model=MODEL, prompt="The capital of France is", temperature=0)
    free = client.completions.create(**kw, max_tokens=16, extra_body={"ignore_eos": True, "return_token_ids": True})
    ids = free.choices[0].model_extra["token_ids"]
    # a token first seen at k that adds text
    k = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i] and tok.decode(ids[:i + 1]) != tok.decode(ids[:i]))
    before = client.completions.create(**kw, max_tokens=k, extra_body={"ignore_eos": True}).choices[0].text
    stop = dict(max_tokens=16, extra_body={"stop_token_ids": [ids[k]], "ignore_eos": True, "return_token_ids": True})
    out = client.completions.create(**kw, **stop)
    assert out.choices[0].finish_reason == "stop" and out.choices[0].model_extra["token_ids"] == ids[:k + 1]
    assert out.usage.completion_tokens == k + 1
    assert out.choices[0].text == before
    assert "".join(c.choices[0].text for c in client.completions.create(**kw, **stop, stream=True)) == before


def test_min_tokens_over_http_and_grpc(server):
    """vLLM's min_tokens: a stop token the free output emits at k ends it
    there without min_tokens, and not before min_tokens = k + 3 with it
    (it is masked until then, so it is not in those tokens); gRPC gives
    HTTP's tokens; min_tokens above max_tokens is a 400 naming it."""
    client = server.client()
    kw = dict(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=16)
    free = client.completions.create(**kw, extra_body={"ignore_eos": True, "return_token_ids": True})
    ids = free.choices[0].model_extra["token_ids"]
    k, stop = 2, ids[2]
    body = {"stop_token_ids": [stop], "ignore_eos": True, "return_token_ids": True}
    early = client.completions.create(**kw, extra_body=body).choices[0]
    assert early.finish_reason == "stop" and len(early.model_extra["token_ids"]) <= k + 1
    held = client.completions.create(**kw, extra_body=body | {"min_tokens": k + 3}).choices[0]
    got = held.model_extra["token_ids"]
    assert len(got) > k + 3 or held.finish_reason == "length"
    assert stop not in got[: k + 3] and (held.finish_reason == "length" or got.index(stop) == len(got) - 1)
    channel, stub = grpc_stub(server)
    with channel:
        msgs = list(stub.Generate(pb.GenerateRequest(model=MODEL, prompt=kw["prompt"], params=pb.SamplingParams(
            max_tokens=16, temperature=0, stop_token_ids=[stop], ignore_eos=True, min_tokens=k + 3)),
            metadata=[("authorization", f"Bearer {API_KEY}")]))
    assert sum((list(m.token_ids) for m in msgs), []) == got and msgs[-1].finish_reason == held.finish_reason
    status, _, err = server.request("POST", "/v1/completions", {**kw, "min_tokens": 17})
    assert status == 400 and err["error"]["param"] == "min_tokens", err


def test_penalties_over_http_and_grpc(server):
    """presence / frequency (OpenAI) and repetition (vLLM) penalties: HTTP
    gives the in-process engine's penalised tokens, which differ from the
    free ones, and so does gRPC; out of range is a 400 naming the field."""
    client = server.client()
    prompt = "Hello world, this is a test"
    kw = dict(model=MODEL, prompt=prompt, temperature=0, max_tokens=16)
    pen = dict(presence_penalty=1.5, frequency_penalty=0.5)
    free = client.completions.create(**kw, extra_body={"ignore_eos": True, "return_token_ids": True})
    got = client.completions.create(**kw, **pen, extra_body={"ignore_eos": True, "return_token_ids": True,
                                                             "repetition_penalty": 1.3})
    ids = got.choices[0].model_extra["token_ids"]
    want = LLM(server.root / MODEL, server.root / "drafter").generate(prompt, SamplingParams(
        max_tokens=16, temperature=0, ignore_eos=True, repetition_penalty=1.3, **pen))[0]
    assert ids == want.token_ids != free.choices[0].model_extra["token_ids"]
    channel, stub = grpc_stub(server)
    with channel:
        msgs = list(stub.Generate(pb.GenerateRequest(model=MODEL, prompt=prompt, params=pb.SamplingParams(
            max_tokens=16, temperature=0, ignore_eos=True, repetition_penalty=1.3, **pen)),
            metadata=[("authorization", f"Bearer {API_KEY}")]))
    assert sum((list(m.token_ids) for m in msgs), []) == ids
    for field, value in (("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0)):
        status, _, err = server.request("POST", "/v1/completions", {**kw, field: value})
        assert status == 400 and err["error"]["param"] == field, err


def test_n_choices(server):
    """n > 1: n choices, each the in-process engine's output for seed +
    index (vLLM's rule), streamed too (each chunk naming its choice, the
    choices side by side, the usage counting the prompt once); greedy
    choices are identical; an n the replica could never admit is a 400,
    and no slot stays taken."""
    client = server.client()
    prompt = "The capital of France is"
    kw = dict(model=MODEL, prompt=prompt, max_tokens=10, temperature=1.0, seed=11, n=3,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    out = client.completions.create(**kw)
    assert [c.index for c in out.choices] == [0, 1, 2]
    llm = LLM(server.root / MODEL, server.root / "drafter")
    want = [llm.generate(prompt, SamplingParams(max_tokens=10, temperature=1.0, seed=11 + i, ignore_eos=True))[0]
            for i in range(3)]
    assert [c.model_extra["token_ids"] for c in out.choices] == [w.token_ids for w in want]
    assert len({tuple(w.token_ids) for w in want}) > 1  # the seeds differ
    assert out.usage.prompt_tokens == len(want[0].prompt_token_ids) and out.usage.completion_tokens == 30
    spec = out.model_extra["specray"]
    assert spec["acceptance_lengths"] == [a for w in want for a in w.metrics.acceptance_lengths]
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    texts = ["", "", ""]
    for c in chunks[:-1]:
        for ch in c.choices:
            texts[ch.index] += ch.text
    assert texts == [c.text for c in out.choices]
    assert sum(1 for c in chunks for ch in c.choices if ch.finish_reason) == 3
    assert chunks[-1].usage.completion_tokens == 30
    # The choices stream side by side (the engine runs them together), not one after another.
    events = [(ch.index, bool(ch.finish_reason)) for c in chunks for ch in c.choices]
    assert events.index((2, False)) < events.index((0, True)), events
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in chat.choices] == [0, 1] and chat.choices[0].message == chat.choices[1].message
    streamed = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0, n=2,
                                                   stream=True))
    roles = [ch.index for c in streamed for ch in c.choices if ch.delta.role == "assistant"]
    assert sorted(roles) == [0, 1]
    for n in (0, LIMIT + 1):
        status, _, body = server.request("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2, "n": n})
        assert status == 400 and body["error"]["param"] == "n", body
    assert server.wait_idle()["in_flight"] == 0


def test_chat_text_parts_join_with_newlines(server):
    """vLLM joins a message's text parts with "\\n"; they were run together."""
    def prompt_ids(content):
        status, _, body = server.request("POST", "/v1/chat/completions", {
            "model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 1,
            "temperature": 0, "return_token_ids": True})
        assert status == 200, body
        return body["prompt_token_ids"]

    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    assert prompt_ids(parts) == prompt_ids("Hello\nworld")


def test_openai_nulls_and_logprobs_zero(server):
    """OpenAI's schema allows null for stream and echo (vLLM accepts it);
    logprobs=0 asks for the sampled tokens' own log probabilities (once
    refused, before specray returned them)."""
    for field in ("stream", "echo"):
        status, _, body = server.request("POST", "/v1/completions", {
            "model": MODEL, "prompt": "Hello", "max_tokens": 2, field: None})
        assert status == 200 and body["choices"][0]["finish_reason"], (field, body)
    status, _, body = server.request("POST", "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": None})
    assert status == 200 and body["object"] == "chat.completion", body
    status, _, body = server.request("POST", "/v1/completions", {
        "model": MODEL, "prompt": "Hello", "max_tokens": 2, "logprobs": 0, "ignore_eos": True})
    assert status == 200, body
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == 2 and all(x <= 0 for x in lp["token_logprobs"])
    assert [list(top) for top in lp["top_logprobs"]] == [[t] for t in lp["tokens"]]  # the sampled token alone


def test_logprobs_over_http(server):
    """Chat (logprobs + top_logprobs) and completions (logprobs=k): an
    entry per generated token, the in-process engine's figures, the
    alternatives most likely first, streams that add up to the whole
    answer (text offsets running on across chunks); the openai client
    parses them."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(server.root / MODEL)
    client = server.client()
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    kw = dict(model=MODEL, messages=msgs, max_tokens=10, temperature=0, logprobs=True, top_logprobs=3,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    full = client.chat.completions.create(**kw)
    content = full.choices[0].logprobs.content
    ids = full.choices[0].model_extra["token_ids"]
    assert len(content) == len(ids) == 10
    prompt = full.model_extra["prompt_token_ids"]
    want = LLM(server.root / MODEL, server.root / "drafter").generate(
        [prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=3))[0]
    assert want.token_ids == ids
    for e, w in zip(content, want.logprobs):
        assert e.token == tok.decode([w.token_id]) and e.bytes == list(e.token.encode())
        assert e.logprob == pytest.approx(w.logprob, abs=1e-4)
        assert [t.logprob for t in e.top_logprobs] == pytest.approx([v for _, v in w.top], abs=1e-4)
        assert [t.token for t in e.top_logprobs] == [tok.decode([t]) for t, _ in w.top]
        assert e.top_logprobs[0].token == e.token  # greedy: the most likely token is the one taken
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    no_lp = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)
    assert no_lp.choices[0].logprobs is None

    ckw = dict(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, logprobs=2,
               extra_body={"ignore_eos": True})
    comp = client.completions.create(**ckw).choices[0]
    lp = comp.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 8
    # (the text holds back a trailing piece of a multi-byte character; the tokens show it as U+FFFD)
    assert "".join(lp.tokens).startswith(comp.text) and len("".join(lp.tokens)) - len(comp.text) <= 1
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    for t, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) in (2, 3) and top[t] == v and max(top.values()) == v
    parts = list(client.completions.create(**ckw, stream=True))
    joined = {k: [x for c in parts if c.choices[0].logprobs for x in getattr(c.choices[0].logprobs, k)]
              for k in ("tokens", "token_logprobs", "text_offset", "top_logprobs")}
    assert joined == {k: getattr(lp, k) for k in joined}


def test_invalid_parameters(server):
    client = server.client()
    msgs = [{"role": "user", "content": "hi"}]
    bad = [
        dict(temperature=5), dict(n=0), dict(top_logprobs=3), dict(top_logprobs=21, logprobs=True),
        dict(max_tokens=0), dict(top_p=0),
        dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]),
        dict(extra_body={"top_k": -3}), dict(extra_body={"best_of": 2}), dict(extra_body={"no_such_field": 1}),
        dict(response_format={"type": "json_object"}), dict(presence_penalty=3.0),
    ]
    for kw in bad:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=msgs, **{"max_tokens": 4, **kw})
        err = e.value.body
        assert set(err) == {"message", "type", "param", "code"} and err["message"], (kw, err)
        named = next(iter(kw.get("extra_body", kw)))
        assert err["param"] == named or named in err["message"], (kw, err)
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model=MODEL, prompt="x", echo=True)
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client.completions.create(model=MODEL, prompt=[1, 2, 99999], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="256"):  # too long for max_model_len
        client.completions.create(model=MODEL, prompt=[5] * 300, max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other-model", prompt="x", max_tokens=2)
    # pydantic errors and broken JSON come back in OpenAI's shape, as 400s
    status, _, body = server.request("POST", "/v1/chat/completions", {"model": MODEL, "messages": msgs,
                                                                      "max_tokens": "many"})
    assert status == 400 and body["error"]["param"] == "max_tokens" and body["error"]["type"] == "invalid_request_error"
    status, _, body = server.request("POST", "/v1/completions", {"prompt": 5})  # a union: named as the field
    assert status == 400 and body["error"]["param"] == "prompt" and "string or a valid list" in body["error"]["message"]
    status, _, body = server.request("POST", "/v1/completions", {"prompt": [5] * 300, "max_tokens": 2})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    status, _, body = server.request("POST", "/v1/chat/completions", b"{not json")
    assert status == 400 and "JSON" in body["error"]["message"]
    status, _, body = server.request("POST", "/v1/chat/completions", {"model": MODEL})
    assert status == 400 and body["error"]["param"] == "messages"
    status, _, body = server.request("GET", "/v1/nothing")
    assert status == 404 and set(body["error"]) == {"message", "type", "param", "code"}
    assert server.wait_idle()["in_flight"] == 0  # rejected requests hold no slot


def test_hostile_bodies_get_clear_errors(server):
    """Bodies that once gave a 500, a hang or a stall (found by probing the
    live API): each gets its 4xx, and the server keeps serving."""
    post = lambda body: server.request("POST", "/v1/completions", body)  # noqa: E731
    status, _, body = post(b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}")  # RecursionError in json
    assert status == 400 and body["error"]["code"] == "invalid_json", body
    for raw in (b'{"prompt": "hi \\ud800", "max_tokens": 2}', b'{"prompt": "hi", "model": "\\udc00"}'):
        status, _, body = post(raw)  # a lone surrogate: no UTF-8 text holds it
        assert status == 400 and body["error"]["code"] == "invalid_unicode", (raw, body)
    status, _, body = server.request("POST", "/v1/chat/completions", b'{"messages": [{"role": "user", '
                                     b'"content": "\\ud800"}]}')
    assert status == 400 and body["error"]["code"] == "invalid_unicode", body
    status, _, body = post(b'{"prompt": "hi", "model": "\xed\xb0\x80"}')  # a surrogate as raw bytes
    assert status == 400 and body["error"]["code"] == "invalid_json", body
    status, _, body = post({"prompt": "x", "max_tokens": 2, "pad": "y" * BODY_LIMIT})
    assert status == 413 and body["error"]["code"] == "request_too_large", body
    # A prompt no tokenization could fit is refused before tokenizing (it
    # took the engine's tokenizer, and every stream, 13 s for 10 MB).
    t = time.monotonic()
    status, _, body = post({"prompt": "a " * 300_000, "max_tokens": 2})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded" and time.monotonic() - t < 5, body
    assert "bytes" in body["error"]["message"], body
    status, _, body = server.request("POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "a " * 300_000}], "max_tokens": 2})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body

    # A client that never finishes its body is answered 408 once the timeout
    # passes, and the slot it held is free again.
    with socket.create_connection(("127.0.0.1", server.http_port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n{\"pro")
        s.settimeout(BODY_TIMEOUT + 30)
        t = time.monotonic()
        head = s.recv(4096)
    assert b" 408 " in head.split(b"\r\n")[0] and BODY_TIMEOUT - 0.5 < time.monotonic() - t, head[:200]
    assert server.wait_idle()["in_flight"] == 0
    status, _, body = post({"prompt": "Hello", "max_tokens": 3, "temperature": 0})  # still serving
    assert status == 200 and body["choices"][0]["finish_reason"] in ("length", "stop"), body


def test_values_that_once_failed_a_step_or_a_client(server):
    client = server.client()
    # top_k beyond int64 failed the engine step, and with it every request in flight
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0.8, seed=1,
                                    extra_body={"top_k": 2**63})
    assert out.choices[0].finish_reason == "length"
    # the official client sends an earlier answer back as it came (refusal: null, ...)
    msgs = [{"role": "user", "content": "hi"}]
    first = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0)
    msgs.append(first.choices[0].message.model_dump())
    msgs.append({"role": "user", "content": "and then?", "tool_calls": [], "refusal": None})
    again = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0,
                                           store=False, metadata={"k": "v"})
    assert again.choices[0].finish_reason in ("stop", "length")
    # gRPC: the request id names the client's stream; two clients choosing
    # the same one at once both get served
    channel, stub = grpc_stub(server)
    with channel:
        md = [("authorization", f"Bearer {API_KEY}")]
        make = lambda: stub.Generate(pb.GenerateRequest(prompt="Hello", request_id="dup", params=pb.SamplingParams(  # noqa: E731
            max_tokens=24, temperature=0, ignore_eos=True)), metadata=md)
        a, b = make(), make()
        got_a, got_b = list(a), list(b)
    assert got_a[-1].finished and got_b[-1].finished and {m.request_id for m in got_a + got_b} == {"dup"}
    assert [t for m in got_a for t in m.token_ids] == [t for m in got_b for t in m.token_ids]
    with pytest.raises(openai.BadRequestError, match="tool_calls"):  # a non-empty one is a request
        client.chat.completions.create(model=MODEL, max_tokens=4, messages=[
            {"role": "assistant", "content": "", "tool_calls": [{"id": "1", "type": "function",
                                                                 "function": {"name": "f", "arguments": "{}"}}]}])
