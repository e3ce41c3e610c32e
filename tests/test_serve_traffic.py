"""The Ray Serve front (specray.serve) under traffic, CPU only: gRPC against
HTTP, 16 concurrent streams against the in-process engine, clients that
disconnect mid-stream, requests over the admission limit, metrics. The
application and its clients: serve_harness.py.
"""

import asyncio
import os
import subprocess
import sys
import time

import pytest

from serve_harness import (API_KEY, BODY_LIMIT, LIMIT, MODEL, engine_calls,
                           PROMPTS, REPO, deploy, grpc_stub, open_stream)

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
grpc = pytest.importorskip("grpc")

from specray import LLM, SamplingParams  # noqa: E402
from specray.serve import specray_pb2 as pb  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from deploy(tmp_path_factory)


def test_grpc_streams_the_same_tokens_as_http(server):
    channel, stub = grpc_stub(server)
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
    submits = engine_calls(server.stats(), "submit")
    channel, stub = grpc_stub(server)
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
    assert engine_calls(server.stats(), "submit") == submits  # none of them reached the engine
    status, _, body = server.request("POST", "/v1/completions", {"prompt": [5, 6], "max_tokens": 2})
    assert status == 200 and engine_calls(server.stats(), "submit") == submits + 1, body  # one that does is counted


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
    assert engine_calls(after, "abort") > engine_calls(before, "abort")  # aborted, not run to the end
    assert after["num_steps"] - before["num_steps"] < 150

    # A gRPC client cancelling mid-stream does the same. Cancelled at the
    # first message, several times: a cancel that lands while Serve's proxy
    # writes to the client is the case specray.serve.proxy_cancel covers
    # (without it about 1 in 15 of these ran to the end).
    channel, stub = grpc_stub(server)
    with channel:
        for seed in range(6):
            call = stub.Generate(pb.GenerateRequest(prompt="Hello", params=pb.SamplingParams(
                max_tokens=240, temperature=0.8, seed=seed, ignore_eos=True)),
                metadata=[("authorization", f"Bearer {API_KEY}")])
            next(call)
            call.cancel()
            after2 = server.wait_idle()
            assert after2["in_flight"] == 0 and all(free == cap for free, cap in after2["pools"].values())
            assert engine_calls(after2, "abort") > engine_calls(after, "abort"), seed
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
            channel, stub = grpc_stub(server)
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
    assert engine_calls(st, "abort") - engine_calls(before, "abort") == LIMIT
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
