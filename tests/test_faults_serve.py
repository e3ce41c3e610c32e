"""Faults under the Ray Serve front (loopback, CPU): an app of its own, a
TP 2 target group with its drafter as an actor, deployed by `serve run`.

* the drafter actor's process SIGKILLed with 8 streams in flight: every
  stream completes with the text of a run without the kill, /health says
  "degraded" and then "ok", and later requests speculate again;
* a target rank's process SIGKILLed: every request in flight (SSE streams,
  a non-streamed one, a gRPC stream) gets its error within 5 s (an OpenAI
  error event ending the stream, never a bare [DONE]; 503; UNAVAILABLE),
  the group is rebuilt, a request sent 30 s after the kill succeeds, and
  no actor of the old group is alive;
* a request that breaks the step fails alone, the other 7 identical;
* a stuck step fails Serve's health check and Serve replaces the replica.
"""

import asyncio
import http.client
import json
import os
import signal
import time
from pathlib import Path

import pytest

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"

from serve_harness import run_app  # noqa: E402

ray = pytest.importorskip("ray")
aiohttp = pytest.importorskip("aiohttp")
grpc = pytest.importorskip("grpc")

from ray import serve  # noqa: E402

from specray.serve import specray_pb2 as pb  # noqa: E402
from specray.serve import specray_pb2_grpc as pb_grpc  # noqa: E402

APP, MODEL, KEY = "specray", "tiny-qwen3", "fault-key"
HEADERS = {"Authorization": f"Bearer {KEY}"}
QUESTIONS = ["What is the capital of France?", "Hello world, this is", "Speculative decoding drafts",
             "a test of the", "Paris is", "The tokenizer", "blocks of tokens and", "verifies them at once."]
BAD_SEED, HANG_SEED = 666, 667


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    _, base, grpc_port = run_app(tmp_path_factory, "faults_serve", dict(
        tensor_parallel_size=2, drafter_placement="separate", max_model_len=256, num_kv_blocks=200, kv_block_size=8,
        max_num_seqs=16, max_queued_requests=16, api_key=KEY, stuck_step_s=4.0, health_check_period_s=2.0,
        engine={"drafter_timeout_s": 5.0, "extra": {"fault_injection": [
            {"seed": BAD_SEED, "where": "step"}, {"seed": HANG_SEED, "where": "hang", "hang_s": 600},
            {"where": "pace_degraded", "step_s": 0.2}]}}), attempts=2, timeout=240)
    try:
        wait_health(base, "ok", 180)
        yield {"base": base, "grpc": grpc_port}
    finally:
        serve.shutdown()
        ray.shutdown()


# ------------------------------------------------------------------ helpers
def request(port: int, method: str, path: str, body: dict | None = None, timeout: float = 120) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=json.dumps(body).encode() if body is not None else None,
                     headers={**HEADERS, "Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
        try:
            return resp.status, json.loads(raw)
        except ValueError:
            return resp.status, {"raw": raw.decode(errors="replace")}
    finally:
        conn.close()


def post(port: int, body: dict, timeout: float = 120) -> tuple[int, dict]:
    return request(port, "POST", "/v1/chat/completions", body, timeout)


def health(port: int) -> tuple[int, dict]:
    try:
        return request(port, "GET", "/health", timeout=5)
    except OSError:
        return 0, {}


def wait_health(base: str, status: str, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while health(base)[1].get("status") != status:
        assert time.monotonic() < end, f"/health never said {status!r}: {health(base)}"
        time.sleep(0.2)


def engine_actors(state: str = "ALIVE") -> dict:
    """``{actor id: (class, pid)}`` of the engines' actors in ``state``."""
    import ray._private.state

    return {k: (v["ActorClassName"], v["Pid"]) for k, v in ray._private.state.actors().items()
            if v["State"] == state and v["ActorClassName"] in ("TargetRank", "DrafterActor")}


def follower_pid() -> int:
    """The TP rank that is not rank 0: its process runs its serve loop for
    good (Ray titles the process with the task it runs)."""
    for cls, pid in engine_actors().values():
        if cls == "TargetRank" and b"serve_follower" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
    raise AssertionError(f"no follower among {engine_actors()}")


def chat_body(q: str, seed: int | None = None, max_tokens: int = 120, stream: bool = True) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": q}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": stream}
    if seed is not None:
        body["seed"] = seed
    return body


async def stream(session, port: int, body: dict, events: list, started: asyncio.Event | None = None,
                 after: int = 3) -> dict:
    """One SSE request; every event line is kept with its arrival time."""
    text, spec = "", None
    async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, headers=HEADERS) as r:
        status = r.status
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            events.append((time.monotonic(), data))
            if len(events) >= after and started is not None:
                started.set()
            if data == "[DONE]":
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                continue
            for c in chunk["choices"]:
                text += c["delta"].get("content") or ""
                if c["finish_reason"]:
                    spec = chunk.get("specray")
    if started is not None:
        started.set()  # ended before ``after`` events
    return {"status": status, "text": text, "spec": spec, "events": events}


