"""The Ray Serve front (specray.serve) on a loopback Ray cluster, CPU only.

One application serves every test: deployed by `serve run` (a subprocess
joined to this module's cluster through RAY_ADDRESS) from a copy of
deploy/ray/serve.yaml whose model paths, ports and sizes point at tiny random
checkpoints. The engine runs with the Ray backend (target rank + drafter
actor). Clients: the real `openai` client, raw HTTP over sockets (for
disconnects and 429s), gRPC stubs and examples/grpc_client.py.
"""

import asyncio
import http.client
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

# Ray reads this when it is imported: set it before (see also the fixture).
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"

from factories import add_tokenizer, free_port, make_drafter, make_target  # noqa: E402

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
grpc = pytest.importorskip("grpc")

from ray import serve  # noqa: E402

from specray import LLM, SamplingParams  # noqa: E402
from specray.serve import specray_pb2 as pb  # noqa: E402
from specray.serve import specray_pb2_grpc as pb_grpc  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
API_KEY = "test-key-123"
APP = "specray"
MODEL = "tiny-qwen3"
MAX_NUM_SEQS = 8
MAX_QUEUED = 8
LIMIT = MAX_NUM_SEQS + MAX_QUEUED  # generation requests a replica admits at once
BODY_LIMIT, BODY_TIMEOUT = 1 << 20, 3.0
PROMPTS = [
    "The capital of France is", "Hello world, this is", "Speculative decoding drafts", "a test of the",
    "Paris is", "The tokenizer", "blocks of tokens and", "verifies them at once.",
    "Hello", "France", "world, this is a test", "The capital", "drafts a block", "of the tokenizer",
    "at once", "is Paris.",
]



class Server:
    def __init__(self, root: Path, http_port: int, grpc_port: int):
        self.root, self.http_port, self.grpc_port = root, http_port, grpc_port
        self.base = f"http://127.0.0.1:{http_port}"

    # ---- raw HTTP (stdlib), for what the openai client hides
    def request(self, method: str, path: str, body=None, key: str | None = API_KEY, timeout: float = 120):
        conn = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=timeout)
        headers = {"Content-Type": "application/json"}
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        raw = resp.read()
        conn.close()
        try:
            payload = json.loads(raw)
        except ValueError:
            payload = raw.decode()
        return resp.status, resp.headers, payload  # headers: case-insensitive

    def client(self, key: str = API_KEY, async_: bool = False):
        cls = openai.AsyncOpenAI if async_ else openai.OpenAI
        return cls(base_url=f"{self.base}/v1", api_key=key, max_retries=0, timeout=120)

    def stats(self) -> dict:
        return serve.get_app_handle(APP).engine_stats.remote().result()

    def wait_idle(self, timeout: float = 30.0) -> dict:
        """Until no request is in flight and every KV block is free."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.stats()
            idle = (st["in_flight"] == 0 and st["num_unfinished"] == 0 and st["running"] == 0
                    and all(free == cap for free, cap in st["pools"].values()))
            if idle or time.monotonic() > deadline:
                return st
            time.sleep(0.1)


async def open_stream(port: int, body: dict, key: str = API_KEY, path: str = "/v1/completions",
                      first_event: bool = True):
    """A streaming request on a raw socket; returns once the first SSE event
    arrived (the request is generating), or once sent."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = json.dumps(body).encode()
    writer.write((f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  f"Authorization: Bearer {key}\r\nContent-Length: {len(data)}\r\n\r\n").encode() + data)
    await writer.drain()
    if not first_event:
        return reader, writer
    status_line = await asyncio.wait_for(reader.readline(), 120)
    assert b" 200 " in status_line, status_line
    while (await reader.readline()) not in (b"\r\n", b""):
        pass
    while True:
        line = await asyncio.wait_for(reader.readline(), 120)
        if b"data: " in line:
            return reader, writer


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from specray.serve.loopback import prepare_local_ray

    # Loopback only: Ray (even if another test module imported it before the
    # variable was set), the engine's gloo group, and Serve's gRPC proxy
    # (which Serve would bind to [::]); the actors inherit this environment.
    prepare_local_ray("127.0.0.1")
    root = tmp_path_factory.mktemp("serve")
    hf = make_target(root / MODEL, seed=2)
    add_tokenizer(root / MODEL, hf.config.vocab_size)
    make_drafter(root / "drafter", hf.config, seed=12, block_size=8)
    # address="local": a fresh cluster even if `ray start` left an address file.
    ray.init(address="local", num_cpus=8, _node_ip_address="127.0.0.1", include_dashboard=False,
             logging_level="ERROR")
    # A Serve client cached by an earlier module names that cluster's
    # controller, which is gone with it: serve.status() would call a dead actor.
    from ray.serve.context import _set_global_client

    _set_global_client(None)
    srv = Server(root, free_port(), free_port())
    cfg = yaml.safe_load((REPO / "deploy/ray/serve.yaml").read_text())
    cfg["http_options"].update(host="127.0.0.1", port=srv.http_port)
    cfg["grpc_options"]["port"] = srv.grpc_port
    app = cfg["applications"][0]
    app["args"].update(target=str(root / MODEL), drafter=str(root / "drafter"), device="cpu",
                       max_model_len=256, num_kv_blocks=160, kv_block_size=8, max_num_seqs=MAX_NUM_SEQS,
                       max_queued_requests=MAX_QUEUED, api_key=API_KEY, max_request_bytes=BODY_LIMIT,
                       request_body_timeout_s=BODY_TIMEOUT)
    (root / "serve.yaml").write_text(yaml.safe_dump(cfg))
    env = dict(os.environ, RAY_ADDRESS=ray.get_runtime_context().gcs_address)
    proc = subprocess.run([sys.executable, "-m", "ray.serve.scripts", "run", str(root / "serve.yaml"),
                           "--non-blocking"], env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if srv.request("GET", "/health", key=None, timeout=5)[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the app did not come up"
            time.sleep(0.5)
        yield srv
    finally:
        serve.shutdown()
        ray.shutdown()


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
    channel, stub = _grpc_stub(server)
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
    channel, stub = _grpc_stub(server)
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
    channel, stub = _grpc_stub(server)
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


def _grpc_stub(server):
    channel = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}")
    return channel, pb_grpc.SpecRayStub(channel)


def test_grpc_streams_the_same_tokens_as_http(server):
    channel, stub = _grpc_stub(server)
    md = [("authorization", f"Bearer {API_KEY}")]
    with channel:
        models = stub.ListModels(pb.ListModelsRequest(), metadata=md)
        assert [m.id for m in models.models] == [MODEL] and models.models[0].speculative
        for prompt in ("Speculative decoding drafts", "Hello world"):
            http = server.client().completions.create(
                model=MODEL, prompt=prompt, max_tokens=20, temperature=0, extra_body={"return_token_ids": True})
            msgs = list(stub.Generate(pb.GenerateRequest(
                model=MODEL, prompt=prompt, params=pb.SamplingParams(max_tokens=20, temperature=0)), metadata=md))
            assert sum((list(m.token_ids) for m in msgs), []) == http.choices[0].model_extra["token_ids"]
            assert "".join(m.text for m in msgs) == http.choices[0].text
            last = msgs[-1]
            assert last.finished and not any(m.finished for m in msgs[:-1])
            assert last.finish_reason == http.choices[0].finish_reason
            assert last.usage.completion_tokens == http.usage.completion_tokens
            assert list(last.stats.acceptance_lengths) == http.model_extra["specray"]["acceptance_lengths"]
        # chat over gRPC == chat over HTTP
        q = "What is the capital of France?"
        http = server.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": q}], max_tokens=10, temperature=0)
        req = pb.GenerateRequest(params=pb.SamplingParams(max_tokens=10, temperature=0))
        req.messages.messages.add(role="user", content=q)
        assert "".join(m.text for m in stub.Generate(req, metadata=md)) == http.choices[0].message.content
        # log probabilities: HTTP's figures, an entry per token id of each message
        http = server.client().completions.create(model=MODEL, prompt="Hello world", max_tokens=8, temperature=0,
                                                  logprobs=2, extra_body={"ignore_eos": True})
        msgs = list(stub.Generate(pb.GenerateRequest(prompt="Hello world", params=pb.SamplingParams(
            max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)), metadata=md))
        assert all(len(m.logprobs) == len(m.token_ids) for m in msgs)
        entries = [e for m in msgs for e in m.logprobs]
        assert [e.logprob for e in entries] == pytest.approx(http.choices[0].logprobs.token_logprobs, abs=1e-5)
        assert all(len(e.top) == 2 and e.top[0].token_id == e.token_id for e in entries)
        plain = list(stub.Generate(pb.GenerateRequest(prompt="Hello world", params=pb.SamplingParams(max_tokens=3)),
                                   metadata=md))
        assert not any(m.logprobs for m in plain)
        # errors map to gRPC codes
        for metadata, request, code in [
            ([("authorization", "Bearer nope")], pb.GenerateRequest(prompt="x"), grpc.StatusCode.UNAUTHENTICATED),
            ([], pb.GenerateRequest(prompt="x"), grpc.StatusCode.UNAUTHENTICATED),
            (md, pb.GenerateRequest(prompt="x", params=pb.SamplingParams(top_p=0)), grpc.StatusCode.INVALID_ARGUMENT),
            (md, pb.GenerateRequest(prompt="x", params=pb.SamplingParams(logprobs=21)),
             grpc.StatusCode.INVALID_ARGUMENT),
            (md, pb.GenerateRequest(), grpc.StatusCode.INVALID_ARGUMENT),
            (md, pb.GenerateRequest(model="nope", prompt="x"), grpc.StatusCode.NOT_FOUND),
        ]:
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(request, metadata=metadata))
            assert e.value.code() == code, (request, e.value.details())
        with pytest.raises(grpc.RpcError) as e:
            stub.ListModels(pb.ListModelsRequest())
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_grpc_request_size_is_bounded_like_http(server):
    """Serve's gRPC proxy takes messages up to 2 GB, and max_request_bytes
    bounded HTTP bodies only: a 1 MB request_id came back in every message,
    and a prompt of millions of ids travelled whole to the engine, which
    took seconds to refuse it. Too large a request gets RESOURCE_EXHAUSTED
    (gRPC's code for an oversized message; HTTP's 413), and a prompt that its
    length alone rules out is refused before it reaches the engine."""
    md = [("authorization", f"Bearer {API_KEY}")]
    server.wait_idle()
    submits = server.stats()["calls"]["submit"]
    channel, stub = _grpc_stub(server)
    with channel:
        for request, code in [
            (pb.GenerateRequest(prompt="Hello", request_id="x" * BODY_LIMIT, params=pb.SamplingParams(max_tokens=2)),
             grpc.StatusCode.RESOURCE_EXHAUSTED),
            (pb.GenerateRequest(prompt="Hello", params=pb.SamplingParams(max_tokens=2, stop=["y" * BODY_LIMIT])),
             grpc.StatusCode.RESOURCE_EXHAUSTED),
            (pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[5] * 300_000)), grpc.StatusCode.INVALID_ARGUMENT),
            (pb.GenerateRequest(prompt="a " * 300_000), grpc.StatusCode.INVALID_ARGUMENT),
        ]:
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(request, metadata=md))
            assert e.value.code() == code, e.value.details()[:200]
            assert str(BODY_LIMIT) in e.value.details() or "256" in e.value.details(), e.value.details()[:200]
    status, _, body = server.request("POST", "/v1/completions", {"prompt": [5] * 300_000, "max_tokens": 2})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    assert server.stats()["calls"]["submit"] == submits  # none of them reached the engine