async def streams(port: int, bodies: list[dict], during=None, after: int = 3):
    """Every body as an SSE stream at once; ``during()`` runs once every
    stream has had ``after`` events."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        started = [asyncio.Event() for _ in bodies]
        tasks = [asyncio.create_task(stream(session, port, b, [], e, after)) for b, e in zip(bodies, started)]
        extra = None
        if during is not None:
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
            extra = await during()
        results = await asyncio.gather(*tasks)
    return results if during is None else (results, extra)


def completed(r: dict) -> bool:
    data = [d for _, d in r["events"]]
    return r["status"] == 200 and data[-1] == "[DONE]" and not any('"error"' in d for d in data)


def metric(name: str, timeout_s: float = 60.0, want=lambda v: True) -> float:
    """A specray metric's value on this node's Prometheus endpoint, once
    ``want`` holds for it (Ray exports every few seconds)."""
    import urllib.request

    node = next(n for n in ray.nodes() if n["Alive"])
    url = f"http://127.0.0.1:{node['MetricsExportPort']}/metrics"
    end, value = time.monotonic() + timeout_s, None
    while time.monotonic() < end:
        for line in urllib.request.urlopen(url, timeout=10).read().decode().splitlines():
            if line.startswith(f"ray_{name}") and not line.startswith("#"):
                value = float(line.rsplit(" ", 1)[1])
        if value is not None and want(value):
            return value
        time.sleep(2)
    raise AssertionError(f"{name} = {value}")


# -------------------------------------------------------------------- tests
def test_drafter_killed_with_8_streams_in_flight(app):
    base = app["base"]
    bodies = [chat_body(q) for q in QUESTIONS]
    baseline = asyncio.run(streams(base, bodies))
    assert all(completed(r) for r in baseline)
    assert health(base) == (200, {"status": "ok"})
    drafter = [pid for cls, pid in engine_actors().values() if cls == "DrafterActor"]
    assert len(drafter) == 1
    seen = []

    async def kill_and_watch():
        os.kill(drafter[0], signal.SIGKILL)
        end = time.monotonic() + 120
        while time.monotonic() < end:  # until the new drafter is up again
            status = (await asyncio.to_thread(health, base))[1].get("status")
            seen.append(status)
            if status == "ok" and "degraded" in seen:
                return
            await asyncio.sleep(0.1)

    results, _ = asyncio.run(streams(base, bodies, kill_and_watch))
    assert all(completed(r) for r in results), [r["events"][-2:] for r in results]
    assert [r["text"] for r in results] == [r["text"] for r in baseline]
    assert "degraded" in seen and seen[-1] == "ok", seen  # degraded, then healthy again
    assert set(seen) <= {"ok", "degraded"}  # never unavailable: the replica served throughout
    st = serve.get_app_handle(APP).engine_stats.remote().result()
    assert st["drafter"]["losses"] == 1 and st["drafter"]["restarts"] == 1 and st["drafter"]["reseeded"] > 0
    assert metric("specray_drafter_losses", want=lambda v: v >= 1) == 1
    assert metric("specray_drafter_up", want=lambda v: v == 1) == 1
    # later requests speculate again: what the run before the kill drafted
    later = asyncio.run(streams(base, bodies))
    assert [r["text"] for r in later] == [r["text"] for r in baseline]
    steps = [a for r in later for a in r["spec"]["acceptance_lengths"]]
    assert sum(steps) / len(steps) > 1.0
    assert [r["spec"]["acceptance_lengths"] for r in later] == [r["spec"]["acceptance_lengths"] for r in baseline]


def test_a_request_that_breaks_the_step_fails_alone(app):
    base = app["base"]
    bodies = [chat_body(q, max_tokens=40) for q in QUESTIONS]
    baseline = asyncio.run(streams(base, bodies))
    bodies[2] = chat_body(QUESTIONS[2], seed=BAD_SEED, max_tokens=40)
    results = asyncio.run(streams(base, bodies, after=1))
    assert [r["text"] for i, r in enumerate(results) if i != 2] == [r["text"] for i, r in enumerate(baseline) if i != 2]
    assert all(completed(r) for i, r in enumerate(results) if i != 2)
    last = json.loads(results[2]["events"][-1][1])
    assert last["error"]["code"] == "request_failed" and "injected step failure" in last["error"]["message"]
    status, body = post(base, chat_body(QUESTIONS[2], seed=BAD_SEED, stream=False))
    assert status == 500 and body["error"]["code"] == "request_failed"
    assert health(base) == (200, {"status": "ok"})


def test_target_rank_killed_with_requests_in_flight(app):
    base = app["base"]
    before = engine_actors()
    assert sorted(cls for cls, _ in before.values()) == ["DrafterActor", "TargetRank", "TargetRank"]
    victim = follower_pid()
    box = {}

    def grpc_stream():
        channel = grpc.insecure_channel(f"127.0.0.1:{app['grpc']}")
        grpc.channel_ready_future(channel).result(timeout=30)
        stub = pb_grpc.SpecRayStub(channel)
        req = pb.GenerateRequest(prompt="Hello world", params=pb.SamplingParams(max_tokens=200, temperature=0,
                                                                               ignore_eos=True))
        try:
            for _ in stub.Generate(req, metadata=[("authorization", f"Bearer {KEY}")]):
                pass
            return None, time.monotonic()
        except grpc.RpcError as e:
            return (e.code(), e.details()), time.monotonic()
        finally:
            channel.close()

    async def kill():
        plain = asyncio.create_task(asyncio.to_thread(
            lambda: (post(base, chat_body(QUESTIONS[0], stream=False, max_tokens=200)), time.monotonic())))
        rpc = asyncio.create_task(asyncio.to_thread(grpc_stream))
        await asyncio.sleep(0.5)  # those two are generating too
        box["t"] = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        return await plain, await rpc

    bodies = [chat_body(q, max_tokens=200) for q in QUESTIONS]
    results, ((plain, plain_t), (rpc_code, rpc_t)) = asyncio.run(streams(base, bodies, kill))
    t = box["t"]
    for r in results:  # each stream ends with an error event, within 5 s
        when, data = r["events"][-1]
        assert data != "[DONE]" and json.loads(data)["error"]["code"] == "engine_unavailable", data
        assert when - t < 5.0, when - t
    assert plain[0] == 503 and plain[1]["error"]["code"] == "engine_unavailable" and plain_t - t < 5
    assert rpc_code[0] == grpc.StatusCode.UNAVAILABLE and rpc_t - t < 5, rpc_code
    print(f"errors after the rank kill: SSE {max(r['events'][-1][0] for r in results) - t:.2f} s (slowest of 8), "
          f"non-streamed {plain_t - t:.2f} s, gRPC {rpc_t - t:.2f} s")
    # a request right away waits for the rebuilt group; one 30 s after the kill is served too
    status, body = post(base, chat_body(QUESTIONS[1], stream=False, max_tokens=8))
    assert status == 200 and body["choices"][0]["finish_reason"] == "length", body
    time.sleep(max(0.0, t + 30 - time.monotonic()))
    assert post(base, chat_body(QUESTIONS[1], stream=False, max_tokens=8))[0] == 200
    assert health(base) == (200, {"status": "ok"})
    after = engine_actors()
    assert not set(after) & set(before)  # nothing of the old group is alive
    assert set(before) <= set(engine_actors("DEAD"))
    assert sorted(cls for cls, _ in after.values()) == ["DrafterActor", "TargetRank", "TargetRank"]
    st = serve.get_app_handle(APP).engine_stats.remote().result()
    assert st["num_unfinished"] == 0 and all(free == cap for free, cap in st["pools"].values())


@pytest.mark.slow
def test_a_stuck_step_gets_the_replica_replaced(app):
    """A step that never ends (a hung collective, here a hook's sleep): the
    health check fails once it has run past stuck_step_s, Serve replaces
    the replica, and the app serves again."""
    base = app["base"]
    before = engine_actors()

    def hang():
        try:
            post(base, chat_body(QUESTIONS[0], seed=HANG_SEED, stream=False))
        except OSError:
            pass  # the replica went away under it

    import threading

    threading.Thread(target=hang, daemon=True).start()
    t = time.monotonic()
    end = t + 180
    while set(engine_actors()) & set(before):  # the old replica's engine is gone
        assert time.monotonic() < end, "Serve never replaced the stuck replica"
        time.sleep(0.5)
    wait_health(base, "ok", 180)
    assert post(base, chat_body(QUESTIONS[1], stream=False, max_tokens=8))[0] == 200