def test_grpc_example_client(server):
    env = dict(os.environ, SPECRAY_API_KEY=API_KEY)
    out = subprocess.run([sys.executable, str(REPO / "examples/grpc_client.py"), "Hello world", "--port",
                          str(server.grpc_port), "--max-tokens", "8"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "finish_reason=" in out.stdout and "mean_acceptance_length=" in out.stdout


def test_16_concurrent_streams_match_in_process_llm(server):
    server.wait_idle()
    n_tokens = 24
    want = LLM(server.root / MODEL, server.root / "drafter").generate(
        PROMPTS, SamplingParams(max_tokens=n_tokens, temperature=0))

    async def one(client, prompt):
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=n_tokens, temperature=0,
                                                 stream=True, extra_body={"return_token_ids": True})
        text, ids, reasons = "", [], []
        async for chunk in stream:
            c = chunk.choices[0]
            text += c.text
            ids += c.model_extra.get("token_ids", [])
            reasons.append(c.finish_reason)
        return text, ids, reasons

    async def run():
        client = server.client(async_=True)
        try:
            return await asyncio.gather(*(one(client, p) for p in PROMPTS))
        finally:
            await client.close()

    assert len(PROMPTS) == 16
    got = asyncio.run(run())
    for (text, ids, reasons), ref in zip(got, want):
        assert ids == ref.token_ids and text == ref.text
        assert reasons[-1] == ref.finish_reason and all(r is None for r in reasons[:-1])
    st = server.wait_idle()
    assert all(free == cap for free, cap in st["pools"].values())


def test_disconnect_mid_stream_aborts_and_frees_kv(server):
    server.wait_idle()
    before = server.stats()
    # The requests to be cut off sample: greedy ones may take prompt-lookup
    # drafts, which on this random model's repetitive output can finish in a
    # few steps, before the disconnect arrives.
    body = {"model": MODEL, "prompt": "Hello world", "max_tokens": 200, "temperature": 0.8, "seed": 1,
            "stream": True, "ignore_eos": True}

    async def survivor():
        client = server.client(async_=True)
        try:
            stream = await client.completions.create(model=MODEL, prompt="Paris is", max_tokens=40, temperature=0,
                                                     stream=True, extra_body={"ignore_eos": True})
            return "".join([c.choices[0].text async for c in stream])
        finally:
            await client.close()

    async def drop_http():
        other = asyncio.ensure_future(survivor())  # shares the engine (and its output pump)
        reader, writer = await open_stream(server.http_port, body)
        for _ in range(3):
            await reader.readline()
        during = await asyncio.to_thread(server.stats)
        writer.transport.abort()  # the client vanishes mid-stream
        return during, await other

    during, survived = asyncio.run(drop_http())
    alone = server.client().completions.create(model=MODEL, prompt="Paris is", max_tokens=40, temperature=0,
                                               extra_body={"ignore_eos": True})
    assert survived == alone.choices[0].text  # the other stream was not disturbed
    assert during["running"] + during["waiting"] >= 1 and during["in_flight"] >= 1
    assert min(free for free, _ in during["pools"].values()) < max(cap for _, cap in during["pools"].values())
    after = server.wait_idle()
    assert after["in_flight"] == 0 and after["num_unfinished"] == 0
    assert all(free == cap for free, cap in after["pools"].values()), after["pools"]
    assert after["calls"]["abort"] > before["calls"]["abort"]  # aborted, not run to the end
    assert after["num_steps"] - before["num_steps"] < 150

    # A gRPC client cancelling mid-stream does the same. Cancelled at the
    # first message, several times: a cancel that lands while Serve's proxy
    # writes to the client is the case specray.serve.proxy_cancel covers
    # (without it about 1 in 15 of these ran to the end).
    channel, stub = _grpc_stub(server)
    with channel:
        for seed in range(6):
            call = stub.Generate(pb.GenerateRequest(prompt="Hello", params=pb.SamplingParams(
                max_tokens=240, temperature=0.8, seed=seed, ignore_eos=True)),
                metadata=[("authorization", f"Bearer {API_KEY}")])
            next(call)
            call.cancel()
            after2 = server.wait_idle()
            assert after2["in_flight"] == 0 and all(free == cap for free, cap in after2["pools"].values())
            assert after2["calls"]["abort"] > after["calls"]["abort"], seed
            assert after2["num_steps"] - after["num_steps"] < 150, seed
            after = after2


def test_proxy_cancels_the_call_of_a_request_that_ended_mid_stream(monkeypatch):
    """The race in specray.serve.proxy_cancel without a cluster: the proxy's
    task is cancelled while it is not reading the replica's stream (it was
    writing to the client). Serve's own class leaves the replica call
    running; the installed one cancels it, and only when the stream was not
    read to its end."""
    from ray.serve._private import proxy
    from ray.serve.handle import DeploymentResponseGenerator

    from specray.serve import proxy_cancel

    class FakeReplicaStream(DeploymentResponseGenerator):
        def __init__(self):
            self.sent, self.cancels = 0, 0

        def cancel(self):
            self.cancels += 1

        def cancelled(self):
            return self.cancels > 0

        async def __anext__(self):
            if self.sent == 3:
                raise StopAsyncIteration
            self.sent += 1
            return self.sent

    async def proxy_task(cls, read_all: bool):
        stream = FakeReplicaStream()

        async def handler():
            gen = cls(stream)
            if read_all:
                return [x async for x in gen]
            await gen.__anext__()
            await asyncio.Event().wait()  # writing to a client that is gone

        task = asyncio.ensure_future(handler())
        await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0)  # done callbacks run
        return stream

    monkeypatch.setattr(proxy, "ProxyResponseGenerator", proxy.ProxyResponseGenerator)
    serves_own = proxy.ProxyResponseGenerator
    assert asyncio.run(proxy_task(serves_own, read_all=False)).cancels == 0  # the race, unpatched
    assert proxy_cancel.install()
    assert proxy_cancel.install()  # idempotent: one subclass, not a chain
    patched = proxy.ProxyResponseGenerator
    assert patched is not serves_own and patched.__mro__[1] is serves_own
    assert asyncio.run(proxy_task(patched, read_all=False)).cancels == 1
    finished = asyncio.run(proxy_task(patched, read_all=True))
    assert finished.sent == 3 and finished.cancels == 0


def test_over_limit_gets_429_then_recovers(server):
    server.wait_idle()
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 200, "temperature": 0, "stream": True,
            "ignore_eos": True}

    async def saturate():
        # LIMIT streams: MAX_NUM_SEQS run, the rest wait in the engine's queue
        # (their response has not started: it starts with the first token).
        streams = await asyncio.gather(*(open_stream(server.http_port, body, first_event=False)
                                         for _ in range(LIMIT)))
        try:
            deadline = time.monotonic() + 60
            while (st := await asyncio.to_thread(server.stats))["in_flight"] < LIMIT:
                assert time.monotonic() < deadline, st
                await asyncio.sleep(0.1)
            assert st["in_flight"] == LIMIT and st["max_in_flight"] == LIMIT
            results = [await asyncio.to_thread(server.request, "POST", "/v1/completions",
                                               {"model": MODEL, "prompt": "x", "max_tokens": 2})
                       for _ in range(3)]
            chat = await asyncio.to_thread(server.request, "POST", "/v1/chat/completions",
                                           {"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
            channel, stub = _grpc_stub(server)
            with channel:
                try:
                    list(stub.Generate(pb.GenerateRequest(prompt="x"),
                                       metadata=[("authorization", f"Bearer {API_KEY}")]))
                    grpc_code = grpc.StatusCode.OK
                except grpc.RpcError as e:
                    grpc_code = e.code()
            def openai_call():
                try:
                    server.client().completions.create(model=MODEL, prompt="x", max_tokens=2)
                except openai.RateLimitError as e:
                    return e
            assert isinstance(await asyncio.to_thread(openai_call), openai.RateLimitError)
            health = await asyncio.to_thread(server.request, "GET", "/health", None, None)
            models = await asyncio.to_thread(server.request, "GET", "/v1/models")
            return results + [chat], grpc_code, health, models
        finally:
            for _, writer in streams:
                writer.transport.abort()

    before = server.stats()
    rejected, grpc_code, health, models = asyncio.run(saturate())
    for status, headers, payload in rejected:
        assert status == 429 and int(headers["Retry-After"]) >= 0
        assert payload["error"]["code"] == "rate_limit_exceeded"
    assert grpc_code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert health[0] == 200 and models[0] == 200  # cheap routes still answer under load
    # every client left (the queued ones before their first byte): all aborted and freed
    st = server.wait_idle()
    assert st["in_flight"] == 0 and st["waiting"] == 0 and all(free == cap for free, cap in st["pools"].values())
    assert st["calls"]["abort"] - before["calls"]["abort"] == LIMIT
    assert st["num_steps"] - before["num_steps"] < 150  # nobody ran to its 200 tokens
    # once the load is gone, requests go through again
    out = server.client().completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
    assert out.usage.completion_tokens >= 1


def test_metrics_exported(server):
    """The specray_* metrics reach Ray's Prometheus endpoint on the node."""
    node = next(n for n in ray.nodes() if n["Alive"])
    url = f"http://127.0.0.1:{node['MetricsExportPort']}/metrics"
    import urllib.request

    names = ("specray_requests", "specray_time_to_first_token_seconds", "specray_spec_decode_num_draft_tokens",
             "specray_spec_decode_num_accepted_tokens_per_pos", "specray_num_requests_running",
             'endpoint="completions"', 'status="429"', 'position="0"')
    deadline = time.monotonic() + 60
    while True:
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        missing = [n for n in names if n not in text]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert not missing, (missing, [line for line in text.splitlines() if "specray" in line][:40])
